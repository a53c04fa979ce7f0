"""Per-choice output parsers: generated tokens -> chat message fields, streamed or whole.

Plain models: the text is the content. gpt-oss: the harmony parser splits reasoning (analysis channel),
content (final channel) and tool calls (commentary to=functions.NAME); streaming and non-streaming use
the same parser, so they agree by construction.
"""

from __future__ import annotations

from typing import Any


class PlainChoiceParser:
    """The text is the content (stop strings were applied by the engine's detokenizer)."""

    has_tool_calls = False
    stopped = False  # stop strings end the completion in the engine

    def __init__(self) -> None:
        self.text = ""
        self.content_tokens: list[bool] = []  # of the last feed: every token is content
        self.reasoning_tokens: list[bool] = []  # of the last feed: none is reasoning

    def feed(self, token_ids: list[int], text: str) -> dict[str, Any]:
        self.text += text
        self.content_tokens = [True] * len(token_ids)
        self.reasoning_tokens = [False] * len(token_ids)
        return {"content": text} if text else {}

    def finish_stream(self) -> dict[str, Any]:
        return {}

    def finish(self) -> dict[str, Any]:
        return {"content": self.text}


class StopTrimmer:
    """Stop strings over a text that arrives in pieces: releases text that cannot begin a stop string, and cuts
    the text at the first stop string (keeping it with include_stop_str_in_output)."""

    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self.stops, self.include_stop = stops, include_stop
        self.held = ""
        self.stopped = False

    def add(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buf = self.held + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            pos, stop = min(hits)
            self.stopped, self.held = True, ""
            return buf[: pos + (len(stop) if self.include_stop else 0)]
        keep = next(
            (
                k
                for k in range(min(len(buf), max(map(len, self.stops)) - 1), 0, -1)
                if any(s.startswith(buf[-k:]) for s in self.stops)
            ),
            0,
        )
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held


class HarmonyChoiceParser:
    """gpt-oss output -> reasoning_content / content / tool_calls. Stop strings apply to `content` here (the
    engine does not see them: they must not match reasoning), and nothing after a stop is reported."""

    def __init__(
        self,
        tokenizer,
        prefix_ids: list[int],
        stop: list[str] | None = None,
        include_stop=False,
        text_decoder=None,
        include_reasoning: bool = True,
        include_tool_calls: bool = True,
    ) -> None:
        from brisk.harmony import HarmonyParser

        self.parser = HarmonyParser.from_tokenizer(tokenizer, text_decoder=text_decoder)
        self.include_reasoning = include_reasoning  # vLLM's include_reasoning: false leaves reasoning_content out
        self.include_tool_calls = include_tool_calls  # false under tool_choice "none": a call written is dropped
        self.has_tool_calls = False
        self._stop = StopTrimmer(list(stop or []), include_stop)
        self._finished = False
        self._emitted: dict[str, Any] = {}  # every field sent so far, merged: the non-streamed message
        self.content_tokens: list[bool] = []  # of the last feed: which tokens are text of `content`
        self.reasoning_tokens: list[bool] = []  # ... and which are text of `reasoning_content`
        # A forced tool-call prefix opens the call (id, name) before the model says anything: send that
        # with the first real delta.
        self._prefix_fields = self._fields(self.parser.feed(prefix_ids)) if prefix_ids else {}

    @property
    def stopped(self) -> bool:
        """A stop string ended the content: the rest of the output is dropped."""
        return self._stop.stopped

    def feed(self, token_ids: list[int], text: str) -> dict[str, Any]:
        from brisk.harmony.parser import CONTENT, REASONING

        if self.stopped:
            self.content_tokens = self.reasoning_tokens = [False] * len(token_ids)
            return {}
        destinations: list[str | None] = []
        fields = self._fields(self.parser.feed(token_ids, destinations))
        self.content_tokens = [d == CONTENT for d in destinations]
        self.reasoning_tokens = [d == REASONING for d in destinations]
        if self.stopped:  # tokens after the one that completed the stop string are not reported
            last = max((i for i, is_content in enumerate(self.content_tokens) if is_content), default=-1)
            self.content_tokens = [c and i <= last for i, c in enumerate(self.content_tokens)]
            self.reasoning_tokens = [r and i <= last for i, r in enumerate(self.reasoning_tokens)]
        if self._prefix_fields:
            prefix, self._prefix_fields = self._prefix_fields, {}
            for key, value in fields.items():
                merge_delta_fields(prefix, key, value)
            fields = prefix
        return self._note(fields)

    def finish_stream(self) -> dict[str, Any]:
        """The text only the end of output releases (a held-back character or a cut-off header)."""
        if self._finished:
            return {}
        self._finished = True
        fields, self._prefix_fields = self._prefix_fields, {}
        if not self.stopped:
            for key, value in self._fields(self.parser.finish().last_delta).items():
                merge_delta_fields(fields, key, value)
        held = self._stop.flush()
        if held:
            merge_delta_fields(fields, "content", held)
        return self._note(fields)

    def finish(self) -> dict[str, Any]:
        """The whole message: the merged fields the stream sent (so streamed and whole answers agree)."""
        self.finish_stream()
        emitted = self._emitted
        message: dict[str, Any] = {"content": emitted.get("content") or None}
        if emitted.get("reasoning_content"):
            message["reasoning_content"] = emitted["reasoning_content"]
        if emitted.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c.get("id"), "type": "function", "function": c["function"]} for c in emitted["tool_calls"]
            ]
        return message

    def _note(self, fields: dict[str, Any]) -> dict[str, Any]:
        for key, value in fields.items():
            merge_delta_fields(self._emitted, key, value)
        return fields

    def _fields(self, delta) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.stopped:
            return fields
        if delta.reasoning_content and self.include_reasoning:
            fields["reasoning_content"] = delta.reasoning_content
        if delta.content:
            content = self._stop.add(delta.content)
            if content:
                fields["content"] = content
            if self.stopped:
                return fields  # what followed the stop string in this delta is dropped
        if delta.tool_calls and self.include_tool_calls:
            self.has_tool_calls = True
            fields["tool_calls"] = [_tool_call_delta(c) for c in delta.tool_calls]
        return fields


def merge_delta_fields(fields: dict, key: str, value: Any) -> None:
    """Accumulate message delta fields (strings concatenate; fragments of one tool call join)."""
    if key == "tool_calls":
        calls = fields.setdefault("tool_calls", [])
        for call in value:
            if calls and calls[-1]["index"] == call["index"]:
                calls[-1]["function"]["arguments"] += call["function"].get("arguments", "")
            else:
                calls.append({**call, "function": dict(call["function"])})
    elif value:
        fields[key] = fields.get(key, "") + value


def _tool_call_delta(c) -> dict[str, Any]:
    out: dict[str, Any] = {"index": c.index, "function": {"arguments": c.arguments or ""}}
    if c.id:
        out["id"], out["type"] = c.id, "function"
    if c.name:
        out["function"]["name"] = c.name
    return out


def make_choice_parser(
    state,
    prefix_ids: list[int],
    stop: list[str] | None = None,
    include_stop: bool = False,
    include_reasoning: bool = True,
    include_tool_calls: bool = True,
):
    """The parser of one choice; `stop`: the stop strings a harmony parser applies to `content`;
    include_reasoning false: no `reasoning_content` (the model still reasons); include_tool_calls false: no
    `tool_calls` (tool_choice "none" with the tools shown)."""
    if state.is_harmony:
        return HarmonyChoiceParser(
            state.tokenizer,
            prefix_ids,
            stop,
            include_stop,
            state.harmony_text_decoder,
            include_reasoning,
            include_tool_calls,
        )
    return PlainChoiceParser()
