"""gpt-oss's harmony format: prompts from chat-completions requests, and a streaming parser of the output."""

from brisk.harmony.parser import HarmonyParser, HarmonySpecialTokens
from brisk.harmony.render import (
    render_with_harmony,
    render_with_template,
    to_template_messages,
    to_template_tools,
)
from brisk.harmony.results import (
    HarmonyDelta,
    HarmonyResult,
    ToolCall,
    ToolCallDelta,
    make_tool_call_id_factory,
)

__all__ = [
    "HarmonyDelta",
    "HarmonyParser",
    "HarmonyResult",
    "HarmonySpecialTokens",
    "ToolCall",
    "ToolCallDelta",
    "make_tool_call_id_factory",
    "render_with_harmony",
    "render_with_template",
    "to_template_messages",
    "to_template_tools",
]
