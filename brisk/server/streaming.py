"""What the three APIs share to answer: SSE framing (and chunk templates: a token's chunk without a pydantic
model), in-band stream errors, disconnect handling, several generations read as one stream, and the one
`stream_interval` accumulator."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from brisk.engine.output_processor import CompletionDelta
from brisk.server.errors import APIError, error_body

logger = logging.getLogger("brisk.server")
T = TypeVar("T")
INTERNAL_ERROR_MESSAGE = "The server had an internal error while processing the request."


def sse(data: BaseModel | dict[str, Any], event: str | None = None) -> str:
    """One server-sent event; a model is written with the fields that were set (explicit nulls included)."""
    body = data.model_dump_json(exclude_unset=True) if isinstance(data, BaseModel) else json.dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"


TEXT_PLACEHOLDER = "<brisk:text>"  # stands for the varying string when a TextChunkTemplate is rendered


class TextChunkTemplate:
    """The SSE bytes of stream chunks that differ in one string only (a token's text), without building the
    pydantic model per chunk: the model is rendered once with TEXT_PLACEHOLDER as that string, and each chunk
    is the bytes around it with the string's JSON in between. The model stays the one definition of the shape."""

    def __init__(self, chunk: BaseModel, event: str | None = None) -> None:
        marker = json.dumps(TEXT_PLACEHOLDER).encode()
        before, found, after = sse(chunk, event).encode().partition(marker)
        if not found or marker in after:
            raise ValueError(f"the chunk must hold {TEXT_PLACEHOLDER!r} exactly once")
        self._before, self._after = before, after

    def render(self, text: str) -> bytes:
        return self._before + msgspec.json.encode(text) + self._after


def join_events(events: list[str | bytes]) -> bytes:
    """Several SSE events as one body to send (one write instead of one each)."""
    return b"".join(e if isinstance(e, bytes) else e.encode() for e in events)


class StreamAccumulator:
    """`stream_interval` for every streaming API: a completion's deltas are held until it has gained
    `interval` tokens or finished, then released as one merged delta. Keyed by any hashable (the
    completions API keys by prompt and choice)."""

    def __init__(self, interval: int) -> None:
        self.interval = max(1, interval)
        self._pending: dict[Any, CompletionDelta] = {}

    def add(self, key: Any, delta: CompletionDelta) -> CompletionDelta | None:
        held = self._pending.pop(key, None)
        if held is not None:
            delta = held.merged(delta)
        if len(delta.token_ids) < self.interval and delta.finish_reason is None:
            self._pending[key] = delta
            return None
        return delta


async def interleave(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several async iterators as they come, each with its iterator's position; an error of one
    ends it all. A single iterator is read directly: no task and queue between it and the consumer, so a
    token costs one wake-up of the consumer's task rather than two. Closing this closes the iterators."""
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for item in stream:
                yield 0, item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]  # async generators: aborts the request
        return
    # Bounded: with a slow reader the pumps wait, so the backlog stays in the engine client's buffers.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(position: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((position, item))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((position, exc))
            return
        await queue.put((position, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            position, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()


def error_event(exc: Exception) -> str:
    """The in-band SSE error event of an exception raised once a stream has started."""
    if isinstance(exc, APIError):
        return sse(error_body(exc.status, exc.message, exc.param, exc.code))
    logger.error("unhandled error in a stream", exc_info=exc)
    return sse(error_body(500, INTERNAL_ERROR_MESSAGE, code="internal_error"))


DONE_EVENT = "data: [DONE]\n\n"
KEEP_ALIVE_EVENT = b": keep-alive\n\n"  # an SSE comment: clients skip it
# Where `with_server_send` leaves the HTTP server's own `send` in a request's scope.
SERVER_SEND = "brisk.server_send"


def with_server_send(app: Any) -> Any:
    """The ASGI app `app` with the HTTP server's `send` in each HTTP scope, for EventStreamResponse.

    Every middleware between the server and a route (Starlette's error middleware, the guard, the exception
    middleware twice) wraps `send` to watch for the response's start; a stream's body chunks, one per token, need
    none of them, and each wrapper costs the token an await."""

    async def app_with_server_send(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await app(scope, receive, send)

    return app_with_server_send


class EventStreamResponse(StreamingResponse):
    """A text/event-stream of SSE chunks. An error once the stream started is reported in-band (the status is
    sent already) and ends it; `done_marker` ends it with [DONE]. A client that hangs up cancels the stream: its
    generators close, which aborts the requests in the engine.

    Starlette's StreamingResponse, under uvicorn, runs each response in an anyio task group with a second task
    listening for the disconnect: here the listener is a plain task, and the chunks go straight from the route's
    generator to `send` (no error-catching generator between them), which saves µs of every chunk and request.
    """

    def __init__(self, chunks: AsyncIterator[str | bytes], done_marker: bool = True, keep_alive_s: float = 0.0) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self.chunks = chunks if not keep_alive_s else with_keep_alive(chunks, keep_alive_s)
        self.done_marker = done_marker

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # The stream runs in a task of its own: each chunk then wakes the few frames between the engine's output and
        # the socket, not the whole stack of middlewares and routing awaiting the response (a frame each per token).
        # Cancelling this handler (shutdown) cancels the task it awaits.
        streaming = asyncio.create_task(self.stream_response(send, scope.get(SERVER_SEND, send)))
        hung_up = False

        async def watch() -> None:
            nonlocal hung_up
            while (await receive())["type"] != "http.disconnect":
                pass
            hung_up = True
            streaming.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await streaming
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if not hung_up or (
                this is not None and sys.version_info >= (3, 11) and this.cancelling()
            ):  # not (only) the client's hang-up
                raise
        finally:
            watcher.cancel()

    async def stream_response(self, send: Any, send_body: Any = None) -> None:
        """The start through `send` (the middlewares see it), the chunks through `send_body` (the server's own,
        see with_server_send), the end through `send` again."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        send_body = send_body or send
        chunks = self.chunks
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except Exception as exc:
                chunk = error_event(exc)
                await send_body({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                break
            body = chunk if isinstance(chunk, bytes) else chunk.encode()
            await send_body({"type": "http.response.body", "body": body, "more_body": True})
        # [DONE] and the end of the body in one write
        await send(
            {"type": "http.response.body", "body": DONE_EVENT.encode() if self.done_marker else b"", "more_body": False}
        )


async def with_keep_alive(chunks: AsyncIterator[str | bytes], interval_s: float) -> AsyncIterator[str | bytes]:
    """The chunks, and a keep-alive comment whenever `interval_s` seconds pass without one (--sse-keep-alive-interval).
    The next chunk is awaited in a task of its own, so a keep-alive never interrupts it."""
    pending = asyncio.ensure_future(chunks.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait((pending,), timeout=interval_s)
            if not done:
                yield KEEP_ALIVE_EVENT
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            yield chunk
            pending = asyncio.ensure_future(chunks.__anext__())
    finally:
        # a hang-up (or an error) while a chunk is awaited: that await ends first, then the route's generator closes
        # (which aborts its requests in the engine)
        pending.cancel()
        with contextlib.suppress(BaseException):
            await pending
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


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
