"""Health, version, models, Prometheus metrics, and the tokenizer endpoints."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse, Response

import brisk
from brisk.server.errors import APIError, error_response
from brisk.server.protocol import DetokenizeRequest, TokenizeRequest
from brisk.server.schemas import (
    ERROR_RESPONSES,
    DetokenizeResult,
    ModelCard,
    ModelList,
    TokenizeResult,
    VersionInfo,
)
from brisk.server.state import ServerState, server_state

router = APIRouter()


@router.get(
    "/health",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string", "maxLength": 0}}}}},
)
async def health(state: ServerState = Depends(server_state)) -> Response:
    """200 with an empty body while the engine runs and the server takes work; 503 otherwise."""
    if state.client.dead or state.client.info is None:
        return error_response(503, "The engine is not running.", code="engine_dead")
    if state.draining:
        return error_response(503, "The server is shutting down.", code="shutting_down")
    return PlainTextResponse("")


@router.get("/version", response_model=VersionInfo)
async def version() -> VersionInfo:
    return VersionInfo(version=brisk.__version__)


@router.get("/v1/models", response_model=ModelList)
async def models(state: ServerState = Depends(server_state)) -> ModelList:
    cards = [
        ModelCard(id=name, created=int(state.started), root=state.config.model, max_model_len=state.info.max_seq_len)
        for name in (state.model_name, *state.model_aliases)  # every --served-model-name, as vLLM lists them
    ]
    return ModelList(data=cards)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string", "minLength": 1}}}}},
)
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    """Prometheus text exposition format (summed over the API-server processes, when there are several)."""
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@router.post("/tokenize", response_model=TokenizeResult, responses=ERROR_RESPONSES)
async def tokenize(req: TokenizeRequest, state: ServerState = Depends(server_state)) -> TokenizeResult:
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "Give exactly one of 'prompt' and 'messages'.")
    if req.prompt is not None:
        tokens = await state.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
    else:
        tokens = await state.render_chat(
            req.messages or [],
            None,
            None,
            {},
            req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
    return TokenizeResult(tokens=tokens, count=len(tokens), max_model_len=state.info.max_seq_len)


@router.post("/detokenize", response_model=DetokenizeResult, responses=ERROR_RESPONSES)
async def detokenize(req: DetokenizeRequest, state: ServerState = Depends(server_state)) -> DetokenizeResult:
    state.check_model(req.model)
    vocab = state.info.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"Token ids must be in [0, {vocab}).", param="tokens")
    return DetokenizeResult(prompt=state.tokenizer.decode(req.tokens))
