"""POST /v1/chat/completions: render the chat, generate, parse (harmony for gpt-oss), stream or not."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from brisk.server.app import ServerState, sse, stream_with_errors, until_disconnected, usage
from brisk.server.errors import APIError
from brisk.server.output_parsers import make_choice_parser, merge_delta_fields, prepare_tools
from brisk.server.protocol import ChatCompletionRequest


def render_chat_prompt(
    state: ServerState,
    messages: list[dict],
    tools: list[dict] | None,
    reasoning_effort: str | None,
    template_kwargs: dict,
    add_generation_prompt: bool = True,
) -> list[int]:
    try:
        if state.is_harmony:
            from brisk.harmony import render_with_template

            return render_with_template(
                state.tokenizer, messages, tools, reasoning_effort or "medium", **template_kwargs
            )
        out = state.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
        )
    except APIError:
        raise
    except Exception as exc:
        raise APIError(400, f"Cannot render the messages with the chat template: {exc}", param="messages") from None
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _logprobs_entry(tokenizer, token_id: int, logprobs: dict[int, float], top_n: int) -> dict:
    def item(tok: int, lp: float) -> dict:
        text = tokenizer.decode([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:top_n]
    return {**item(token_id, logprobs[token_id]), "top_logprobs": [item(t, lp) for t, lp in top]}


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        state.check_model(req.model)
        state.admit()
        params = state.sampling_params(req)
        tools, forced = prepare_tools(
            state, [t.model_dump(exclude_none=True) for t in req.tools or []], req.tool_choice
        )
        prompt_ids = (
            render_chat_prompt(
                state,
                req.messages,
                tools,
                req.reasoning_effort,
                req.chat_template_kwargs or {},
                req.add_generation_prompt,
            )
            + forced
        )
        state.check_prompt(prompt_ids, params)
        parsers = [make_choice_parser(state, forced) for _ in range(params.n)]
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name
        top_n = req.top_logprobs or 0
        deltas = state.generate(prompt_ids, params, timeout=req.timeout)

        async def whole_response() -> dict[str, Any]:
            final = None
            async for delta in deltas:
                final = delta.output
            choices = []
            for out, parser in zip(final.outputs, parsers):
                parser.feed(out.token_ids, out.text)
                message = {"role": "assistant", **parser.finish()}
                logprobs = None
                if req.logprobs:
                    logprobs = {
                        "content": [
                            _logprobs_entry(state.tokenizer, t, lp, top_n) for t, lp in zip(out.token_ids, out.logprobs)
                        ]
                    }
                reason = (
                    "tool_calls" if message.get("tool_calls") and out.finish_reason == "stop" else out.finish_reason
                )
                choices.append({"index": out.index, "message": message, "logprobs": logprobs, "finish_reason": reason})
            completion_tokens = sum(len(o.token_ids) for o in final.outputs)
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage(len(prompt_ids), completion_tokens, final.num_cached_tokens),
            }

        if not req.stream:
            return await until_disconnected(raw, whole_response())

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        interval = state.config.stream_interval

        async def chunks():
            def chunk(choices: list[dict], usage_: dict | None = None) -> str:
                body: dict[str, Any] = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": choices,
                }
                if include_usage:
                    body["usage"] = usage_
                return sse(body)

            for i in range(params.n):
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            pending: dict[int, dict] = {}  # per choice: message fields and logprobs not yet sent
            final = None
            async for delta in deltas:
                final = delta.output
                p = pending.setdefault(delta.index, {"fields": {}, "logprobs": [], "tokens": 0})
                for key, value in parsers[delta.index].feed(delta.token_ids, delta.text).items():
                    merge_delta_fields(p["fields"], key, value)
                if req.logprobs and delta.logprobs:
                    p["logprobs"] += [
                        _logprobs_entry(state.tokenizer, t, lp, top_n) for t, lp in zip(delta.token_ids, delta.logprobs)
                    ]
                p["tokens"] += len(delta.token_ids)
                if p["tokens"] < interval and delta.finish_reason is None:
                    continue  # stream_interval: send every `interval` tokens
                reason = delta.finish_reason
                if reason is not None:
                    for key, value in parsers[delta.index].finish_stream().items():
                        merge_delta_fields(p["fields"], key, value)
                    if parsers[delta.index].has_tool_calls and reason == "stop":
                        reason = "tool_calls"
                pending.pop(delta.index)
                if p["fields"] or p["logprobs"] or reason is not None:
                    yield chunk(
                        [
                            {
                                "index": delta.index,
                                "delta": p["fields"],
                                "logprobs": {"content": p["logprobs"]} if req.logprobs else None,
                                "finish_reason": reason,
                            }
                        ]
                    )
            if include_usage and final is not None:
                completion_tokens = sum(len(o.token_ids) for o in final.outputs)
                yield chunk([], usage(len(prompt_ids), completion_tokens, final.num_cached_tokens))

        return StreamingResponse(stream_with_errors(chunks()), media_type="text/event-stream")
