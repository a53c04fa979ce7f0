"""Responses API items: input items -> chat messages, and the output items (with their stream events) built from
the per-choice parser's fields."""

from __future__ import annotations

import base64
import uuid
import zlib
from typing import Any

from brisk.server.errors import APIError


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise APIError(400, "message content must be a string or a list of text parts", param="input")


# include reasoning.encrypted_content: a reasoning item's text, compressed and base64-encoded behind this tag. Encoded,
# not encrypted: the client holds the reasoning it was shown anyway; the blob only has to come back unchanged.
_REASONING_BLOB = "brisk-reasoning-v1."
_MAX_REASONING_BYTES = 1 << 24  # a blob inflating past this is no reasoning brisk returned (a zip bomb, say)


def reasoning_blob(text: str) -> str:
    return _REASONING_BLOB + base64.urlsafe_b64encode(zlib.compress(text.encode())).decode()


def _reasoning_of(item: dict[str, Any]) -> str:
    """A reasoning input item's text: its content, else its encrypted_content if brisk made it, else its summary
    (another server's blob: its reasoning is not readable here, and gpt-oss's prompt drops earlier turns' reasoning
    anyway, but within a chain of tool calls)."""
    text = _text_of(item.get("content") or [])
    blob = item.get("encrypted_content")
    if not text and isinstance(blob, str) and blob.startswith(_REASONING_BLOB):
        inflate = zlib.decompressobj()
        try:
            data = inflate.decompress(base64.urlsafe_b64decode(blob[len(_REASONING_BLOB) :]), _MAX_REASONING_BYTES)
            if inflate.unconsumed_tail or not inflate.eof:
                raise ValueError("longer than any reasoning brisk returns, or cut short")
            return data.decode()
        except (ValueError, zlib.error):  # binascii.Error and UnicodeDecodeError are ValueErrors
            raise APIError(400, "a reasoning item's encrypted_content is damaged", param="input") from None
    return text or _text_of(item.get("summary") or [])


def input_items(input_: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as items (a string is one user message), each with an id (for /input_items)."""
    items = [{"type": "message", "role": "user", "content": input_}] if isinstance(input_, str) else input_
    return [item if item.get("id") else {"id": f"item_{uuid.uuid4().hex}", **item} for item in items]


def items_to_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items (messages, reasoning, function calls and their outputs) -> chat messages for the renderer."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    pending_reasoning = None
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            if role not in ("user", "assistant", "system"):
                raise APIError(400, f"unsupported message role {item.get('role')!r}", param="input")
            msg: dict[str, Any] = {"role": role, "content": _text_of(item.get("content", ""))}
            if role == "assistant" and pending_reasoning:
                msg["reasoning_content"], pending_reasoning = pending_reasoning, None
            messages.append(msg)
        elif kind == "reasoning":
            pending_reasoning = _reasoning_of(item)
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


class OutputItems:
    """Builds output items from parser fields, and the stream events that describe them."""

    def __init__(self, encrypted_reasoning: bool = False) -> None:
        self.encrypted_reasoning = encrypted_reasoning  # include reasoning.encrypted_content
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._call_index: int | None = None
        self._logprobs: list[dict[str, Any]] = []  # of content tokens whose text is not out yet

    def _start(self, item: dict[str, Any]) -> dict[str, Any]:
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
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                }
            )
        return item

    def add(self, fields: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> None:
        """The parser's fields of one step; `logprobs`: the entries of that step's content tokens (include
        message.output_text.logprobs), sent with the text delta that carries their text."""
        idx = self._index
        self._logprobs += logprobs or []
        if fields.get("reasoning_content"):
            item = self._open
            if item is None or item["type"] != "reasoning":
                item = self._start(
                    {
                        "type": "reasoning",
                        "id": f"rs_{uuid.uuid4().hex}",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}],
                    }
                )
            item["content"][0]["text"] += fields["reasoning_content"]
            self.events.append(
                {
                    "type": "response.reasoning_text.delta",
                    "item_id": item["id"],
                    "output_index": idx(),
                    "content_index": 0,
                    "delta": fields["reasoning_content"],
                }
            )
        if fields.get("content"):
            item = self._open
            if item is None or item["type"] != "message":
                item = self._start(
                    {
                        "type": "message",
                        "id": f"msg_{uuid.uuid4().hex}",
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
                    }
                )
            item["content"][0]["text"] += fields["content"]
            entries, self._logprobs = self._logprobs, []
            item["content"][0]["logprobs"] += entries
            self.events.append(
                {
                    "type": "response.output_text.delta",
                    "item_id": item["id"],
                    "output_index": idx(),
                    "content_index": 0,
                    "delta": fields["content"],
                    "logprobs": entries,
                }
            )
        for call in fields.get("tool_calls", []):
            item = self._open
            if call.get("id") or item is None or item["type"] != "function_call" or self._call_index != call["index"]:
                item = self._start(
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
                item["arguments"] += delta
                self.events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": item["id"],
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
            part["logprobs"] += self._logprobs  # tokens that added no text of their own
            self._logprobs = []
            self.events.append(
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": part["logprobs"],
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
            if self.encrypted_reasoning:
                item["encrypted_content"] = reasoning_blob(item["content"][0]["text"])
        self.events.append({"type": "response.output_item.done", "output_index": i, "item": item})

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events
