"""The one chat renderer: chat-completions `messages` (+ tools) -> prompt token ids.

gpt-oss renders through the harmony conversion (`render.py`) and its chat template; other models through
their tokenizer's chat template. The server's three APIs and the offline `LLM.chat` all call `render_chat`,
so a conversation becomes the same tokens on every path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from brisk.harmony.render import render_with_template

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def is_harmony_model(model_type: str, tokenizer: Any) -> bool:
    """gpt-oss with a harmony vocabulary (its output is parsed into reasoning / content / tool calls)."""
    return model_type == "gpt_oss" and "<|channel|>" in tokenizer.get_vocab()


def check_roles(messages: Sequence[Mapping[str, Any]]) -> None:
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; a role is one of {', '.join(CHAT_ROLES)}")


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    harmony: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Prompt token ids for a conversation. Raises ValueError (or the template's own error) when it
    cannot be rendered: an unknown role, non-text content, options the template does not take."""
    check_roles(messages)
    kwargs = dict(template_kwargs or {})
    # The request's reasoning_effort before the template kwargs' (the request's chat_template_kwargs, then the
    # server's --default-chat-template-kwargs).
    kwargs_effort = kwargs.pop("reasoning_effort", None)
    if harmony:
        return render_with_template(tokenizer, messages, tools, reasoning_effort or kwargs_effort or "medium", **kwargs)
    if reasoning_effort is not None or kwargs_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort or kwargs_effort
    out = tokenizer.apply_chat_template(
        list(messages), tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    # transformers 5 returns a BatchEncoding-like mapping; 4.x returns the ids.
    return list(out["input_ids"] if hasattr(out, "keys") else out)
