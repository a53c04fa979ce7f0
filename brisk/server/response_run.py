"""One Responses API response as it runs (`ResponseRun`: its events and its body at any moment), and the
background runs of a server (`BackgroundRuns`: started as tasks, polled, followed, cancelled)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from brisk.sampling_params import SamplingParams
from brisk.server.errors import APIError
from brisk.server.logprobs import logprob_entries
from brisk.server.output_parsers import make_choice_parser
from brisk.server.response_items import OutputItems
from brisk.server.response_store import RUNNING, StoredResponse, this_process
from brisk.server.schemas import (
    ErrorDetail,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponseUsage,
)
from brisk.server.streaming import StreamAccumulator

TERMINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.cancelled",
}
MAX_FINISHED_BACKGROUND_RUNS = 256  # kept in memory for stream replay after they end; the store keeps the body
PROGRESS_SAVE_S = 1.0  # a running response's stored body is brought up to date this often


class ResponseRun:
    def __init__(
        self,
        state,
        req,
        owner: str,
        prompt_ids: list[int],
        params: SamplingParams,
        forced: list[int],
        input_items: list[dict[str, Any]],
        history_items: list[dict[str, Any]],
        returns_calls: bool = True,
    ) -> None:
        """`returns_calls` False: tool_choice "none" with the tools shown; a call the model writes is dropped."""
        self.state, self.req, self.owner = state, req, owner
        self.prompt_ids, self.params = prompt_ids, params
        self.input_items, self.history_items = input_items, history_items
        # vLLM's request_id names the Response (responses.py claims it in the store first); else a fresh id
        self.id, self.created = req.request_id or f"resp_{uuid.uuid4().hex}", int(time.time())
        self.parser = make_choice_parser(state, forced, include_tool_calls=returns_calls)
        self.items = OutputItems(encrypted_reasoning=req.includes_encrypted_reasoning)
        self.status = "queued" if req.background else "in_progress"
        self.error: ErrorDetail | None = None
        self.incomplete_reason: str | None = None
        self.usage: ResponseUsage | None = None
        self.report_failures = True  # a failure ends the events with response.failed (else it is raised)
        self._seq = 0
        # Stored while it runs: a background response's id goes out before it starts, so it is in the store from
        # then on (queued, in progress, ended), and the id never reads as a 404, even after a crash.
        self.durable = bool(req.background and req.store and state.response_store is not None)
        self.runner = this_process()
        self._saved_at = 0.0

    def body(self) -> ResponseObject:
        req, params = self.req, self.params
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=self.status,
            model=self.state.model_name,
            output=self.items.items,  # type: ignore[arg-type]  # validated into the item models
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=params.temperature,
            top_p=params.top_p,
            max_output_tokens=req.max_output_tokens,
            instructions=req.instructions,
            metadata=req.metadata or {},
            error=self.error,
            incomplete_details=IncompleteDetails(reason=self.incomplete_reason) if self.incomplete_reason else None,
            usage=self.usage,
            text={"format": {"type": "text"}, "verbosity": req.text.verbosity if req.text else None},
            reasoning={"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            truncation=req.truncation or "disabled",
            store=req.store,
            max_tool_calls=req.max_tool_calls,
            previous_response_id=req.previous_response_id,
            background=bool(req.background),
            user=req.user,
        )

    def _event(self, body: dict[str, Any]) -> dict[str, Any]:
        self._seq += 1
        return {**body, "sequence_number": self._seq - 1}

    def _response_event(self, kind: str) -> dict[str, Any]:
        return self._event({"type": kind, "response": self.body().model_dump(mode="json")})

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The response's stream events, ending with its terminal event; stores the response first (a background
        one was stored when it was accepted, and is as it runs)."""
        yield self._response_event("response.created")
        self.status = "in_progress"
        if self.durable:
            await self.save()
        yield self._response_event("response.in_progress")
        try:
            async for event in self._generate():
                yield event
                if self.durable and time.monotonic() - self._saved_at > PROGRESS_SAVE_S:
                    await self.save()
        except APIError as exc:
            if not self.report_failures:
                raise
            self.status = "failed"
            self.error = ErrorDetail(message=exc.message, type="server_error", param=exc.param, code=exc.code)
        finally:
            if self.durable and self.status in RUNNING:  # cancelled (or the server stops): stored as it was left
                self.status = "cancelled"
                await self.save()
        await self.save()
        yield self._response_event(TERMINAL_EVENTS[self.status])

    async def _generate(self) -> AsyncIterator[dict[str, Any]]:
        accumulator = StreamAccumulator(self.state.config.stream_interval)
        parser, items = self.parser, self.items
        final = None
        generation = self.state.generate(
            self.prompt_ids,
            self.params,
            timeout=self.req.timeout,
            detokenize=not self.state.is_harmony,
            cache_salt=self.req.cache_salt,
        )
        async for delta in generation:
            final = delta.output
            pending = accumulator.add(0, delta)
            if pending is None:
                continue  # stream_interval
            fields = parser.feed(pending.token_ids, pending.text)
            items.add(fields, self._content_logprobs(pending.token_ids, pending.logprobs, parser.content_tokens))
            for e in items.take_events():
                yield self._event(e)
        items.add(parser.finish_stream())
        items.close()
        for e in items.take_events():
            yield self._event(e)
        if final is None:
            return
        out = final.outputs[0]
        self.status = "completed"
        if out.finish_reason == "length":
            self.status, self.incomplete_reason = "incomplete", "max_output_tokens"
        elif out.finish_reason == "abort":  # timeout or server shutdown
            self.status, self.incomplete_reason = "incomplete", "aborted"
        reasoning_text = "".join(i["content"][0]["text"] for i in items.items if i["type"] == "reasoning")
        # re-encoding the reasoning text counts its tokens without the channel headers
        reasoning_tokens = (
            len(self.state.tokenizer.encode(reasoning_text, add_special_tokens=False)) if reasoning_text else 0
        )
        self.usage = ResponseUsage(
            input_tokens=len(self.prompt_ids),
            output_tokens=len(out.token_ids),
            total_tokens=len(self.prompt_ids) + len(out.token_ids),
            input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        )

    def _content_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]] | None, is_content: list[bool]
    ) -> list[dict[str, Any]] | None:
        if not self.req.includes_logprobs:
            return None
        kept = [(t, lp) for t, lp, keep in zip(token_ids, logprobs or [], is_content) if keep]
        entries = logprob_entries(
            self.state.tokenizer,
            [t for t, _ in kept],
            [lp for _, lp in kept],
            self.params.logprobs or 0,
            self.state.tokens_as_token_ids(None),
        )
        return [e.model_dump(mode="json") for e in entries]

    async def save(self) -> None:
        store = self.state.response_store
        if self.req.store and store is not None:
            self._saved_at = time.monotonic()
            await store.put(self.owner, self._stored())

    async def claim(self) -> bool:
        """Take the id the request chose in the store, before the run starts: False if a stored Response has it.
        (A Response not stored claims nothing: its id names no row.)"""
        store = self.state.response_store
        if not (self.req.store and store is not None):
            return True
        self._saved_at = time.monotonic()
        return await store.claim(self.owner, self._stored())

    def _stored(self) -> StoredResponse:
        body = self.body().model_dump(mode="json")
        return StoredResponse(body, self.input_items, self.history_items, self.runner, self._seq - 1)


@dataclass
class _Background:
    run: ResponseRun
    task: asyncio.Task | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class BackgroundRuns:
    """`background: true` responses of this server process, as tasks; their events kept for replay."""

    def __init__(self) -> None:
        self._runs: OrderedDict[str, _Background] = OrderedDict()

    def start(self, run: ResponseRun) -> None:
        record = _Background(run)
        self._runs[run.id] = record
        record.task = asyncio.create_task(self._work(record))
        finished = [rid for rid, r in self._runs.items() if r.done]
        for rid in finished[: max(0, len(finished) - MAX_FINISHED_BACKGROUND_RUNS)]:
            del self._runs[rid]

    async def _work(self, record: _Background) -> None:
        try:
            async for event in record.run.events():
                record.events.append(event)
                record.notify()
        except asyncio.CancelledError:
            record.run.status = "cancelled"  # stored so by events() as it was left
            record.events.append(record.run._response_event("response.cancelled"))
        finally:
            record.done = True
            record.notify()

    def get(self, owner: str, response_id: str) -> ResponseRun | None:
        record = self._runs.get(response_id)
        return record.run if record is not None and record.run.owner == owner else None

    async def follow(self, response_id: str, starting_after: int) -> AsyncIterator[dict[str, Any]]:
        """The run's events after sequence number `starting_after`, live until it ends."""
        record = self._runs[response_id]
        sent = 0
        while True:
            changed = record.changed
            while sent < len(record.events):
                event = record.events[sent]
                sent += 1
                if event["sequence_number"] > starting_after:
                    yield event
            if record.done:
                return
            await changed.wait()

    def cancel(self, response_id: str) -> None:
        record = self._runs.get(response_id)
        if record is not None and record.task is not None and not record.done:
            record.task.cancel()

    async def wait(self, response_id: str) -> None:
        record = self._runs.get(response_id)
        if record is not None and record.task is not None:
            await asyncio.wait({record.task})

    def forget(self, response_id: str) -> None:
        self._runs.pop(response_id, None)
