"""POST /v1/chat/completions: render the chat, generate, parse (harmony for gpt-oss), stream or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from brisk.server.output_parsers import make_choice_parser, merge_delta_fields, prepare_tools
from brisk.server.protocol import ChatCompletionRequest
from brisk.server.schemas import (
    ERROR_RESPONSES,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    ChoiceLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
    event_stream_response,
)
from brisk.server.state import ServerState, server_state
from brisk.server.streaming import StreamAccumulator, sse, stream_with_errors, until_disconnected

router = APIRouter(responses=ERROR_RESPONSES)


def logprob_entries(
    tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], top_n: int
) -> list[TokenLogprob]:
    def item(tok: int, lp: float) -> TopLogprob:
        text = tokenizer.decode([tok])
        return TopLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))

    entries = []
    for token_id, lps in zip(token_ids, logprobs):
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
        entries.append(TokenLogprob(**dict(item(token_id, lps[token_id])), top_logprobs=[item(t, lp) for t, lp in top]))
    return entries


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    response_model_exclude_unset=True,
    responses=event_stream_response("ChatCompletionChunk"),
)
async def chat_completions(req: ChatCompletionRequest, raw: Request, state: ServerState = Depends(server_state)):
    state.check_model(req.model)
    state.admit()
    params = state.sampling_params(req)
    tools, forced = prepare_tools(state, [t.model_dump(exclude_none=True) for t in req.tools or []], req.tool_choice)
    prompt_ids = (
        state.render_chat(
            req.messages, tools, req.reasoning_effort, req.chat_template_kwargs or {}, req.add_generation_prompt
        )
        + forced
    )
    state.check_prompt(prompt_ids, params, req.field_names())
    parsers = [make_choice_parser(state, forced) for _ in range(params.n)]
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name
    top_n = req.top_logprobs or 0
    deltas = state.generate(prompt_ids, params, timeout=req.timeout)

    async def whole_response() -> ChatCompletion:
        final = None
        async for delta in deltas:
            final = delta.output
        assert final is not None  # the engine client always ends a request with its final output
        choices = []
        for out, parser in zip(final.outputs, parsers):
            parser.feed(out.token_ids, out.text)
            message = ChatMessage(**parser.finish())
            logprobs = None
            if req.logprobs:
                logprobs = ChoiceLogprobs(
                    content=logprob_entries(state.tokenizer, out.token_ids, out.logprobs or [], top_n)
                )
            reason = "tool_calls" if message.tool_calls and out.finish_reason == "stop" else out.finish_reason
            choices.append(ChatChoice(index=out.index, message=message, logprobs=logprobs, finish_reason=reason))
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        return ChatCompletion(
            id=rid,
            created=created,
            model=model,
            choices=choices,
            usage=Usage.of(len(prompt_ids), completion_tokens, final.num_cached_tokens),
        )

    if not req.stream:
        return await until_disconnected(raw, whole_response())

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    accumulator = StreamAccumulator(state.config.stream_interval)

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        body = ChatCompletionChunk(id=rid, created=created, model=model, choices=choices)
        if include_usage:
            body.usage = usage
        return sse(body)

    async def chunks() -> AsyncIterator[str]:
        for i in range(params.n):
            opening = ChatDelta(role="assistant", content="")
            yield chunk([ChatChunkChoice(index=i, delta=opening, logprobs=None, finish_reason=None)])
        final = None
        async for delta in deltas:
            final = delta.output
            pending = accumulator.add(delta.index, delta)
            if pending is None:
                continue  # stream_interval: send every `interval` tokens
            parser = parsers[pending.index]
            fields = parser.feed(pending.token_ids, pending.text)
            reason = pending.finish_reason
            if reason is not None:
                for key, value in parser.finish_stream().items():
                    merge_delta_fields(fields, key, value)
                if parser.has_tool_calls and reason == "stop":
                    reason = "tool_calls"
            if not (fields or (req.logprobs and pending.logprobs) or reason is not None):
                continue
            logprobs = None
            if req.logprobs:
                logprobs = ChoiceLogprobs(
                    content=logprob_entries(state.tokenizer, pending.token_ids, pending.logprobs, top_n)
                )
            choice = ChatChunkChoice(
                index=pending.index, delta=ChatDelta(**fields), logprobs=logprobs, finish_reason=reason
            )
            yield chunk([choice])
        if include_usage and final is not None:
            completion_tokens = sum(len(o.token_ids) for o in final.outputs)
            yield chunk([], Usage.of(len(prompt_ids), completion_tokens, final.num_cached_tokens))

    return StreamingResponse(stream_with_errors(chunks()), media_type="text/event-stream")
