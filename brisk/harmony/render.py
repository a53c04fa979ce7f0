"""gpt-oss prompts from OpenAI chat-completions requests.

`to_template_messages` and `to_template_tools` turn a request's `messages` and `tools` into what gpt-oss's chat
template (`chat_template.jinja`) expects; `render_with_template` applies it. `render_with_harmony` renders the
same conversation with the `openai-harmony` library instead, which tests use to prove the two identical.

How the template represents a conversation, and what this module does about it:
- Only the first message may be `system`/`developer` (the developer message's "# Instructions"); later ones
  would be dropped silently, so all of them are joined into the first.
- Assistant reasoning goes in `thinking`. The template renders it only for a tool-call turn that no later
  final answer follows (the tool-use chain in progress): reasoning of finished turns is dropped, as harmony's
  guidance says. Requests name it `reasoning_content` (or `reasoning`).
- The template renders one tool call per assistant message and gives every tool result the name of the most
  recent call. Harmony's own shape is one call, then its result, then the next call, so an assistant message
  with several calls is split into call, result, call, result, ... with results matched by `tool_call_id`.
- Tool call arguments and tool results go through the template's `tojson`: arguments are passed parsed (so they
  render as JSON, not as a quoted string), and so are results that are valid JSON; other results render as a
  JSON string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding, Message
    from transformers import PreTrainedTokenizerBase

REASONING_EFFORTS = ("low", "medium", "high")
BUILTIN_TOOLS = ("browser", "python")
# The template's defaults (build_system_message in chat_template.jinja).
DEFAULT_MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
DATE_FORMAT = "%Y-%m-%d"  # the template's strftime_now format for "Current date"


def to_template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Convert chat-completions `messages` into the message list gpt-oss's chat template expects.

    Raises ValueError for what cannot be rendered: unknown roles, non-text content, a tool call without a
    function name, a tool result with no tool call before it.
    """
    instructions: list[str] = []
    converted: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, of every call so far
    index = 0
    while index < len(messages):
        message = messages[index]
        role = message.get("role")
        index += 1
        if role in ("system", "developer"):
            instructions.append(message_text(message.get("content"), role))
        elif role == "user":
            converted.append({"role": "user", "content": message_text(message.get("content"), role)})
        elif role == "assistant" and message.get("tool_calls"):
            # The tool results answering these calls follow the assistant message.
            results_end = index
            while results_end < len(messages) and messages[results_end].get("role") == "tool":
                results_end += 1
            converted.extend(_tool_call_turns(message, messages[index:results_end], call_names))
            index = results_end
        elif role == "assistant":
            turn = {"role": "assistant", "content": message_text(message.get("content"), role)}
            reasoning = message_reasoning(message)
            if reasoning:
                turn["thinking"] = reasoning
            converted.append(turn)
        elif role == "tool":
            # A result that does not directly follow its call; the template names it after the latest call.
            call_id = message.get("tool_call_id")
            name = (call_names.get(call_id) if isinstance(call_id, str) else None) or message.get("name")
            if not call_names or not name:
                raise ValueError("a tool message must answer a tool call of an earlier assistant message")
            converted.append(_tool_result(message, name))
        else:
            raise ValueError(f"unsupported message role {role!r}")
    if instructions:
        converted.insert(0, {"role": "developer", "content": "\n\n".join(instructions)})
    return converted


def to_template_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Chat-completions `tools` in the shape the template reads (`{"type": "function", "function": {...}}`).

    The template needs a description (it prints "// " + description) and treats parameters without properties
    as no parameters; both are made explicit here so that harmony renders the same.
    """
    if not tools:
        return None
    converted = []
    for tool in tools:
        if tool.get("type", "function") != "function":
            raise ValueError(f"unsupported tool type {tool.get('type')!r}")
        function = tool.get("function") or {}
        if not function.get("name"):
            raise ValueError("a function tool needs a name")
        spec: dict[str, Any] = {"name": function["name"], "description": function.get("description") or ""}
        parameters = function.get("parameters")
        if parameters and parameters.get("properties"):
            spec["parameters"] = dict(parameters)
        converted.append({"type": "function", "function": spec})
    return converted


def render_with_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str = "medium",
    *,
    model_identity: str | None = None,
    builtin_tools: Sequence[str] = (),
) -> list[int]:
    """The prompt token ids from the tokenizer's chat template, ending in the `<|start|>assistant` prompt."""
    _check_options(reasoning_effort, builtin_tools)
    template_kwargs: dict[str, Any] = {"reasoning_effort": reasoning_effort}
    if model_identity is not None:
        template_kwargs["model_identity"] = model_identity
    if builtin_tools:
        template_kwargs["builtin_tools"] = list(builtin_tools)
    # transformers types the result as ids or a dict and `tools` narrower than the JSON schemas it accepts
    encoded: Any = tokenizer.apply_chat_template(
        to_template_messages(messages),
        tools=cast(Any, to_template_tools(tools)),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **template_kwargs,
    )
    return list(encoded["input_ids"])


def render_with_harmony(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str = "medium",
    *,
    model_identity: str | None = None,
    builtin_tools: Sequence[str] = (),
    conversation_start_date: str | None = None,
    encoding: HarmonyEncoding | None = None,
) -> list[int]:
    """The same prompt as `render_with_template`, rendered by `openai-harmony` (needs the `openai-harmony` package).

    `conversation_start_date` defaults to today, as the template's `strftime_now` does; `encoding` defaults to
    a freshly loaded o200k_harmony (offline, it needs TIKTOKEN_ENCODINGS_BASE naming a folder holding
    o200k_base.tiktoken).
    """
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        HarmonyEncodingName,
        Message,
        ReasoningEffort,
        RenderConversationConfig,
        Role,
        SystemContent,
        ToolDescription,
        load_harmony_encoding,
    )

    _check_options(reasoning_effort, builtin_tools)
    if encoding is None:
        encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    system = (
        SystemContent.new()
        .with_model_identity(model_identity if model_identity is not None else DEFAULT_MODEL_IDENTITY)
        .with_knowledge_cutoff(KNOWLEDGE_CUTOFF)
        .with_conversation_start_date(conversation_start_date or datetime.now().strftime(DATE_FORMAT))
        .with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize()))
    )
    if "browser" in builtin_tools:
        system = system.with_browser_tool()
    if "python" in builtin_tools:
        system = system.with_python_tool()
    rendered: list[Message] = [Message.from_role_and_content(Role.SYSTEM, system)]

    template_messages = to_template_messages(messages)
    instructions = ""
    if template_messages and template_messages[0]["role"] == "developer":
        instructions = template_messages.pop(0)["content"]
    template_tools = to_template_tools(tools)
    if instructions or template_tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if template_tools:
            developer = developer.with_function_tools(
                [
                    ToolDescription.new(spec["name"], spec["description"], spec.get("parameters"))
                    for spec in (tool["function"] for tool in template_tools)
                ]
            )
        rendered.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    rendered.extend(_harmony_messages(template_messages))
    # The analysis messages to keep were chosen above, as the template chooses them; harmony's own rule (drop
    # analysis only when the last assistant message is a final answer) keeps finished turns' reasoning.
    return encoding.render_conversation_for_completion(
        Conversation.from_messages(rendered), Role.ASSISTANT, RenderConversationConfig(auto_drop_analysis=False)
    )


def _harmony_messages(template_messages: list[dict[str, Any]]) -> list[Message]:
    """Harmony messages for the template's user/assistant/tool messages, with the template's analysis policy."""
    from openai_harmony import Author, Message, Role

    # Reasoning is kept only for tool-call turns after the last final answer (chat_template.jinja's
    # future_final_message check).
    last_final = max(
        (i for i, m in enumerate(template_messages) if m["role"] == "assistant" and "tool_calls" not in m), default=-1
    )
    rendered: list[Message] = []
    last_call_name: str | None = None
    for position, message in enumerate(template_messages):
        if message["role"] == "user":
            rendered.append(Message.from_role_and_content(Role.USER, message["content"]))
        elif message["role"] == "tool":
            author = Author.new(Role.TOOL, f"functions.{last_call_name}")
            rendered.append(
                Message.from_author_and_content(author, _tojson(message["content"]))
                .with_recipient("assistant")
                .with_channel("commentary")
            )
        elif "tool_calls" in message:
            analysis = message.get("thinking") or message.get("content")
            if analysis and position > last_final:
                rendered.append(Message.from_role_and_content(Role.ASSISTANT, analysis).with_channel("analysis"))
            function = message["tool_calls"][0]["function"]
            last_call_name = function["name"]
            rendered.append(
                Message.from_role_and_content(Role.ASSISTANT, _tojson(function["arguments"]))
                .with_channel("commentary")
                .with_recipient(f"functions.{last_call_name}")
                .with_content_type("json")
            )
        else:
            rendered.append(Message.from_role_and_content(Role.ASSISTANT, message["content"]).with_channel("final"))
    return rendered


def _tool_call_turns(
    message: Mapping[str, Any], results: Sequence[Mapping[str, Any]], call_names: dict[str, str]
) -> list[dict[str, Any]]:
    """One assistant message per tool call, each followed by its result (matched by id, else in order)."""
    calls = message["tool_calls"]
    call_ids = [call.get("id") or None for call in calls]
    results_by_id = {r["tool_call_id"]: r for r in results if r.get("tool_call_id") and r["tool_call_id"] in call_ids}
    unmatched = [r for r in results if not any(r is matched for matched in results_by_id.values())]
    turns: list[dict[str, Any]] = []
    name = ""
    for position, (call, call_id) in enumerate(zip(calls, call_ids)):
        function = call.get("function") or {}
        name = function.get("name") or ""
        if not name:
            raise ValueError("an assistant tool call needs a function name")
        if call_id is not None:
            call_names[call_id] = name
        turn: dict[str, Any] = {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": _parsed_json(function.get("arguments"))},
                }
            ],
        }
        if position == 0:
            # The template renders either field as the turn's analysis message and refuses both; reasoning wins,
            # content (a user-facing preamble) is the template's fallback for clients that put reasoning there.
            reasoning = message_reasoning(message)
            content = message_text(message.get("content"), "assistant")
            if reasoning:
                turn["thinking"] = reasoning
            elif content:
                turn["content"] = content
        turns.append(turn)
        result = results_by_id.get(call_id) if call_id is not None else None
        if result is None and unmatched:
            result = unmatched.pop(0)
        if result is not None:
            turns.append(_tool_result(result, name))
    # Results beyond the calls (ids that match nothing) answer the last call, as the template would have it.
    turns.extend(_tool_result(result, name) for result in unmatched)
    return turns


def _tool_result(message: Mapping[str, Any], name: str) -> dict[str, Any]:
    content = _parsed_json(message_text(message.get("content"), "tool"))
    return {"role": "tool", "name": name, "tool_call_id": message.get("tool_call_id"), "content": content}


def message_reasoning(message: Mapping[str, Any]) -> str:
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    return reasoning if isinstance(reasoning, str) else ""


def message_text(content: Any, role: str) -> str:
    """A message's text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{role} message: only text content is supported, got {kind!r}")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ValueError(f"{role} message: content must be a string or a list of text parts")


def _parsed_json(value: Any) -> Any:
    """A JSON string parsed, so that the template's tojson renders JSON rather than a quoted string."""
    if value is None:
        return {}
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _tojson(value: Any) -> str:
    # The template's tojson filter (transformers' chat template environment).
    return json.dumps(value, ensure_ascii=False)


def _check_options(reasoning_effort: str, builtin_tools: Sequence[str]) -> None:
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    unknown = set(builtin_tools) - set(BUILTIN_TOOLS)
    if unknown:
        raise ValueError(f"builtin_tools may only contain {BUILTIN_TOOLS}, got {sorted(unknown)}")
