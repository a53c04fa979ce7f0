"""The FastAPI app: the routers (registered here, in one place), OpenAI-style errors, and the OpenAPI document.

Each API is a router in its own module (`chat.py`, `completions.py`, `responses.py`, `admin.py`); they share
`state.ServerState` (engine client, request checks), `streaming.py` (SSE, the stream_interval accumulator)
and `brisk.harmony.chat.render_chat`. Auth, draining, body limits and the request log are in
`middleware.py`; CORS is off unless origins are configured.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

import brisk
from brisk.server import admin, chat, completions, peer_routes, profiling, responses
from brisk.server.errors import APIError, error_response
from brisk.server.middleware import GuardMiddleware
from brisk.server.schemas import STREAM_MODELS
from brisk.server.state import ServerState
from brisk.server.streaming import INTERNAL_ERROR_MESSAGE
from brisk.server.tracing import install_observability

logger = logging.getLogger("brisk.server")

# profiling: POST /start_profile, /stop_profile; peer_routes: the other routes of vllm serve and trtllm-serve,
# served or answered with a reason (both admin; left out of the OpenAPI schema)
ROUTERS: tuple[APIRouter, ...] = (
    admin.router,
    chat.router,
    completions.router,
    responses.router,
    profiling.router,
    peer_routes.router,
)


@contextlib.asynccontextmanager
async def _static_heap(_: FastAPI) -> AsyncIterator[None]:
    """While the app serves, what was allocated before (modules, the tokenizer, the app) is left out of the garbage
    collector's full collections: a full collection walks the whole heap, and a server's heap of millions of
    long-lived objects made those pauses a large part of the per-token cost (gc.freeze, as vLLM does)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # an app in a longer-lived process (tests) gives its objects back to the collector


def build_app(state: ServerState, extra_routers: tuple[APIRouter, ...] = ()) -> FastAPI:
    server = state.server
    off = server.disable_fastapi_docs  # no OpenAPI document, /docs or /redoc
    app = FastAPI(
        title="brisk",
        version=brisk.__version__,
        lifespan=_static_heap,
        openapi_url=None if off else "/openapi.json",
        docs_url=None if off else "/docs",
        redoc_url=None if off else "/redoc",
    )
    app.state.brisk = state
    app.add_middleware(GuardMiddleware, state=state)
    if state.allowed_origins:  # added last, so outermost: preflights and 401s carry the CORS headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=state.allowed_origins,
            allow_methods=server.allowed_methods,
            allow_headers=server.allowed_headers,
            allow_credentials=server.allow_credentials,
        )
    install_observability(app, state)  # HTTP metrics and traces, outermost: they see every response
    _add_error_handlers(app)
    for router in ROUTERS + extra_routers:
        app.include_router(router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _add_error_handlers(app: FastAPI) -> None:
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
        if first.get("type") == "json_invalid":  # FastAPI reports it at the body's position 0, not a field
            reason = (first.get("ctx") or {}).get("error", "")
            return error_response(400, f"The request body is not valid JSON ({reason}).".replace(" ()", ""), "body")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in errors[:5]
        )
        return error_response(400, message, ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not read the body
            return error_response(400, _body_error(exc.__cause__), "body")
        message = "Not found." if exc.status_code == 404 else str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


def _body_error(cause: BaseException) -> str:
    """Why a request body could not be parsed, for the client."""
    if isinstance(cause, UnicodeDecodeError):
        return "The request body is not valid UTF-8."
    if isinstance(cause, RecursionError):
        return "The request body nests too deeply to be parsed."
    if isinstance(cause, ValueError):
        return f"The request body is not valid JSON ({cause})."
    return "The request body could not be parsed."


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, plus the streamed event schemas (routes point their text/event-stream content at
    them; FastAPI only collects the schemas of response_model)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema(
            [(m, "serialization") for m in STREAM_MODELS], ref_template="#/components/schemas/{model}"
        )
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(defs.get("$defs", {}))
        # Invalid bodies are answered 400 with the OpenAI error shape (see validation_error), never 422.
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema
