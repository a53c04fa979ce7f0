"""The routes of `vllm serve` (0.32) and `trtllm-serve` beyond the OpenAI APIs: served, or answered with a reason.

A probe, router or script written for a peer server must never meet a bare "Not found". Every route of theirs
(tests/data/peer_flags/ lists them; `tools/peer_flags.py` rewrites vLLM's) is one of:
- served by brisk's own routers (the three APIs, /health, /tokenize, /metrics, the profiler...);
- served here: vLLM's SageMaker pair `/ping` and `/invocations`, its `/load` and `/is_sleeping`; trtllm-serve's
  `/health_generate`, `/prometheus/metrics`, and its `/perf_metrics` and `/kv_cache_events`, which are empty
  lists, as trtllm-serve's are when `return_perf_metrics` and `event_buffer_max_size` are off (brisk accepts
  only those values of both);
- in `UNSERVED_ROUTES`: a 404 whose message says why brisk has no such route (pooling models, LoRA, sleep mode,
  RL weight updates, disaggregation...), in the OpenAI error shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from brisk.peer_options import _LORA, _SLEEP  # the reasons the peers' LoRA and sleep options are refused with
from brisk.sampling_params import SamplingParams
from brisk.server import admin, chat, completions
from brisk.server.errors import APIError
from brisk.server.protocol import ChatCompletionRequest, CompletionRequest
from brisk.server.state import ServerState, server_state

router = APIRouter(include_in_schema=False)
Body = TypeVar("Body", bound=BaseModel)

_POOLING = "brisk serves generative models: embedding, pooling, classification, scoring and reranking are not served"
_OTHER_API = "brisk serves OpenAI's APIs (/v1/chat/completions, /v1/completions, /v1/responses); {} is not served"
_AUDIO = "brisk serves text models: speech-to-text is not served"
_WEIGHTS = "brisk takes no weight updates while serving (reinforcement-learning endpoints): restart it on new weights"
_DISAGGREGATION = (
    "prefill/decode disaggregation is not available in brisk: a request is rendered, prefilled and decoded by one "
    "server (POST /tokenize gives a prompt's token ids)"
)
_ONE_LAYOUT = "brisk's parallel layout is fixed at start-up (--tensor-parallel-size, --data-parallel-size)"
_ABORT = "a request is aborted by closing its connection (a background Response: POST /v1/responses/{id}/cancel)"


@dataclass(frozen=True)
class UnservedRoute:
    path: str
    methods: tuple[str, ...]
    reason: str


def _unserved(paths: str, reason: str, methods: tuple[str, ...] = ("POST",)) -> list[UnservedRoute]:
    return [UnservedRoute(path, methods, reason) for path in paths.split()]


UNSERVED_ROUTES: list[UnservedRoute] = [
    *_unserved("/v1/embeddings /v2/embed /pooling /classify /score /v1/score /rerank /v1/rerank /v2/rerank", _POOLING),
    *_unserved(
        "/v1/messages /v1/messages/count_tokens /v1/messages/render", _OTHER_API.format("Anthropic's Messages API")
    ),
    *_unserved("/cohere/v2/chat /cohere/v2/chat/render", _OTHER_API.format("Cohere's Chat API")),
    *_unserved(
        "/v1/chat/completions/batch /generative_scoring /v1/systemone /v1/decisions",
        _OTHER_API.format("this vLLM extension (batched chat, generative scoring, structured decisions)"),
    ),
    *_unserved("/v1/audio/transcriptions /v1/audio/translations", _AUDIO),
    *_unserved("/v1/realtime", _AUDIO, ("GET",)),
    *_unserved("/v1/load_lora_adapter /v1/unload_lora_adapter /adapters", _LORA),
    *_unserved("/adapters/{adapter_name}", _LORA, ("DELETE",)),
    *_unserved("/sleep /wake_up /release_kv_cache_memory /release_memory /resume_memory", _SLEEP),
    *_unserved(
        "/pause /resume /update_weights /init_weight_transfer_engine /start_weight_update /finish_weight_update "
        "/start_draft_weight_update /shutdown_weight_transfer_engine /update_weight_version /weight_checker "
        "/collective_rpc",
        _WEIGHTS,
    ),
    *_unserved("/is_paused /weight_info /get_world_size", _WEIGHTS, ("GET",)),
    *_unserved("/abort_requests /inference/v1/abort_requests", _ABORT),
    *_unserved(
        "/inference/v1/generate /v1/chat/completions/render /v1/completions/render /v1/responses/render "
        "/v1/chat/completions/derender /v1/completions/derender /v1/kv_cache_hints",
        _DISAGGREGATION,
    ),
    *_unserved("/steady_clock_offset", _DISAGGREGATION, ("GET", "POST")),
    *_unserved("/kv_event_sources", "brisk publishes no KV cache events", ("GET",)),
    *_unserved("/scale_elastic_ep /is_scaling_elastic_ep", _ONE_LAYOUT),
    *_unserved(
        "/fault_tolerance/apply", "brisk has no fault-tolerance control: a failed engine exits, and is restarted"
    ),
    *_unserved(
        "/fault_tolerance/status", "brisk has no fault-tolerance control: GET /health says whether it serves", ("GET",)
    ),
    *_unserved(
        "/reset_encoder_cache /reset_mm_cache",
        "brisk serves text-only decoder models: there is no encoder or media cache",
    ),
    *_unserved(
        "/reset_prefix_cache",
        "brisk's prefix cache evicts least-recently-used blocks as it needs room; start the server with "
        "--no-enable-prefix-caching for runs without it",
    ),
    *_unserved(
        "/server_info",
        "brisk logs its resolved configuration at start-up (GET /version and /v1/models give version and context length)",
        ("GET",),
    ),
]


def _unserved_handler(route: UnservedRoute):
    message = f"{route.path} is not served by brisk: {route.reason}."

    async def unserved() -> None:
        raise APIError(404, message, code="unsupported_endpoint")

    return unserved


for _route in UNSERVED_ROUTES:
    router.add_api_route(_route.path, _unserved_handler(_route), methods=list(_route.methods))


# ---- served for the peers' clients ---------------------------------------------------------------
@router.get("/tokenizer_info")
async def tokenizer_info(state: ServerState = Depends(server_state)) -> dict[str, Any]:
    """vLLM's, with --enable-tokenizer-info-endpoint (it shows the chat template): the tokenizer's configuration as
    its tokenizer_config.json holds it, its class, and the chat template in effect."""
    if not state.server.enable_tokenizer_info_endpoint:
        raise APIError(
            404,
            "/tokenizer_info is off: start the server with --enable-tokenizer-info-endpoint.",
            code="unsupported_endpoint",
        )
    tokenizer = state.tokenizer
    info = {k: _json_value(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()}
    for path_field in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):  # this machine's paths
        info.pop(path_field, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info


def _json_value(value: Any) -> Any:
    """A tokenizer setting as JSON: special tokens (AddedToken) by their text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


@router.get("/ping", response_class=PlainTextResponse)
@router.post("/ping", response_class=PlainTextResponse)
async def ping(state: ServerState = Depends(server_state)) -> Response:
    """vLLM's SageMaker health check: /health's answer."""
    return await admin.health(state)


@router.post("/invocations")
async def invocations(raw: Request, state: ServerState = Depends(server_state)):
    """vLLM's SageMaker entry point: a chat completion if the body reads as one, else a completion (vLLM's order)."""
    try:
        body = await raw.json()
    except ValueError:
        raise APIError(400, "The request body is not valid JSON.", param="body") from None
    if isinstance(body, dict) and "messages" in body:
        answer = await chat.chat_completions(_parse(ChatCompletionRequest, body), raw, state)
    elif isinstance(body, dict) and "prompt" in body:
        answer = await completions.completions(_parse(CompletionRequest, body), raw, state)
    else:
        raise APIError(400, "/invocations takes a chat completion (messages) or a completion (prompt) request.")
    if isinstance(answer, BaseModel):  # as the endpoint's own route writes it (response_model_exclude_unset)
        return JSONResponse(answer.model_dump(mode="json", exclude_unset=True))
    return answer  # a stream


def _parse(schema: type[Body], body: dict) -> Body:
    """The body as the route's request schema; invalid, the 400 the route itself answers (app.py's handler)."""
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


@router.get("/load")
async def load(state: ServerState = Depends(server_state)) -> dict:
    """vLLM's server load: generation requests in flight (queued or running)."""
    return {"server_load": state.load()}


@router.get("/is_sleeping")
async def is_sleeping() -> dict:
    return {"is_sleeping": False}  # brisk has no sleep mode (vLLM's --enable-sleep-mode is refused)


@router.get("/health_generate", response_class=PlainTextResponse)
async def health_generate(state: ServerState = Depends(server_state)) -> Response:
    """trtllm-serve's deeper health check: one greedy token of a short prompt through the whole engine."""
    answer = await admin.health(state)
    if answer.status_code != 200:
        return answer
    state.admit()
    prompt = await state.encode("hi", "prompt")
    async for _ in state.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), "hi"):
        pass
    return PlainTextResponse("Generation health check OK")


@router.get("/prometheus/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(state: ServerState = Depends(server_state)) -> Response:
    """trtllm-serve's Prometheus path: GET /metrics' text."""
    return await admin.metrics(state)


@router.get("/perf_metrics")
async def perf_metrics() -> list:
    return []  # trtllm-serve's answer without return_perf_metrics, the only value brisk accepts


@router.post("/kv_cache_events")
async def kv_cache_events() -> list:
    return []  # trtllm-serve's answer with no event buffer (event_buffer_max_size 0, the only value brisk accepts)
