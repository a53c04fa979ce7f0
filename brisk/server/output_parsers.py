"""Per-choice output parsers: generated tokens -> chat message fields, streamed or whole.

Plain models: the text is the content. gpt-oss: the harmony parser splits reasoning (analysis channel),
content (final channel) and tool calls (commentary to=functions.NAME); streaming and non-streaming use
the same parser, so they agree by construction.
"""

from __future__ import annotations

from typing import Any

from brisk.server.errors import APIError


class PlainChoiceParser:
    has_tool_calls = False

    def __init__(self) -> None:
        self.text = ""

    def feed(self, token_ids: list[int], text: str) -> dict[str, Any]:
        self.text += text
        return {"content": text} if text else {}

    def finish_stream(self) -> dict[str, Any]:
        return {}

    def finish(self) -> dict[str, Any]:
        return {"content": self.text}


class HarmonyChoiceParser:
    def __init__(self, tokenizer, prefix_ids: list[int]) -> None:
        from brisk.harmony import HarmonyParser

        self.parser = HarmonyParser.from_tokenizer(tokenizer)
        self.has_tool_calls = False
        self._result = None
        # A forced tool-call prefix opens the call (id, name) before the model says anything: send that
        # with the first real delta.
        self._prefix_fields = self._fields(self.parser.feed(prefix_ids)) if prefix_ids else {}

    def feed(self, token_ids: list[int], text: str) -> dict[str, Any]:
        fields = self._fields(self.parser.feed(token_ids))
        if self._prefix_fields:
            prefix, self._prefix_fields = self._prefix_fields, {}
            for key, value in fields.items():
                merge_delta_fields(prefix, key, value)
            fields = prefix
        return fields

    def finish_stream(self) -> dict[str, Any]:
        """The text only the end of output releases (a held-back character or a cut-off header)."""
        self._result = self.parser.finish()
        return self._fields(self._result.last_delta)

    def finish(self) -> dict[str, Any]:
        result = self._result or self.parser.finish()
        message: dict[str, Any] = {"content": result.content or None}
        if result.reasoning_content:
            message["reasoning_content"] = result.reasoning_content
        if result.tool_calls:
            self.has_tool_calls = True
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in result.tool_calls
            ]
        return message

    def _fields(self, delta) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if delta.reasoning_content:
            fields["reasoning_content"] = delta.reasoning_content
        if delta.content:
            fields["content"] = delta.content
        if delta.tool_calls:
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


def make_choice_parser(state, prefix_ids: list[int]):
    return HarmonyChoiceParser(state.tokenizer, prefix_ids) if state.is_harmony else PlainChoiceParser()


def prepare_tools(state, tools: list[dict] | None, tool_choice) -> tuple[list[dict] | None, list[int]]:
    """Validate tool_choice against the tools; return the tools to render and the forced-call prefix ids.

    tool_choice 'required' or a named function starts the assistant turn as a harmony tool call, so
    the model can only answer with a call (prompting alone leaves tool_calls empty too often).
    """
    choice = tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs 'tools'.", param="tool_choice")
    if not tools:
        return None, []
    if not state.is_harmony:
        raise APIError(400, "Function tools are supported for gpt-oss (harmony) models only.", param="tools")
    if choice == "none":
        return None, []
    if choice == "auto":
        return tools, []
    name = ""
    if choice != "required":
        if choice.function.name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice names an unknown function '{choice.function.name}'.", param="tool_choice")
        name = choice.function.name + " <|constrain|>json<|message|>"
    prefix = state.tokenizer.encode("<|channel|>commentary to=functions." + name, add_special_tokens=False)
    return tools, prefix
