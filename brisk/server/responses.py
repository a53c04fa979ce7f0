"""The Responses API (gpt-oss's native API): input items -> chat messages -> the chat machinery -> output items.

POST /v1/responses runs one response (`ResponseRun`): its events (created, output_item.added, *.delta, *.done, and
a terminal completed / incomplete / failed / cancelled) are streamed, or drained into the finished response. Both
come from the same per-choice parser fields, so they agree. Stored responses (`store`, default true) are kept in
the `ResponseStore`; `previous_response_id` continues one. `background: true` runs the response as a task
(`BackgroundRuns`): GET polls it, GET with `stream=true` (and `starting_after`) replays and follows its events,
POST .../cancel stops it. With several API-server processes a background response runs in the one that accepted it;
a request about it reaching another is forwarded there while it runs (brisk/server/peers.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from brisk.server.errors import APIError
from brisk.server.peers import FORWARDED_HEADER, forward
from brisk.server.protocol import NamedToolChoice, NamedToolChoiceFunction, ResponsesRequest
from brisk.server.response_items import input_items, items_to_messages
from brisk.server.response_run import TERMINAL_EVENTS, ResponseRun
from brisk.server.response_store import StoredResponse, owner_of
from brisk.server.schemas import (
    ERROR_RESPONSES,
    InputItemList,
    ResponseDeleted,
    ResponseObject,
    event_stream_response,
)
from brisk.server.state import ServerState, server_state
from brisk.server.streaming import EventStreamResponse, sse, until_disconnected
from brisk.server.tool_choice import forced_call_prefix, plan_tools

router = APIRouter(responses=ERROR_RESPONSES)
STORED_POLL_S = 0.5  # how often a stream of a response running in another process looks at its stored row


def _chat_tool_choice(choice: str | dict[str, Any] | None):
    """The Responses API names a function as {type, name}; chat completions as {type, function: {name}}."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise APIError(
                400, "tool_choice must be none, auto, required or {type: function, name}", param="tool_choice"
            )
        return NamedToolChoice(function=NamedToolChoiceFunction(name=choice["name"]))
    return choice


FORCED_CALL_ROOM = 32  # tokens truncation leaves for a forced call's header


async def _truncated(
    state: ServerState, messages, prompt_ids, tools, effort, template_kwargs, reserve: int, max_tokens
) -> list[int]:
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
        prompt_ids = await state.render_chat(messages, tools, effort, template_kwargs, param="input", may_truncate=True)
    return prompt_ids


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    response_model_exclude_unset=True,
    responses=event_stream_response("ResponseStreamEvent"),
)
async def responses(req: ResponsesRequest, raw: Request, state: ServerState = Depends(server_state)):
    state.check_model(req.model)
    store = state.response_store
    owner = _owner(state, raw)
    if (req.previous_response_id or req.background) and store is None:
        param = "background" if req.background else "previous_response_id"
        raise APIError(400, "This server keeps no responses (started without a response store).", param=param)
    if req.background and not req.store:
        raise APIError(400, "A background response must be stored (store: true).", param="store")
    if req.max_tool_calls == 0 and req.tools and req.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "max_tool_calls 0 allows no call, and tool_choice forces one.", param="max_tool_calls")
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = await store.get(owner, req.previous_response_id) if store is not None else None
        if previous is None:
            raise APIError(
                404,
                f"No stored response '{req.previous_response_id}'.",
                param="previous_response_id",
                code="response_not_found",
            )
        history = previous.conversation()
    state.admit()
    params = state.sampling_params(req)
    await state.check_structured_outputs(params, req.field_names())
    offered = [] if req.max_tool_calls == 0 else req.tools or []  # no call allowed: no tool offered
    plan = plan_tools(
        state,
        [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in offered],
        _chat_tool_choice(req.tool_choice) if offered else None,
    )
    effort = state.reasoning_effort(req.reasoning.effort if req.reasoning else None, "reasoning.effort")
    items = input_items(req.input)
    messages = items_to_messages(req.instructions, history + items)
    template_kwargs = req.chat_template_kwargs or {}
    prompt_ids = await state.render_chat(
        messages, plan.tools, effort, template_kwargs, param="input", may_truncate=req.truncation == "auto"
    )
    if req.truncation == "auto":
        reserve = FORCED_CALL_ROOM if plan.forces_call else 0
        prompt_ids = await _truncated(
            state, messages, prompt_ids, plan.tools, effort, template_kwargs, reserve, params.max_tokens
        )
    state.check_prompt(prompt_ids, params, req.field_names())
    forced = await forced_call_prefix(state, plan, prompt_ids, params, req.timeout, req.cache_salt)
    prompt_ids += forced
    state.check_prompt(prompt_ids, params, req.field_names())
    run = ResponseRun(state, req, owner, prompt_ids, params, forced, items, history, plan.returns_calls)
    if req.request_id is not None and not await run.claim():
        raise APIError(400, f"request_id '{req.request_id}' names a stored Response already.", param="request_id")

    if req.background:
        await run.save()  # `queued`, before its id goes out
        state.background_runs.start(run)
        if not req.stream:
            return run.body()
        return EventStreamResponse(
            _sse(state.background_runs.follow(run.id, -1)), keep_alive_s=state.server.sse_keep_alive_interval
        )
    if not req.stream:
        run.report_failures = False  # a failure is the HTTP error itself

        async def drain() -> ResponseObject:
            async for _ in run.events():
                pass
            return run.body()

        return await until_disconnected(raw, drain())
    return EventStreamResponse(_sse(run.events()), keep_alive_s=state.server.sse_keep_alive_interval)


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async for event in events:
        yield sse(event, event=event["type"])


def _owner(state: ServerState, raw: Request) -> str:
    """Whose responses a request sees: its API key's when the server has one; without, every client's alike (their
    Authorization headers hold whatever placeholder each client library wants, and mean nothing here)."""
    return owner_of(raw.headers.get("authorization") if state.api_key else None)


async def _visible(state: ServerState, raw: Request, response_id: str) -> tuple[str, Any]:
    """The owner, and the background run or stored response of that id; 404 if the caller may not see it."""
    owner = _owner(state, raw)
    run = state.background_runs.get(owner, response_id)
    if run is not None:
        return owner, run
    stored = await state.response_store.get(owner, response_id) if state.response_store is not None else None
    if stored is None:
        raise APIError(404, f"No response '{response_id}'.", param="response_id", code="response_not_found")
    return owner, stored


def _runner_socket(state: ServerState, raw: Request, found: Any) -> str | None:
    """The socket of the sibling process running `found` (a background response this process does not run), to
    forward `raw` there; None to answer here."""
    if (
        state.peers is None
        or not isinstance(found, StoredResponse)
        or not found.running
        or not found.runner
        or FORWARDED_HEADER in raw.headers
    ):
        return None
    return state.peers.socket_of(found.runner)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, response_model_exclude_unset=True)
async def get_response(
    response_id: str,
    raw: Request,
    stream: bool = False,
    starting_after: int = -1,
    state: ServerState = Depends(server_state),
):
    """A stored response; a background one while it runs. `stream=true` replays its events after
    `starting_after` (a sequence number), then follows them until it ends."""
    owner, found = await _visible(state, raw, response_id)
    runner = _runner_socket(state, raw, found)
    if runner is not None:
        return await forward(raw, runner, state.server.scheme)
    if stream:
        if isinstance(found, ResponseRun):
            return EventStreamResponse(
                _sse(state.background_runs.follow(response_id, starting_after)),
                keep_alive_s=state.server.sse_keep_alive_interval,
            )
        if not found.body.get("background"):
            raise APIError(400, "Only a background response's events can be streamed.", param="stream")
        return EventStreamResponse(
            _sse(_stored_events(state, owner, found, starting_after)), keep_alive_s=state.server.sse_keep_alive_interval
        )
    return found.body() if isinstance(found, ResponseRun) else found.body


async def _stored_events(
    state: ServerState, owner: str, stored: StoredResponse, starting_after: int
) -> AsyncIterator[dict[str, Any]]:
    """The stream of a background response this process does not run (it ran before a restart, or runs in another
    process of the server): its events were not kept, so the stream is its terminal event, once it has one."""
    while stored.running:  # another process runs it: its row is rewritten as it goes, and when it ends
        await asyncio.sleep(STORED_POLL_S)
        latest = await state.response_store.get(owner, stored.body["id"]) if state.response_store else None
        if latest is None:
            raise APIError(404, f"No response '{stored.body['id']}'.", param="response_id", code="response_not_found")
        stored = latest
    sequence_number = stored.last_event + 1
    if sequence_number > starting_after:
        status = stored.body["status"]
        yield {
            "type": TERMINAL_EVENTS.get(status, "response.failed"),
            "response": stored.body,
            "sequence_number": sequence_number,
        }


@router.get("/v1/responses/{response_id}/input_items", response_model=InputItemList)
async def get_input_items(
    response_id: str,
    raw: Request,
    order: Literal["asc", "desc"] = "desc",
    limit: int = Query(20, ge=1, le=100),
    after: str | None = None,
    state: ServerState = Depends(server_state),
) -> InputItemList:
    """The input items of a response, the conversation before it included (what the model was given)."""
    _, found = await _visible(state, raw, response_id)
    items = found.history_items + found.input_items
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return InputItemList(
        data=page,
        first_id=page[0].get("id") if page else None,
        last_id=page[-1].get("id") if page else None,
        has_more=len(items) > limit,
    )


@router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted)
async def delete_response(response_id: str, raw: Request, state: ServerState = Depends(server_state)):
    owner, found = await _visible(state, raw, response_id)
    runner = _runner_socket(state, raw, found)
    if runner is not None:
        return await forward(raw, runner, state.server.scheme)
    if isinstance(found, ResponseRun):
        state.background_runs.cancel(response_id)
        await state.background_runs.wait(response_id)
    if state.response_store is not None:
        await state.response_store.delete(owner, response_id)
    state.background_runs.forget(response_id)
    return ResponseDeleted(id=response_id)


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, response_model_exclude_unset=True)
async def cancel_response(response_id: str, raw: Request, state: ServerState = Depends(server_state)):
    """Stop a background response (its status becomes `cancelled`); a finished one is returned as it is."""
    _, found = await _visible(state, raw, response_id)
    runner = _runner_socket(state, raw, found)
    if runner is not None:
        return await forward(raw, runner, state.server.scheme)
    if not isinstance(found, ResponseRun):
        if not found.body.get("background"):
            raise APIError(400, "Only a background response can be cancelled.", param="response_id")
        if found.running:
            raise APIError(
                409, "This response runs in another process of the server; cancel it there.", param="response_id"
            )
        return found.body  # it ended (or was interrupted by a restart): as it is
    state.background_runs.cancel(response_id)
    await state.background_runs.wait(response_id)
    return found.body()
