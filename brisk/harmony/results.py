"""What the harmony parser returns: per-feed deltas, the final result, and tool call ids."""

from __future__ import annotations

import random
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

TOOL_CALL_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass
class ToolCallDelta:
    index: int  # the tool call's position among this output's tool calls
    id: str | None = None  # set on the call's first delta only
    name: str | None = None  # set on the call's first delta only
    arguments: str = ""  # the next fragment of the JSON arguments


@dataclass
class HarmonyDelta:
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.reasoning_content or self.content or self.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # as generated: JSON unless the model erred or was cut off


@dataclass
class HarmonyResult:
    reasoning_content: str
    content: str
    tool_calls: list[ToolCall]
    warnings: list[str]
    # What finishing released beyond the feed() deltas (text held back as an incomplete character, a cut-off
    # header that turned out to be text): a streaming server sends it as the last chunk.
    last_delta: HarmonyDelta


def make_tool_call_id_factory(seed: int | None = None) -> Callable[[], str]:
    """Tool call ids `call_` + 24 letters and digits: random, or reproducible from `seed` (for tests)."""
    choose: Callable[[str], str] = secrets.choice if seed is None else random.Random(seed).choice
    return lambda: "call_" + "".join(choose(TOOL_CALL_ID_ALPHABET) for _ in range(24))
