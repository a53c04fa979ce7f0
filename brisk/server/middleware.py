"""The ASGI guard in front of every route: draining (503), API key (401), body size (413), request log.

A pure ASGI middleware rather than FastAPI's `@app.middleware("http")`: it has to see the body as it
arrives to enforce the size limit on chunked uploads (no Content-Length), and it must not sit between
a streaming response and its client.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from brisk.server.auth import api_key_matches
from brisk.server.errors import error_body
from brisk.server.tracing import REQUEST_LOGGER

if TYPE_CHECKING:
    from brisk.server.state import ServerState

logger = logging.getLogger(REQUEST_LOGGER)

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

UNAUTHENTICATED_PATHS = frozenset({"/health", "/ping"})  # /ping: vLLM's SageMaker health check
# polled by probes and scrapers: logged at debug level
QUIET_PATHS = frozenset({"/health", "/ping", "/metrics", "/prometheus/metrics"})


def _request_id(scope: MutableMapping[str, Any]) -> bytes:
    """vLLM's --enable-request-id-headers: the request's X-Request-Id echoed, or a new one."""
    given = next((v for k, v in scope["headers"] if k.lower() == b"x-request-id"), None)
    return given[:128] if given else uuid.uuid4().hex.encode()


class RequestBodyTooLarge(Exception):
    pass


class GuardMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 0}
        request_id = _request_id(scope) if self.state.server.enable_request_id_headers else None

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                if request_id is not None:
                    message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        try:
            await self._guarded(scope, receive, send_and_note)
        except Exception:
            status["code"] = status["code"] or 500
            raise  # the app's error handler has answered (or could not); the traceback is logged there
        finally:
            level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
            logger.log(
                level, "%s %s %d %.3fs", scope["method"], scope["path"], status["code"], time.perf_counter() - start
            )

    async def _guarded(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        state, path = self.state, scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if state.draining and path not in UNAUTHENTICATED_PATHS:
            # The body is read first (up to the size limit): a socket closed with request bytes still unread is
            # reset by the kernel, which drops the 503 not yet sent with it, and the client sees a broken
            # connection instead of the answer.
            try:
                await _read_body(receive, state.max_request_body_size)
            except RequestBodyTooLarge:
                pass
            await _respond(send, 503, "The server is shutting down.", "shutting_down", {"connection": "close"})
            return
        if (
            state.api_key
            and path not in UNAUTHENTICATED_PATHS
            and not api_key_matches(headers.get("authorization", ""), state.api_key)
        ):
            await _respond(send, 401, "Invalid or missing API key.", "invalid_api_key")
            return
        limit = state.max_request_body_size
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            await _respond(send, 400, "Invalid Content-Length header.", "invalid_content_length")
            return
        if length is not None and int(length) > limit:  # refused before reading a byte of it
            await _respond(send, 413, f"Request body larger than {limit} bytes.", "request_too_large")
            return
        try:
            body = await _read_body(receive, limit)
        except RequestBodyTooLarge:
            await _respond(send, 413, f"Request body larger than {limit} bytes.", "request_too_large")
            return
        await self.app(scope, _replay(body, receive), send)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or raise once more than `limit` bytes arrived. None if the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestBodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes | None, receive: Receive) -> Receive:
    """A receive() that hands the app the buffered body, then passes through (disconnect detection)."""
    pending = [
        {"type": "http.disconnect"} if body is None else {"type": "http.request", "body": body, "more_body": False}
    ]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def _respond(
    send: Send, status: int, message: str, code: str, extra_headers: dict[str, str] | None = None
) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra_headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
