"""POST /v1/chat/completions: render the chat, generate, parse (harmony for gpt-oss), stream or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from brisk.harmony.chat import continued_message_header
from brisk.server.completions import prompt_logprobs_body
from brisk.server.errors import APIError
from brisk.server.logprobs import logprob_entries
from brisk.server.output_parsers import make_choice_parser, merge_delta_fields
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
    Usage,
    event_stream_response,
)
from brisk.server.state import ServerState, server_state
from brisk.server.streaming import (
    TEXT_PLACEHOLDER,
    EventStreamResponse,
    StreamAccumulator,
    TextChunkTemplate,
    join_events,
    sse,
    until_disconnected,
)
from brisk.server.tool_choice import forced_call_prefix, plan_tools

router = APIRouter(responses=ERROR_RESPONSES)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    response_model_exclude_unset=True,
    responses=event_stream_response("ChatCompletionChunk"),
)
async def chat_completions(req: ChatCompletionRequest, raw: Request, state: ServerState = Depends(server_state)):
    state.check_model(req.model)
    if req.stream and req.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not available with stream: true.", param="prompt_logprobs")
    state.admit()
    params = state.sampling_params(req)
    await state.check_structured_outputs(params, req.field_names())
    plan = plan_tools(state, [t.model_dump(exclude_none=True) for t in req.tools or []], req.tool_choice)
    effort = state.reasoning_effort(req.reasoning_effort, "reasoning_effort")
    prompt_ids = await state.render_chat(
        req.messages,
        plan.tools,
        effort,
        req.chat_template_kwargs or {},
        req.add_generation_prompt,
        may_truncate=req.truncate_prompt_tokens is not None,
        continue_final_message=req.continue_final_message,
    )
    prompt_ids = req.truncated(prompt_ids, state.info.max_seq_len)
    state.check_prompt(prompt_ids, params, req.field_names())
    if req.continue_final_message and plan.forces_call:
        raise APIError(400, "continue_final_message cannot be combined with a forced tool call.", param="tool_choice")
    forced = await forced_call_prefix(state, plan, prompt_ids, params, req.timeout, req.cache_salt)
    prompt_ids += forced
    # What the parser reads first, as the model's own: a forced call's start, or the header of the message the
    # prompt leaves open (continue_final_message)
    parser_prefix = forced
    if req.continue_final_message and state.is_harmony:
        header = continued_message_header(req.messages[-1])
        parser_prefix = state.tokenizer.encode(header, add_special_tokens=False)
    echoed = req.echoed_text
    state.check_prompt(prompt_ids, params, req.field_names())
    # gpt-oss: stop strings apply to `content` only, so the harmony parsers apply them, not the engine (it would
    # match them in the reasoning too); a completion whose content hit one is cut there.
    stop = params.stop if state.is_harmony else []
    if stop:
        params.stop = []
    parsers = [
        make_choice_parser(
            state, parser_prefix, stop, params.include_stop_str_in_output, req.include_reasoning, plan.returns_calls
        )
        for _ in range(params.n)
    ]
    rid, created, model = state.completion_id("chatcmpl-", raw, req.request_id), int(time.time()), state.model_name
    # logprob_token_ids (vLLM's): every entry, in the engine's order (the sampled token's, then the chosen ids')
    top_n = None if req.logprob_token_ids is not None else req.top_logprobs or 0
    as_token_ids = state.tokens_as_token_ids(req.return_tokens_as_token_ids)
    # a harmony parser decodes the tokens itself: the engine client's text would go unread
    deltas = state.generate(
        prompt_ids, params, timeout=req.timeout, detokenize=not state.is_harmony, cache_salt=req.cache_salt
    )
    generated = [0] * params.n  # tokens per choice, for usage (also when a stop string ends the stream early)

    def logprobs_of(token_ids: list[int], logprobs: list[dict[int, float]], kept: list[bool]) -> list[TokenLogprob]:
        """Logprobs of the tokens marked in `kept`: the parser's `content_tokens` (not harmony's headers,
        reasoning or tool calls) or its `reasoning_tokens`."""
        pairs = [(t, lp) for t, lp, keep in zip(token_ids, logprobs, kept) if keep]
        return logprob_entries(state.tokenizer, [t for t, _ in pairs], [lp for _, lp in pairs], top_n, as_token_ids)

    def finish_reason(parser, reason: str | None) -> str | None:
        if parser.stopped:
            return "stop"
        return "tool_calls" if reason == "stop" and parser.has_tool_calls else reason

    def usage(num_cached: int) -> Usage:
        return state.usage(len(prompt_ids), sum(generated), num_cached)

    async def whole_response() -> ChatCompletion:
        reasons: list[str | None] = [None] * params.n
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(params.n)]
        reasoning_logprobs: list[list[TokenLogprob]] = [[] for _ in range(params.n)]
        token_ids: list[list[int]] = [[] for _ in range(params.n)]
        num_cached = 0
        output = None
        async for delta in deltas:
            output = delta.output
            parser = parsers[delta.index]
            if parser.stopped:
                continue  # the stop string ended this choice; the rest is not reported
            generated[delta.index] += len(delta.token_ids)
            num_cached = delta.output.num_cached_tokens
            parser.feed(delta.token_ids, delta.text)
            token_ids[delta.index] += delta.token_ids
            if req.logprobs:
                logprobs[delta.index] += logprobs_of(delta.token_ids, delta.logprobs or [], parser.content_tokens)
            if req.reasoning_logprobs:
                reasoning_logprobs[delta.index] += logprobs_of(
                    delta.token_ids, delta.logprobs or [], parser.reasoning_tokens
                )
            reasons[delta.index] = delta.finish_reason
            if all(p.stopped for p in parsers):
                break  # closing the generator aborts the request in the engine
        await deltas.aclose()
        choices = []
        for i, parser in enumerate(parsers):
            fields = parser.finish()
            if echoed:
                fields["content"] = echoed + (fields.get("content") or "")
            message = ChatMessage(**fields)
            choice = ChatChoice(
                index=i,
                message=message,
                logprobs=ChoiceLogprobs(content=logprobs[i]) if req.logprobs else None,
                finish_reason=finish_reason(parser, reasons[i]),
            )
            if req.reasoning_logprobs:
                choice.reasoning_logprobs = ChoiceLogprobs(content=reasoning_logprobs[i])
            if req.return_token_ids:
                choice.token_ids = token_ids[i]
            choices.append(choice)
        body = ChatCompletion(id=rid, created=created, model=model, choices=choices, usage=usage(num_cached))
        if state.system_fingerprint is not None:
            body.system_fingerprint = state.system_fingerprint
        if req.return_token_ids:
            body.prompt_token_ids = prompt_ids
        if req.prompt_logprobs is not None and output is not None:
            body.prompt_logprobs = prompt_logprobs_body(state, output, req.prompt_logprobs)
        return body

    if not req.stream:
        return await until_disconnected(raw, whole_response())

    options = req.stream_options
    include_usage = bool(options and options.include_usage) or state.server.enable_force_include_usage
    continuous_usage = bool(options and options.continuous_usage_stats)
    accumulator = StreamAccumulator(state.config.stream_interval)

    def chunk(choices: list[ChatChunkChoice], usage_: Usage | None = None, last: bool = False) -> str:
        return sse(chunk_body(choices, usage_, last))

    def chunk_body(
        choices: list[ChatChunkChoice], usage_: Usage | None = None, last: bool = False
    ) -> ChatCompletionChunk:
        """`last`: a chunk that may end the stream (a finish_reason's, or the usage chunk after them), which carries
        the system_fingerprint, as vLLM sends it."""
        body = ChatCompletionChunk(id=rid, created=created, model=model, choices=choices)
        if include_usage or continuous_usage:
            body.usage = usage_
        if last and state.system_fingerprint is not None:
            body.system_fingerprint = state.system_fingerprint
        return body

    # A chunk of one text field (content or reasoning_content) and nothing else varying: from a template.
    templated = not (req.logprobs or req.reasoning_logprobs or continuous_usage or req.return_token_ids)
    templates: dict[tuple[int, str], TextChunkTemplate] = {}

    def text_chunk(index: int, key: str, text: str) -> bytes:
        template = templates.get((index, key))
        if template is None:
            delta = ChatDelta.model_validate({key: TEXT_PLACEHOLDER})
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=None)
            template = templates[(index, key)] = TextChunkTemplate(chunk_body([choice]))
        return template.render(text)

    async def chunks() -> AsyncIterator[str | bytes]:
        num_cached = 0
        num_open = params.n  # choices without their finish_reason chunk yet
        closing: list[str | bytes] = []
        for i in range(params.n):
            opening = ChatDelta(role="assistant", content="")
            body = chunk_body(
                [ChatChunkChoice(index=i, delta=opening, logprobs=None, finish_reason=None)],
                usage(num_cached) if continuous_usage else None,
            )
            if req.return_token_ids and i == 0:  # vLLM's: in the stream's first chunk
                body.prompt_token_ids = prompt_ids
            yield sse(body)
        for i in range(params.n if echoed else 0):  # vLLM's: the echo in a chunk of its own after the roles
            echo = ChatChunkChoice(index=i, delta=ChatDelta(content=echoed), logprobs=None, finish_reason=None)
            yield chunk([echo], usage(0) if continuous_usage else None)
        try:
            async for delta in deltas:
                num_cached = delta.output.num_cached_tokens
                pending = accumulator.add(delta.index, delta)
                if pending is None:
                    continue  # stream_interval: send every `interval` tokens
                parser = parsers[pending.index]
                if parser.stopped:
                    continue
                generated[pending.index] += len(pending.token_ids)
                fields = parser.feed(pending.token_ids, pending.text)
                reason = pending.finish_reason
                if reason is not None or parser.stopped:
                    for key, value in parser.finish_stream().items():
                        merge_delta_fields(fields, key, value)
                    reason = finish_reason(parser, reason)
                entries = (
                    logprobs_of(pending.token_ids, pending.logprobs or [], parser.content_tokens)
                    if req.logprobs
                    else []
                )
                thoughts = (
                    logprobs_of(pending.token_ids, pending.logprobs or [], parser.reasoning_tokens)
                    if req.reasoning_logprobs
                    else []
                )
                # The finish_reason goes in a chunk of its own, after the last fields, as OpenAI sends it: the
                # openai SDK's stream helper closes a tool call (arguments.done, parsed_arguments) only on a
                # finish_reason that follows the call's last delta, never one in the same chunk. (Chunks that
                # are ready together go out in one write.)
                out: list[str | bytes] = []
                if templated and len(fields) == 1 and ("content" in fields or "reasoning_content" in fields):
                    [(key, text)] = fields.items()
                    out.append(text_chunk(pending.index, key, text))
                elif fields or entries or thoughts or req.return_token_ids:  # (token ids: harmony's headers too)
                    choice = ChatChunkChoice(
                        index=pending.index,
                        delta=ChatDelta(**fields),
                        logprobs=ChoiceLogprobs(content=entries) if req.logprobs else None,
                        finish_reason=None,
                    )
                    if req.reasoning_logprobs:
                        choice.reasoning_logprobs = ChoiceLogprobs(content=thoughts)
                    if req.return_token_ids:
                        choice.token_ids = pending.token_ids
                    out.append(chunk([choice], usage(num_cached) if continuous_usage else None))
                if reason is not None:
                    choice = ChatChunkChoice(
                        index=pending.index,
                        delta=ChatDelta(),
                        logprobs=ChoiceLogprobs(content=[]) if req.logprobs else None,
                        finish_reason=reason,
                    )
                    if req.reasoning_logprobs:
                        choice.reasoning_logprobs = ChoiceLogprobs(content=[])
                    if req.return_token_ids:
                        choice.token_ids = []
                    out.append(chunk([choice], usage(num_cached) if continuous_usage else None, not include_usage))
                    num_open -= 1
                if all(p.stopped for p in parsers):
                    closing = out  # sent with the usage chunk
                    break  # closing the generator aborts the request in the engine
                if num_open == 0:
                    closing = out  # the last deltas were these: sent with the usage chunk
                elif out:
                    yield join_events(out)
        finally:
            await deltas.aclose()  # aborts the request in the engine if it is still running
        if include_usage:
            closing.append(chunk([], usage(num_cached), last=True))
        if closing:
            yield join_events(closing)

    return EventStreamResponse(chunks(), keep_alive_s=state.server.sse_keep_alive_interval)
