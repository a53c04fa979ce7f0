"""POST /v1/completions: a string, a list of strings, a token-id list, or a list of token-id lists."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TypeVar

from fastapi import APIRouter, Depends, Request

from brisk.engine.output_processor import CompletionDelta
from brisk.outputs import Logprob, RequestOutput
from brisk.server.errors import APIError
from brisk.server.logprobs import token_text
from brisk.server.protocol import CompletionRequest
from brisk.server.schemas import (
    ERROR_RESPONSES,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    Usage,
    event_stream_response,
)
from brisk.server.state import ServerState, server_state
from brisk.server.streaming import (
    TEXT_PLACEHOLDER,
    EventStreamResponse,
    StreamAccumulator,
    TextChunkTemplate,
    interleave,
    sse,
    until_disconnected,
)

router = APIRouter(responses=ERROR_RESPONSES)
AnyCompletion = TypeVar("AnyCompletion", bound=Completion)  # a whole completion or a chunk


async def _prompts(
    state: ServerState, prompt, add_special_tokens: bool, may_truncate: bool = False
) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        return [(prompt, await state.encode(prompt, "prompt", add_special_tokens, may_truncate))]
    if not prompt:
        raise APIError(400, "The prompt is empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        for p in prompt:  # every prompt's size checked before any is tokenized
            if not may_truncate:
                state.check_text_fits(len(p), "prompt")
        return [(p, await state.encode(p, "prompt", add_special_tokens, may_truncate)) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [(None, list(p)) for p in prompt]
    raise APIError(400, "prompt must be a string, a list of strings, or token ids.", param="prompt")


def _logprobs(
    state: ServerState,
    token_ids: list[int],
    logprobs: list[dict[int, float]],
    offset: int,
    prompt: RequestOutput | None = None,
    top_n: int = 0,
    as_token_ids: bool = False,
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs of `token_ids`; with `prompt` (echo), the prompt tokens' lead them (the first
    one's is null: nothing predicts it), each with the prompt token and its top `top_n` alternatives. Tokens are
    named by their text, or `token_id:N` (`as_token_ids`); the offsets are into the text either way."""
    decode = state.tokenizer.decode

    def name(token_id: int) -> str:
        return token_text(state.tokenizer, token_id, as_token_ids)

    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    ids: list[int] = []
    if prompt is not None and prompt.prompt_logprobs is not None:
        ids = list(prompt.prompt_token_ids)
        for token, entry in zip(ids, prompt.prompt_logprobs):
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(entry[token].logprob)
            top_logprobs.append({name(t): lp.logprob for t, lp in entry.items() if lp.rank <= top_n or t == token})
    ids += token_ids
    token_logprobs += [lp[t] for t, lp in zip(token_ids, logprobs)]
    top_logprobs += [{name(k): v for k, v in lp.items()} for lp in logprobs]
    texts = [decode([t]) for t in ids]
    tokens = [name(t) for t in ids] if as_token_ids else texts
    offsets, pos = [], offset
    for text in texts:
        offsets.append(pos)
        pos += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets
    )


def prompt_logprobs_body(state: ServerState, output: RequestOutput, top_n: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, then {token id: logprob, rank, decoded
    token} for the prompt token and its top `top_n` alternatives."""
    decode = state.tokenizer.decode

    def entry(token: int, lps: dict[int, Logprob]) -> dict[str, PromptLogprob]:
        return {
            str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=decode([t]))
            for t, lp in lps.items()
            if lp.rank <= top_n or t == token
        }

    return [
        None if lps is None else entry(token, lps)
        for token, lps in zip(output.prompt_token_ids, output.prompt_logprobs or [])
    ]


@router.post(
    "/v1/completions",
    response_model=Completion,
    response_model_exclude_unset=True,
    responses=event_stream_response("CompletionChunk"),
)
async def completions(req: CompletionRequest, raw: Request, state: ServerState = Depends(server_state)):
    state.check_model(req.model)
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise APIError(
            400, "max_tokens 0 generates nothing; it needs echo: true (or prompt_logprobs).", param="max_tokens"
        )
    if req.stream and req.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not available with stream: true.", param="prompt_logprobs")
    single = isinstance(req.prompt, str) or all(isinstance(p, int) for p in req.prompt)
    state.admit(1 if single else len(req.prompt))  # each prompt is one engine request
    params = state.sampling_params(req)
    await state.check_structured_outputs(params, req.field_names())
    prompts = await _prompts(state, req.prompt, req.add_special_tokens, req.truncate_prompt_tokens is not None)
    # truncate_prompt_tokens: a cut prompt's text is its ids' (what echo shows)
    truncated = [req.truncated(ids, state.info.max_seq_len) for _, ids in prompts]
    prompts = [(text if len(cut) == len(ids) else None, cut) for (text, ids), cut in zip(prompts, truncated)]
    for _, ids in prompts:
        state.check_prompt(ids, params, req.field_names())
    rid, created, model = state.completion_id("cmpl-", raw, req.request_id), int(time.time()), state.model_name
    n = params.n

    def fingerprinted(body: AnyCompletion) -> AnyCompletion:
        """A whole completion, or a chunk that may end the stream, carries the system_fingerprint (as vLLM's)."""
        if state.system_fingerprint is not None:
            body.system_fingerprint = state.system_fingerprint
        return body

    # echo: each choice's text starts with its prompt
    echoed = [(text if text is not None else state.tokenizer.decode(ids)) if req.echo else "" for text, ids in prompts]

    if req.max_tokens == 0 and params.prompt_logprobs is None:  # echo of the prompts alone: nothing to compute
        choices = [
            CompletionChoice(index=p * n + i, text=echoed[p], logprobs=None, finish_reason="length", stop_reason=None)
            for p in range(len(prompts))
            for i in range(n)
        ]
        if req.return_token_ids:
            for choice in choices:
                choice.prompt_token_ids, choice.token_ids = prompts[choice.index // n][1], []
        usage = state.usage(sum(len(ids) for _, ids in prompts), 0)
        if not req.stream:
            return fingerprinted(Completion(id=rid, created=created, model=model, choices=choices, usage=usage))

        async def echo_chunks() -> AsyncIterator[str]:
            for choice in choices:  # each ends its choice (finish_reason "length")
                yield sse(fingerprinted(CompletionChunk(id=rid, created=created, model=model, choices=[choice])))

        return EventStreamResponse(echo_chunks(), keep_alive_s=state.server.sse_keep_alive_interval)

    as_token_ids = state.tokens_as_token_ids(req.return_tokens_as_token_ids)

    def choice_logprobs(output: RequestOutput, token_ids: list[int], logprobs, offset: int = 0) -> CompletionLogprobs:
        if req.echoes_logprobs:  # the prompt's tokens lead, from the choice's first chunk
            return _logprobs(state, token_ids, logprobs or [], offset, output, req.logprobs or 0, as_token_ids)
        return _logprobs(state, token_ids, logprobs or [], offset, as_token_ids=as_token_ids)

    if not req.stream:

        async def run(text, ids):
            final = None
            async for delta in state.generate(ids, params, text, req.timeout, cache_salt=req.cache_salt):
                final = delta.output
            return final

        outputs = await until_disconnected(raw, asyncio.gather(*(run(text, ids) for text, ids in prompts)))
        choices = []
        for p, final in enumerate(outputs):
            for out in final.outputs:
                choice = CompletionChoice(
                    index=p * n + out.index,
                    text=echoed[p] + out.text,
                    finish_reason=out.finish_reason,
                    logprobs=choice_logprobs(final, out.token_ids, out.logprobs) if req.logprobs is not None else None,
                    stop_reason=out.stop_reason,
                )
                if req.prompt_logprobs is not None:
                    choice.prompt_logprobs = prompt_logprobs_body(state, final, req.prompt_logprobs)
                if req.return_token_ids:
                    choice.prompt_token_ids, choice.token_ids = prompts[p][1], list(out.token_ids)
                choices.append(choice)
        completion_tokens = sum(len(o.token_ids) for f in outputs for o in f.outputs)
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        cached = sum(f.num_cached_tokens for f in outputs)
        usage = state.usage(prompt_tokens, completion_tokens, cached)
        return fingerprinted(Completion(id=rid, created=created, model=model, choices=choices, usage=usage))

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    include_usage = include_usage or state.server.enable_force_include_usage
    continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    accumulator = StreamAccumulator(state.config.stream_interval)

    def chunk_body(choices: list[CompletionChoice], usage: Usage | None = None, last: bool = False) -> CompletionChunk:
        """`last`: a chunk that may end the stream (a finish_reason's, or the usage chunk after them)."""
        body = CompletionChunk(id=rid, created=created, model=model, choices=choices)
        if include_usage or continuous_usage:
            body.usage = usage
        return fingerprinted(body) if last else body

    def text_template(index: int) -> TextChunkTemplate:
        """A choice's chunks that carry text only (no logprobs, not the last)."""
        choice = CompletionChoice(
            index=index, text=TEXT_PLACEHOLDER, logprobs=None, finish_reason=None, stop_reason=None
        )
        return TextChunkTemplate(chunk_body([choice]))

    text_offset: dict[int, int] = {}  # text sent so far per choice
    templates: dict[int, TextChunkTemplate] = {}
    finals: dict[int, RequestOutput] = {}
    num_open = len(prompts) * n  # choices not finished

    def events(p: int, delta: CompletionDelta) -> str | bytes | None:
        """The SSE chunk of one prompt's delta (None while stream_interval holds it). The last choice's closing
        chunk goes out with the usage chunk, in one write."""
        nonlocal num_open
        finals[p] = delta.output
        index = p * n + delta.index
        pending = accumulator.add(index, delta)
        if pending is None:
            return None
        logprobs = None
        if req.logprobs is not None:
            if index in text_offset:
                offset = text_offset[index] + (len(echoed[p]) if req.echo else 0)
                logprobs = _logprobs(
                    state, pending.token_ids, pending.logprobs or [], offset, as_token_ids=as_token_ids
                )
            else:
                logprobs = choice_logprobs(delta.output, pending.token_ids, pending.logprobs)
        text = pending.text
        first = index not in text_offset  # the choice's first chunk
        if first:
            text = echoed[p] + text
        text_offset[index] = text_offset.get(index, 0) + len(pending.text)
        if logprobs is None and pending.finish_reason is None and not (req.return_token_ids or continuous_usage):
            template = templates.get(index) or templates.setdefault(index, text_template(index))
            return template.render(text)
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=pending.finish_reason,
            stop_reason=pending.stop_reason,
        )
        if req.return_token_ids:  # vLLM's: the prompt's in the choice's first chunk, each chunk's own tokens
            choice.token_ids = pending.token_ids
            if first:
                choice.prompt_token_ids = prompts[p][1]
        last = pending.finish_reason is not None and not include_usage
        event = sse(chunk_body([choice], usage_so_far() if continuous_usage else None, last))
        num_open -= pending.finish_reason is not None
        return event + usage_event() if num_open == 0 and include_usage else event

    def usage_so_far() -> Usage:
        completion_tokens = sum(len(o.token_ids) for f in finals.values() for o in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals.values())
        return state.usage(sum(len(ids) for _, ids in prompts), completion_tokens, cached)

    def usage_event() -> str:
        return sse(chunk_body([], usage_so_far(), last=True))

    async def chunks() -> AsyncIterator[str | bytes]:
        generations = [
            state.generate(ids, params, text, req.timeout, cache_salt=req.cache_salt) for text, ids in prompts
        ]
        if len(generations) == 1:  # read directly: a layer less between each token and the socket
            async with contextlib.aclosing(generations[0]) as deltas:
                async for delta in deltas:
                    if (event := events(0, delta)) is not None:
                        yield event
        else:
            async for p, delta in interleave(generations):
                if (event := events(p, delta)) is not None:
                    yield event
        if include_usage and num_open:  # a generation ended early (an error is raised instead)
            yield usage_event()

    return EventStreamResponse(chunks(), keep_alive_s=state.server.sse_keep_alive_interval)
