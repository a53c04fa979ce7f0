"""POST /v1/responses (gpt-oss's native API): input items -> chat messages -> the chat machinery -> output items.

Non-streaming returns the finished response; streaming emits the Responses API events (created,
output_item.added, *.delta, *.done, and completed, or incomplete for a response cut short). Both are built from the same per-choice parser fields,
so they agree.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from brisk.server.errors import APIError
from brisk.server.output_parsers import make_choice_parser
from brisk.server.protocol import NamedToolChoice, ResponsesRequest
from brisk.server.schemas import (
    ERROR_RESPONSES,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponseUsage,
    event_stream_response,
)
from brisk.server.state import ServerState, server_state
from brisk.server.streaming import StreamAccumulator, sse, stream_with_errors, until_disconnected
from brisk.server.tool_choice import forced_call_prefix, plan_tools

router = APIRouter(responses=ERROR_RESPONSES)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise APIError(400, "message content must be a string or a list of text parts", param="input")


def input_to_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    pending_reasoning = None
    for item in req.input:
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "assistant", "system"):
                raise APIError(400, f"unsupported message role {item.get('role')!r}", param="input")
            msg = {"role": role, "content": _text_of(item.get("content", ""))}
            if role == "assistant" and pending_reasoning:
                msg["reasoning_content"], pending_reasoning = pending_reasoning, None
            messages.append(msg)
        elif kind == "reasoning":
            pending_reasoning = _text_of(item.get("content") or item.get("summary") or [])
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if pending_reasoning:
                    msg["reasoning_content"], pending_reasoning = pending_reasoning, None
                messages.append(msg)
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": _text_of(item.get("output", ""))}
            )
        else:
            raise APIError(400, f"unsupported input item type {kind!r}", param="input")
    return messages


class _OutputItems:
    """Builds output items from parser fields, and the stream events that describe them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._call_index: int | None = None

    def _start(self, item: dict[str, Any]) -> None:
        self.close()
        self.items.append(item)
        self._open = item
        self.events.append(
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": dict(item, content=[]) if "content" in item else dict(item),
            }
        )
        if item["type"] == "message":
            self.events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": len(self.items) - 1,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                }
            )

    def add(self, fields: dict[str, Any]) -> None:
        idx = self._index
        if fields.get("reasoning_content"):
            if self._open is None or self._open["type"] != "reasoning":
                self._start(
                    {
                        "type": "reasoning",
                        "id": f"rs_{uuid.uuid4().hex}",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}],
                    }
                )
            self._open["content"][0]["text"] += fields["reasoning_content"]
            self.events.append(
                {
                    "type": "response.reasoning_text.delta",
                    "item_id": self._open["id"],
                    "output_index": idx(),
                    "content_index": 0,
                    "delta": fields["reasoning_content"],
                }
            )
        if fields.get("content"):
            if self._open is None or self._open["type"] != "message":
                self._start(
                    {
                        "type": "message",
                        "id": f"msg_{uuid.uuid4().hex}",
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "", "annotations": []}],
                    }
                )
            self._open["content"][0]["text"] += fields["content"]
            self.events.append(
                {
                    "type": "response.output_text.delta",
                    "item_id": self._open["id"],
                    "output_index": idx(),
                    "content_index": 0,
                    "delta": fields["content"],
                }
            )
        for call in fields.get("tool_calls", []):
            if (
                call.get("id")
                or self._open is None
                or self._open["type"] != "function_call"
                or self._call_index != call["index"]
            ):
                self._start(
                    {
                        "type": "function_call",
                        "id": f"fc_{uuid.uuid4().hex}",
                        "call_id": call.get("id"),
                        "name": call["function"].get("name", ""),
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
                self._call_index = call["index"]
            delta = call["function"].get("arguments", "")
            if delta:
                self._open["arguments"] += delta
                self.events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self._open["id"],
                        "output_index": idx(),
                        "delta": delta,
                    }
                )

    def _index(self) -> int:
        return len(self.items) - 1

    def close(self) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        i = len(self.items) - 1
        if item["type"] == "reasoning":
            self.events.append(
                {
                    "type": "response.reasoning_text.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "content_index": 0,
                    "text": item["content"][0]["text"],
                }
            )
        elif item["type"] == "message":
            part = item["content"][0]
            self.events.append(
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "content_index": 0,
                    "text": part["text"],
                }
            )
            self.events.append(
                {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "content_index": 0,
                    "part": part,
                }
            )
        else:
            self.events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "arguments": item["arguments"],
                }
            )
        item["status"] = "completed"
        if item["type"] == "reasoning":
            item.pop("status")
        self.events.append({"type": "response.output_item.done", "output_index": i, "item": item})

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


def _chat_tool_choice(choice: str | dict[str, Any] | None):
    """The Responses API names a function as {type, name}; chat completions as {type, function: {name}}."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise APIError(
                400, "tool_choice must be none, auto, required or {type: function, name}", param="tool_choice"
            )
        return NamedToolChoice(function={"name": choice["name"]})
    return choice


FORCED_CALL_ROOM = 32  # tokens truncation leaves for a forced call's header


def _truncated(state: ServerState, messages, prompt_ids, tools, effort, reserve: int, max_tokens) -> list[int]:
    """truncation "auto": drop the oldest input items (keeping instructions and the last item) until the prompt,
    `reserve` tokens and max_output_tokens fit the context."""
    room = state.info.max_seq_len - (max_tokens or 1) - reserve
    messages = list(messages)
    while len(prompt_ids) > room:
        first = next((i for i, m in enumerate(messages[:-1]) if m["role"] != "system"), None)
        if first is None:
            break  # nothing left to drop: the length check reports it
        del messages[first]
        while first < len(messages) - 1 and messages[first]["role"] == "tool":  # results of a dropped call go too
            del messages[first]
        prompt_ids = state.render_chat(messages, tools, effort, {}, param="input")
    return prompt_ids


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    response_model_exclude_unset=True,
    responses=event_stream_response("ResponseStreamEvent"),
)
async def responses(req: ResponsesRequest, raw: Request, state: ServerState = Depends(server_state)):
    state.check_model(req.model)
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id: stored responses are not available.", param="previous_response_id")
    if req.background:
        raise APIError(400, "background responses are not available.", param="background")
    state.admit()
    params = state.sampling_params(req)
    offered = [] if req.max_tool_calls == 0 else req.tools or []  # no call allowed: no tool offered
    plan = plan_tools(
        state,
        [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in offered],
        _chat_tool_choice(req.tool_choice) if offered else None,
    )
    effort = req.reasoning.effort if req.reasoning else None
    messages = input_to_messages(req)
    prompt_ids = state.render_chat(messages, plan.tools, effort, {}, param="input")
    if req.truncation == "auto":
        reserve = FORCED_CALL_ROOM if plan.forces_call else 0
        prompt_ids = _truncated(state, messages, prompt_ids, plan.tools, effort, reserve, params.max_tokens)
    state.check_prompt(prompt_ids, params, req.field_names())
    forced = await forced_call_prefix(state, plan, prompt_ids, params, req.timeout)
    prompt_ids += forced
    state.check_prompt(prompt_ids, params, req.field_names())
    parser = make_choice_parser(state, forced)
    items = _OutputItems()
    rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())

    def response_body(final=None) -> ResponseObject:
        body = ResponseObject(
            id=rid,
            created_at=created,
            status="in_progress" if final is None else "completed",
            model=state.model_name,
            output=items.items,  # type: ignore[arg-type]  # validated into the item models
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=params.temperature,
            top_p=params.top_p,
            max_output_tokens=req.max_output_tokens,
            instructions=req.instructions,
            metadata=req.metadata or {},
            error=None,
            incomplete_details=None,
            usage=None,
            text={"format": {"type": "text"}, "verbosity": req.text.verbosity if req.text else None},
            reasoning={"effort": effort, "summary": None},
            truncation=req.truncation or "disabled",
            store=req.store,
            max_tool_calls=req.max_tool_calls,
            user=req.user,
        )
        if final is not None:
            out = final.outputs[0]
            if out.finish_reason == "length":
                body.status = "incomplete"
                body.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            elif out.finish_reason == "abort":  # timeout or server shutdown
                body.status = "incomplete"
                body.incomplete_details = IncompleteDetails(reason="aborted")
            reasoning_text = "".join(i["content"][0]["text"] for i in items.items if i["type"] == "reasoning")
            # re-encoding the reasoning text counts its tokens without the channel headers
            reasoning_tokens = (
                len(state.tokenizer.encode(reasoning_text, add_special_tokens=False)) if reasoning_text else 0
            )
            body.usage = ResponseUsage(
                input_tokens=len(prompt_ids),
                output_tokens=len(out.token_ids),
                total_tokens=len(prompt_ids) + len(out.token_ids),
                input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            )
        return body

    deltas = state.generate(prompt_ids, params, timeout=req.timeout)

    async def whole_response() -> ResponseObject:
        final = None
        async for delta in deltas:
            items.add(parser.feed(delta.token_ids, delta.text))
            final = delta.output
        items.add(parser.finish_stream())
        items.close()
        return response_body(final)

    if not req.stream:
        return await until_disconnected(raw, whole_response())

    accumulator = StreamAccumulator(state.config.stream_interval)

    async def events() -> AsyncIterator[str]:
        seq = 0

        def event(body: dict[str, Any]) -> str:
            nonlocal seq
            seq += 1
            return sse({**body, "sequence_number": seq - 1}, event=body["type"])

        started = response_body().model_dump(mode="json")
        yield event({"type": "response.created", "response": started})
        yield event({"type": "response.in_progress", "response": started})
        final = None
        async for delta in deltas:
            final = delta.output
            pending = accumulator.add(0, delta)
            if pending is None:
                continue  # stream_interval
            items.add(parser.feed(pending.token_ids, pending.text))
            for e in items.take_events():
                yield event(e)
        items.add(parser.finish_stream())
        items.close()
        for e in items.take_events():
            yield event(e)
        done = response_body(final)
        # OpenAI ends a cut-off response with response.incomplete, a finished one with response.completed
        kind = "response.incomplete" if done.status == "incomplete" else "response.completed"
        yield event({"type": kind, "response": done.model_dump(mode="json")})

    return StreamingResponse(stream_with_errors(events()), media_type="text/event-stream")
