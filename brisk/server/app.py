"""The FastAPI app: routes, OpenAI-style errors, and the shared generation helper.

Auth, draining, body limits and the request log are in `middleware.py`; CORS is off unless origins
are configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import brisk
from brisk.config import EngineConfig
from brisk.engine.client import AsyncEngineClient, EngineDeadError, RequestFailedError
from brisk.engine.output_processor import CompletionDelta
from brisk.sampling_params import SamplingParams
from brisk.server.errors import APIError, error_body, error_response
from brisk.server.metrics import RequestTiming, ServerMetrics
from brisk.server.middleware import GuardMiddleware
from brisk.server.protocol import DetokenizeRequest, TokenizeRequest
from brisk.server.tracing import ObservabilityConfig, install_observability

logger = logging.getLogger("brisk.server")
T = TypeVar("T")
INTERNAL_ERROR_MESSAGE = "The server had an internal error while processing the request."


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
    request_timeout: float | None = None  # server-wide cap on a request's run time, seconds
    log_prompts: bool = False
    allowed_origins: list[str] = field(default_factory=list)
    draining: bool = False  # set at shutdown: new requests get 503, in-flight ones finish
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)  # traces, logs, profiling
    metrics: ServerMetrics = field(init=False)
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name)
        self.metrics.bind_engine(self.client, self.config)

    # ---- request helpers shared by the endpoints -----------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model):
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        info = self.client.info
        if not prompt_ids:
            raise APIError(400, "The prompt is empty.", param="prompt")
        bad = next((t for t in prompt_ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} is outside the vocabulary [0, {info.vocab_size}).", param="prompt")
        room = info.max_seq_len - len(prompt_ids)
        if room <= 0 or (params.max_tokens is not None and params.max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {info.max_seq_len} tokens; the request has "
                f"{len(prompt_ids)} prompt tokens and asks for {params.max_tokens} more.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        for t in params.stop_token_ids + list(params.logit_bias or {}):
            if not 0 <= t < info.vocab_size:
                raise APIError(400, f"Token id {t} (stop_token_ids / logit_bias) is outside the vocabulary.")

    def sampling_params(self, req) -> SamplingParams:
        try:
            return req.to_sampling_params(self.generation_defaults)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def admit(self, num_requests: int = 1) -> None:
        """Refuse work the server cannot take now (429, retry) or ever (400), before doing any."""
        if self.client.dead:
            raise APIError(503, "The engine is not running.", code="engine_dead")
        capacity = self.config.max_batch_size + self.config.max_num_waiting
        if num_requests > capacity:
            raise APIError(400, f"A request may hold at most {capacity} prompts.", param="prompt")
        if self.client.num_in_flight + num_requests > capacity:
            raise APIError(
                429, "The server is at capacity; retry later.", code="queue_full", headers={"Retry-After": "1"}
            )

    def timeout_for(self, requested: float | None) -> float | None:
        """The request's own `timeout`, capped by the server's --request-timeout."""
        limits = [t for t in (requested, self.request_timeout) if t is not None]
        return min(limits) if limits else None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None, timeout: float | None = None
    ) -> AsyncIterator[CompletionDelta]:
        """Engine deltas for one prompt, with metrics; raises APIError for engine-side failures.

        A completion that ends with finish_reason "error" (the model produced non-finite logits) fails
        the request: a 500, or an in-band error event once a stream has started.
        """
        rid = uuid.uuid4().hex
        if self.log_prompts:
            logger.info(
                "request %s prompt: %r (%d tokens)", rid, prompt if prompt is not None else prompt_ids, len(prompt_ids)
            )
        timing = RequestTiming(rid, len(prompt_ids), params.max_tokens, params.n)
        last = None
        try:
            async for delta in self.client.generate(rid, prompt_ids, params, prompt, self.timeout_for(timeout)):
                if delta.finish_reason == "error":
                    raise APIError(500, "The model produced non-finite logits for this request.", code="model_error")
                timing.on_delta(delta)
                last = delta
                yield delta
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except RequestFailedError as exc:
            raise APIError(400, str(exc)) from None
        finally:
            timing.finish(last)
            self.metrics.observe_request(timing)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="brisk", version=brisk.__version__)
    app.state.brisk = state
    app.add_middleware(GuardMiddleware, state=state)
    if state.allowed_origins:  # added last, so outermost: preflights and 401s carry the CORS headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=state.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
            allow_credentials=False,
        )
    install_observability(app, state)  # HTTP metrics and traces, outermost: they see every response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # The traceback goes to the server log; the client gets a fixed message, never the exception
        # text (it can hold paths or internals). (Starlette then re-raises, so uvicorn logs it too.)
        logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, INTERNAL_ERROR_MESSAGE, code="internal_error")

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
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        if state.client.dead or state.client.info is None:
            return error_response(503, "The engine is not running.", code="engine_dead")
        if state.draining:
            return error_response(503, "The server is shutting down.", code="shutting_down")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": brisk.__version__}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "brisk",
                    "root": state.config.model,
                    "max_model_len": state.client.info.max_seq_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        state.metrics.observe_engine(state.client.stats)
        state.metrics.observe_client(state.client.num_in_flight, state.client.num_coalesced_deltas)
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

    from brisk.server import chat, completions, profiling, responses

    app.include_router(profiling.router)  # POST /start_profile, /stop_profile

    chat.register(app, state)
    completions.register(app, state)
    responses.register(app, state)
    return app


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


async def stream_with_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once an SSE stream has started, an error can only be reported in-band, then the stream ends."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    except Exception:
        logger.exception("unhandled error in a stream")
        yield sse(error_body(500, INTERNAL_ERROR_MESSAGE, code="internal_error"))
    yield "data: [DONE]\n\n"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run a non-streaming request's work, cancelling it if the client hangs up first.

    A streaming response notices a disconnect by itself; a non-streaming one would otherwise generate
    to the end for nobody, holding its KV blocks. Cancelling the work closes its generators, which
    aborts the request in the engine.
    """
    work_task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(wait_for_disconnect())
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            try:
                await work_task
            except asyncio.CancelledError:
                pass
    if work_task.cancelled():
        raise APIError(499, "The client closed the request.", code="client_closed_request")
    return work_task.result()
