"""What the three APIs share to answer: SSE framing, in-band stream errors, disconnect handling, and the
one `stream_interval` accumulator."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from brisk.engine.output_processor import CompletionDelta
from brisk.outputs import RequestOutput
from brisk.server.errors import APIError, error_body

logger = logging.getLogger("brisk.server")
T = TypeVar("T")
INTERNAL_ERROR_MESSAGE = "The server had an internal error while processing the request."


def sse(data: BaseModel | dict[str, Any], event: str | None = None) -> str:
    """One server-sent event; a model is written with the fields that were set (explicit nulls included)."""
    body = data.model_dump_json(exclude_unset=True) if isinstance(data, BaseModel) else json.dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"


@dataclass
class PendingDelta:
    """One completion's engine deltas not yet sent, merged."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output: RequestOutput | None = None


class StreamAccumulator:
    """`stream_interval` for every streaming API: a completion's deltas are held until it has gained
    `interval` tokens or finished, then released as one merged PendingDelta. Keyed by any hashable (the
    completions API keys by prompt and choice)."""

    def __init__(self, interval: int) -> None:
        self.interval = max(1, interval)
        self._pending: dict[Any, PendingDelta] = {}

    def add(self, key: Any, delta: CompletionDelta) -> PendingDelta | None:
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = PendingDelta(delta.index)
        p.text += delta.text
        p.token_ids += delta.token_ids
        if delta.logprobs:
            p.logprobs += delta.logprobs
        p.finish_reason, p.stop_reason, p.output = delta.finish_reason, delta.stop_reason, delta.output
        if len(p.token_ids) < self.interval and delta.finish_reason is None:
            return None
        return self._pending.pop(key)


async def stream_with_errors(chunks: AsyncIterator[str], done_marker: bool = True) -> AsyncIterator[str]:
    """Once an SSE stream has started, an error can only be reported in-band, then the stream ends."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    except Exception:
        logger.exception("unhandled error in a stream")
        yield sse(error_body(500, INTERNAL_ERROR_MESSAGE, code="internal_error"))
    if done_marker:
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
