"""The FastAPI app: routes, auth, body limits, OpenAI-style errors, and the shared generation helper."""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import brisk
from brisk.config import EngineConfig
from brisk.engine.client import AsyncEngineClient, EngineDeadError, RequestFailedError
from brisk.engine.output_processor import CompletionDelta
from brisk.sampling_params import SamplingParams
from brisk.server.errors import APIError, error_response
from brisk.server.metrics import ServerMetrics
from brisk.server.protocol import DetokenizeRequest, TokenizeRequest


@dataclass
class ServerState:
    client: AsyncEngineClient
    tokenizer: Any
    config: EngineConfig
    model_name: str
    generation_defaults: dict[str, Any]
    is_harmony: bool
    api_key: str | None = None
    max_request_body_size: int = 8 << 20
    metrics: ServerMetrics = field(init=False)
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name)

    # ---- request helpers shared by the endpoints -----------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model):
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        info = self.client.info
        if not prompt_ids:
            raise APIError(400, "The prompt is empty.", param="prompt")
        bad = next((t for t in prompt_ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} is outside the vocabulary [0, {info.vocab_size}).", param="prompt")
        room = info.max_seq_len - len(prompt_ids)
        if room <= 0 or (params.max_tokens is not None and params.max_tokens > room):
            raise APIError(400, f"This model's maximum context length is {info.max_seq_len} tokens; the request has "
                                f"{len(prompt_ids)} prompt tokens and asks for {params.max_tokens} more.",
                           param="max_tokens", code="context_length_exceeded")
        for t in params.stop_token_ids + list(params.logit_bias or {}):
            if not 0 <= t < info.vocab_size:
                raise APIError(400, f"Token id {t} (stop_token_ids / logit_bias) is outside the vocabulary.")

    def sampling_params(self, req) -> SamplingParams:
        try:
            return req.to_sampling_params(self.generation_defaults)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def admit(self) -> None:
        if self.client.dead:
            raise APIError(503, "The engine is not running.", code="engine_dead")
        if self.client.num_in_flight >= self.config.max_batch_size + self.config.max_num_waiting:
            raise APIError(429, "The server is at capacity; retry later.", code="queue_full",
                           headers={"Retry-After": "1"})

    async def generate(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None
                       ) -> AsyncIterator[CompletionDelta]:
        """Engine deltas for one prompt, with metrics; raises APIError for engine-side failures."""
        rid = uuid.uuid4().hex
        start = time.perf_counter()
        token_times: list[float] = []
        last = None
        try:
            async for delta in self.client.generate(rid, prompt_ids, params, prompt):
                if delta.token_ids:
                    token_times.append(time.perf_counter())
                last = delta
                yield delta
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except RequestFailedError as exc:
            raise APIError(400, str(exc)) from None
        finally:
            if last is not None and last.output.finished:
                outs = last.output.outputs
                self.metrics.observe_request(
                    len(prompt_ids), sum(len(o.token_ids) for o in outs), [o.finish_reason for o in outs],
                    token_times[0] - start if token_times else None, token_times, time.perf_counter() - start,
                )


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="brisk", version=brisk.__version__)
    app.state.brisk = state

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if state.api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            expected = f"Bearer {state.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return error_response(401, "Invalid or missing API key.", code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.max_request_body_size:
            return error_response(413, f"Request body larger than {state.max_request_body_size} bytes.")
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in errors[:5]
        )
        return error_response(400, message, ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        message = "Not found." if exc.status_code == 404 else str(exc.detail)
        return error_response(exc.status_code, message)

    @app.get("/health")
    async def health():
        if state.client.dead or state.client.info is None:
            return error_response(503, "The engine is not running.", code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": brisk.__version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "brisk",
            "root": state.config.model, "max_model_len": state.client.info.max_seq_len,
        }]}

    @app.get("/metrics")
    async def metrics():
        state.metrics.observe_engine(state.client.stats)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give exactly one of 'prompt' and 'messages'.")
        if req.messages is not None:
            from brisk.server.chat import render_chat_prompt

            tokens = render_chat_prompt(state, req.messages, None, None, {}, req.add_generation_prompt)
        else:
            tokens = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.client.info.max_seq_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state.check_model(req.model)
        vocab = state.client.info.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"Token ids must be in [0, {vocab}).", param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    from brisk.server import chat, completions, responses

    chat.register(app, state)
    completions.register(app, state)
    responses.register(app, state)
    return app


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


async def stream_with_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once an SSE stream has started, an error can only be reported in-band, then the stream ends."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield sse({"error": {"message": exc.message, "type": "server_error" if exc.status >= 500 else
                             "invalid_request_error", "param": exc.param, "code": exc.code}})
    yield "data: [DONE]\n\n"


def json_response(body: dict) -> JSONResponse:
    return JSONResponse(body)
