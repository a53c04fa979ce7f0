"""The one chat renderer: chat-completions `messages` (+ tools) -> prompt token ids.

gpt-oss renders through the harmony conversion (`render.py`) and its chat template; other models through
their tokenizer's chat template. The server's three APIs and the offline `LLM.chat` all call `render_chat`,
so a conversation becomes the same tokens on every path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from brisk.harmony.render import message_reasoning, message_text, render_with_template

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
    continue_final_message: bool = False,
) -> list[int]:
    """Prompt token ids for a conversation. Raises ValueError (or the template's own error) when it
    cannot be rendered: an unknown role, non-text content, options the template does not take.

    continue_final_message (vLLM's): the last message is left open, so the model continues it (a prefill) instead
    of starting a new turn; on harmony models it is the assistant's, continued in its channel
    (`continued_message_header`)."""
    check_roles(messages)
    if continue_final_message and not messages:
        raise ValueError("continue_final_message needs a message to continue")
    kwargs = dict(template_kwargs or {})
    # The request's reasoning_effort before the template kwargs' (the request's chat_template_kwargs, then the
    # server's --default-chat-template-kwargs).
    kwargs_effort = kwargs.pop("reasoning_effort", None)
    if harmony:
        effort = reasoning_effort or kwargs_effort or "medium"
        if not continue_final_message:
            return render_with_template(tokenizer, messages, tools, effort, **kwargs)
        # The turns before, ending in `<|start|>assistant`, then the last message's own channels, left open. Its
        # text is tokenized as the template's is (special tokens' text read as them), split at special tokens both
        # ways, so the joint is where a whole rendering would put it.
        turn = _continued_turn(messages[-1])  # first: a last message that cannot be continued says so
        before = render_with_template(tokenizer, messages[:-1], tools, effort, **kwargs)
        return before + list(tokenizer.encode(turn, add_special_tokens=False))
    if reasoning_effort is not None or kwargs_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort or kwargs_effort
    if continue_final_message:
        kwargs["continue_final_message"] = True
    out = tokenizer.apply_chat_template(
        list(messages),
        tools=tools,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        tokenize=True,
        **kwargs,
    )
    # transformers 5 returns a BatchEncoding-like mapping; 4.x returns the ids.
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def continued_message_header(message: Mapping[str, Any]) -> str:
    """The harmony header of the message `continue_final_message` leaves open (the assistant's last message):
    the final channel where it has content (even empty: the answer without more reasoning), else the analysis
    channel of its reasoning. What the output parser reads first, as if the model had written it."""
    if message.get("role") != "assistant" or message.get("tool_calls"):
        raise ValueError("continue_final_message continues an assistant message without tool calls")
    if message.get("content") is not None:
        return "<|channel|>final<|message|>"
    if message_reasoning(message):
        return "<|channel|>analysis<|message|>"
    raise ValueError("continue_final_message: the last message has neither content nor reasoning to continue")


def _continued_turn(message: Mapping[str, Any]) -> str:
    """The assistant turn so far, after its `<|start|>assistant`: its reasoning, then its answer begun."""
    header = continued_message_header(message)
    reasoning = message_reasoning(message)
    if header.startswith("<|channel|>analysis"):
        return header + reasoning
    turn = header + message_text(message.get("content"), "assistant")
    return f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant{turn}" if reasoning else turn
