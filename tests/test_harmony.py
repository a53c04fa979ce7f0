"""gpt-oss harmony format: prompts rendered by the real chat template equal openai-harmony's, and the streaming
output parser turns hand-written harmony outputs (well-formed, malformed, cut off) into reasoning, content and
tool calls, the same whatever the streaming chunks."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from brisk.detokenizer import TokenDecoder
from brisk.harmony import (
    HarmonyDelta,
    HarmonyParser,
    HarmonyResult,
    HarmonySpecialTokens,
    make_tool_call_id_factory,
    render_with_harmony,
    render_with_template,
    to_template_messages,
)
from tests.harmony_tokenizer import TIKTOKEN_DIR, VOCAB_SIZE, make_gpt_oss_tokenizer
from tests.tiny_tokenizer import make_tiny_tokenizer

# The ids fixed by gpt-oss's tokenizer (ANCHORS.md).
SPECIAL_IDS = {
    "<|return|>": 200002,
    "<|constrain|>": 200003,
    "<|channel|>": 200005,
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|call|>": 200012,
}
SPECIAL_TOKEN_PATTERN = re.compile(r"(<\|[a-z_0-9]+\|>)")
DATE_FORMAT = "%Y-%m-%d"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpt_oss_tokenizer")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerFast:
    return make_gpt_oss_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def encoding() -> Any:
    """openai-harmony's o200k_harmony encoding, the reference renderer and parser."""
    openai_harmony = pytest.importorskip("openai_harmony")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", str(TIKTOKEN_DIR))  # offline: the shared o200k_base file
        return openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Token ids of hand-written harmony text: the text between special tokens encoded, their ids inserted."""
    ids: list[int] = []
    for piece in SPECIAL_TOKEN_PATTERN.split(text):
        if piece in SPECIAL_IDS:
            ids.append(SPECIAL_IDS[piece])
        elif piece:
            ids.extend(tokenizer.encode(piece, add_special_tokens=False))
    return ids


# The tokenizer ---------------------------------------------------------------------------------------------------


def test_tokenizer_is_o200k_harmony(tokenizer: PreTrainedTokenizerFast, encoding: Any, tmp_path: Path) -> None:
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.eos_token == "<|return|>" and tokenizer.eos_token_id == 200002
    assert {text: tokenizer.convert_tokens_to_ids(text) for text in SPECIAL_IDS} == SPECIAL_IDS
    text = "Hello, world! Straße 你好 😀👨‍👩‍👧 don't DON'T 1234567 \n\n\tfoo(bar) <html> ∑"
    assert tokenizer.encode(text, add_special_tokens=False) == encoding.encode(text)
    assert tokenizer.decode(encoding.encode(text)) == text


def test_tokenizer_directory_loads_with_auto_tokenizer(tokenizer: PreTrainedTokenizerFast, tokenizer_dir: Path) -> None:
    built_at = (tokenizer_dir / "tokenizer.json").stat().st_mtime_ns
    loaded = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert len(loaded) == VOCAB_SIZE
    assert loaded.chat_template == (tokenizer_dir / "chat_template.jinja").read_text()
    assert "reasoning_effort" in loaded.chat_template
    text = "<|start|>user<|message|>Hi 😀<|end|>"
    assert loaded.encode(text) == tokenizer.encode(text)
    # A directory built already is reused as it is.
    assert make_gpt_oss_tokenizer(tokenizer_dir).encode(text) == tokenizer.encode(text)
    assert (tokenizer_dir / "tokenizer.json").stat().st_mtime_ns == built_at


# Prompt rendering: the chat template == openai-harmony ------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "description": "How many days to forecast"},
                "hourly": {"type": "boolean"},
                "fields": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["location"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The current UTC time."}}

TOOL_USE_CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "The user wants the weather; call get_weather.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"location":"Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temperature": 21, "sky": "sunny"}'},
    {"role": "assistant", "content": "It is 21°C and sunny in Paris.", "reasoning_content": "Report it."},
    {"role": "user", "content": [{"type": "text", "text": "And London, and the time?"}]},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two calls: weather and time.",
        "tool_calls": [
            {"id": "call_b", "function": {"name": "get_weather", "arguments": '{"location":"London"}'}},
            {"id": "call_c", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    # Answered out of order: matched to their calls by id.
    {"role": "tool", "tool_call_id": "call_c", "content": "12:00"},
    {"role": "tool", "tool_call_id": "call_b", "content": '{"temperature": 15, "sky": "rain"}'},
]


def render_both(
    tokenizer: PreTrainedTokenizerFast, encoding: Any, messages: list[dict[str, Any]], **options: Any
) -> tuple[list[int], list[int]]:
    """The prompt from the chat template and from openai-harmony, for the same day."""
    while True:  # the template stamps today's date; render again if the day changed in between
        day = datetime.now().strftime(DATE_FORMAT)
        from_template = render_with_template(tokenizer, messages, **options)
        from_harmony = render_with_harmony(messages, conversation_start_date=day, encoding=encoding, **options)
        if datetime.now().strftime(DATE_FORMAT) == day:
            return from_template, from_harmony


@pytest.mark.parametrize(
    ("messages", "options"),
    [
        pytest.param([{"role": "user", "content": "Hi! 你好 😀"}], {}, id="plain-user-turn"),
        pytest.param([{"role": "user", "content": "Hi"}], {"reasoning_effort": "low"}, id="reasoning-low"),
        pytest.param([{"role": "user", "content": "Hi"}], {"reasoning_effort": "high"}, id="reasoning-high"),
        pytest.param([{"role": "user", "content": "Hi"}], {"tools": [WEATHER_TOOL, TIME_TOOL]}, id="function-tools"),
        pytest.param(
            [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
            {"tools": [WEATHER_TOOL]},
            id="system-message-and-tools",
        ),
        pytest.param(
            [{"role": "user", "content": "Hi"}],
            {"model_identity": "You are Brisk.", "builtin_tools": ["browser", "python"]},
            id="identity-and-builtin-tools",
        ),
        pytest.param(TOOL_USE_CONVERSATION, {"tools": [WEATHER_TOOL, TIME_TOOL]}, id="multi-turn-tool-use"),
    ],
)
def test_chat_template_renders_like_openai_harmony(
    tokenizer: PreTrainedTokenizerFast, encoding: Any, messages: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    from_template, from_harmony = render_both(tokenizer, encoding, messages, **options)
    assert tokenizer.decode(from_template) == encoding.decode(from_harmony)
    assert from_template == from_harmony
    assert from_template[-2:] == [SPECIAL_IDS["<|start|>"], tokenizer.convert_tokens_to_ids("assistant")]


def test_system_message_becomes_developer_instructions(tokenizer: PreTrainedTokenizerFast, encoding: Any) -> None:
    """Without tools the template ends the instructions with a blank line that harmony does not write."""
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    from_template, _ = render_both(tokenizer, encoding, messages)
    assert "<|start|>developer<|message|># Instructions\n\nBe terse.\n\n<|end|>" in tokenizer.decode(from_template)
    padded = [{"role": "system", "content": "Be terse.\n\n"}, {"role": "user", "content": "Hi"}]
    _, from_harmony = render_both(tokenizer, encoding, padded)
    assert from_template == from_harmony


def test_multi_turn_keeps_reasoning_of_the_tool_chain_in_progress_only(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tokenizer.decode(render_with_template(tokenizer, TOOL_USE_CONVERSATION, [WEATHER_TOOL, TIME_TOOL]))
    assert "call get_weather" not in prompt and "Report it." not in prompt  # turns answered already
    assert "<|start|>assistant<|channel|>analysis<|message|>Two calls: weather and time.<|end|>" in prompt
    calls = [
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"location": "London"}<|call|>',
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temperature": 15, "sky": "rain"}',
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
        '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"12:00"<|end|><|start|>assistant',
    ]
    positions = [prompt.index(call) for call in calls]
    assert positions == sorted(positions)


def test_to_template_messages() -> None:
    messages = to_template_messages(
        [
            {"role": "system", "content": "One."},
            {"role": "user", "content": "Hi"},
            {"role": "developer", "content": [{"type": "text", "text": "Two."}]},
            {
                "role": "assistant",
                "reasoning": "Think.",
                "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "not json"},
            {"role": "assistant", "content": "Done.", "reasoning_content": "Finish."},
        ]
    )
    assert messages == [
        {"role": "developer", "content": "One.\n\nTwo."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "thinking": "Think.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": [1, 2]}}}],
        },
        {"role": "tool", "name": "f", "tool_call_id": "c1", "content": "not json"},
        {"role": "assistant", "content": "Done.", "thinking": "Finish."},
    ]


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text content"),
        ([{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "x", "content": "1"}], "tool call"),
        ([{"role": "assistant", "tool_calls": [{"id": "x", "function": {"arguments": "{}"}}]}], "function name"),
        ([{"role": "robot", "content": "beep"}], "unsupported message role"),
    ],
)
def test_to_template_messages_rejects_what_cannot_be_rendered(messages: list[dict[str, Any]], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        to_template_messages(messages)


def test_render_rejects_unknown_options(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="reasoning_effort"):
        render_with_template(tokenizer, [{"role": "user", "content": "Hi"}], reasoning_effort="extreme")
    with pytest.raises(ValueError, match="builtin_tools"):
        render_with_template(tokenizer, [{"role": "user", "content": "Hi"}], builtin_tools=["shell"])


@pytest.mark.parametrize(
    "last",
    [
        {"role": "assistant", "content": "The answer is"},
        {"role": "assistant", "content": ""},  # the answer at once, no more reasoning
        {"role": "assistant", "content": None, "reasoning_content": "The user asks"},
        {"role": "assistant", "content": "It is", "reasoning_content": "Easy."},
    ],
    ids=["answer", "empty-answer", "reasoning", "reasoning-then-answer"],
)
def test_continue_final_message_leaves_the_assistants_turn_open(
    tokenizer: PreTrainedTokenizerFast, encoding: Any, last: dict[str, Any]
) -> None:
    """The conversation before, rendered by openai-harmony for completion (ending in <|start|>assistant), then the
    assistant's messages as openai-harmony writes them, less that <|start|>assistant and the last <|end|>."""
    from openai_harmony import Message, Role

    from brisk.harmony.chat import render_chat

    messages = [{"role": "user", "content": "What is 2+2?"}, last]
    turn = []
    if last.get("reasoning_content"):
        turn.append(Message.from_role_and_content(Role.ASSISTANT, last["reasoning_content"]).with_channel("analysis"))
    if last["content"] is not None:
        turn.append(Message.from_role_and_content(Role.ASSISTANT, last["content"]).with_channel("final"))
    written = [t for message in turn for t in encoding.render(message)]
    assert written[:2] == [SPECIAL_IDS["<|start|>"], tokenizer.convert_tokens_to_ids("assistant")]
    assert written[-1] == SPECIAL_IDS["<|end|>"]
    while True:  # the template stamps today's date
        day = datetime.now().strftime(DATE_FORMAT)
        ours = render_chat(tokenizer, messages, harmony=True, continue_final_message=True)
        before = render_with_harmony(messages[:1], conversation_start_date=day, encoding=encoding)
        if datetime.now().strftime(DATE_FORMAT) == day:
            break
    assert ours == before + written[2:-1]


@pytest.mark.parametrize(
    "last",
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
    ],
    ids=["user", "nothing-to-continue", "tool-call"],
)
def test_continue_final_message_needs_an_assistant_message_to_continue(
    tokenizer: PreTrainedTokenizerFast, last: dict[str, Any]
) -> None:
    from brisk.harmony.chat import render_chat

    with pytest.raises(ValueError, match="continue"):
        render_chat(tokenizer, [{"role": "user", "content": "Q"}, last], harmony=True, continue_final_message=True)


def test_continue_final_message_with_a_tokenizers_template(tmp_path: Path) -> None:
    """Other models: the tokenizer's template renders the conversation with the last message left open (no end
    of turn, no generation prompt), as transformers' continue_final_message does."""
    from brisk.harmony.chat import render_chat

    tokenizer = make_tiny_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]
    whole = tokenizer.decode(render_chat(tokenizer, messages, harmony=False, add_generation_prompt=False))
    opened = tokenizer.decode(render_chat(tokenizer, messages, harmony=False, continue_final_message=True))
    assert opened.endswith("Once upon") and whole.startswith(opened) and len(whole) > len(opened)


@pytest.mark.parametrize("harmony", [True, False], ids=["harmony", "template"])
def test_a_requests_reasoning_effort_comes_before_the_template_kwargs(
    tokenizer: PreTrainedTokenizerFast, harmony: bool
) -> None:
    """The request's reasoning_effort, then the template kwargs' (a request's chat_template_kwargs over the
    server's defaults), then medium; given both, the prompt is rendered (it was an error on harmony models)."""
    from brisk.harmony.chat import render_chat

    messages = [{"role": "user", "content": "Hi"}]

    def prompt(effort: str | None, kwargs: dict[str, Any]) -> str:
        ids = render_chat(tokenizer, messages, harmony=harmony, reasoning_effort=effort, template_kwargs=kwargs)
        return tokenizer.decode(ids)

    assert "Reasoning: high" in prompt("high", {"reasoning_effort": "low"})
    assert "Reasoning: low" in prompt(None, {"reasoning_effort": "low"})
    assert "Reasoning: medium" in prompt(None, {})


# Output parsing ---------------------------------------------------------------------------------------------------


def new_parser(tokenizer: PreTrainedTokenizerFast) -> HarmonyParser:
    return HarmonyParser.from_tokenizer(tokenizer, tool_call_ids=make_tool_call_id_factory(seed=0))


def chunks(token_ids: Sequence[int], cuts: Sequence[int]) -> Iterator[list[int]]:
    bounds = [0, *sorted(cut % (len(token_ids) + 1) for cut in cuts), len(token_ids)]
    for start, end in zip(bounds, bounds[1:]):
        yield list(token_ids[start:end])


def stream(parser: HarmonyParser, token_ids: Sequence[int], cuts: Sequence[int]) -> tuple[HarmonyResult, dict]:
    """Feed `token_ids` in the chunks `cuts` makes; the result and all deltas joined (checking their shape)."""
    deltas: list[HarmonyDelta] = [parser.feed(chunk) for chunk in chunks(token_ids, cuts)]
    result = parser.finish()
    deltas.append(result.last_delta)
    joined: dict[str, Any] = {"reasoning_content": "", "content": "", "tool_calls": []}
    for delta in deltas:
        joined["reasoning_content"] += delta.reasoning_content
        joined["content"] += delta.content
        for fragment in delta.tool_calls:
            if fragment.index == len(joined["tool_calls"]):  # a new call: its first delta names it
                assert fragment.id is not None and fragment.name is not None
                joined["tool_calls"].append({"id": fragment.id, "name": fragment.name, "arguments": ""})
            else:
                assert fragment.id is None and fragment.name is None
            joined["tool_calls"][fragment.index]["arguments"] += fragment.arguments
    return result, joined


def as_dict(result: HarmonyResult) -> dict[str, Any]:
    return {
        "reasoning_content": result.reasoning_content,
        "content": result.content,
        "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in result.tool_calls],
    }


def parse(tokenizer: PreTrainedTokenizerFast, text: str) -> HarmonyResult:
    """Parse hand-written harmony output, checking that one-token-at-a-time streaming agrees."""
    token_ids = harmony_ids(tokenizer, text)
    result = new_parser(tokenizer).parse(token_ids)
    _, joined = stream(new_parser(tokenizer), token_ids, cuts=range(len(token_ids)))
    assert joined == as_dict(result)
    return result


REASONING_AND_FINAL = (
    "<|channel|>analysis<|message|>The user greets in Chinese 你好; answer with an emoji 👨‍👩‍👧.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! 😀 Straße.<|return|>"
)
TOOL_CALL_CONSTRAIN = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}'
    "<|call|>"
)
TOOL_CALL_ROLE_RECIPIENT = (
    "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"location": "東京"}<|call|>'
)
FIRST_MESSAGE_ROLE_RECIPIENT = " to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
PREAMBLE_AND_TOOL_CALL = (
    "<|channel|>commentary<|message|>Let me check that.<|end|>"
    "<|start|>assistant to=functions.get_time<|channel|>commentary<|message|>{}<|call|>"
)
WELL_FORMED = [REASONING_AND_FINAL, TOOL_CALL_CONSTRAIN, TOOL_CALL_ROLE_RECIPIENT, PREAMBLE_AND_TOOL_CALL]
MALFORMED = [
    "Plain text without any header 😀.",
    "<|channel|>analysis<|message|>Cut off in the mid",
    "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>fin",
    "<|channel|>final and no message token follows<|return|>",
    "<|channel|>banter<|message|>unknown channel<|end|>",
    "<|channel|>analysis<|message|>a<|end|>b<|channel|>final<|message|>c<|return|>d",
    "<|message|><|message|>x<|constrain|>y<|start|><|end|><|call|>",
    '<|channel|>commentary to=functions.f<|message|>{"cut": ',
]


def test_reasoning_then_final(tokenizer: PreTrainedTokenizerFast) -> None:
    result = parse(tokenizer, REASONING_AND_FINAL)
    assert result.reasoning_content == "The user greets in Chinese 你好; answer with an emoji 👨‍👩‍👧."
    assert result.content == "Hello! 😀 Straße."
    assert result.tool_calls == [] and result.warnings == []


@pytest.mark.parametrize(
    ("text", "reasoning", "name", "arguments"),
    [
        (TOOL_CALL_CONSTRAIN, "Need the weather.", "get_weather", '{"location":"Paris"}'),
        (TOOL_CALL_ROLE_RECIPIENT, "Call it.", "get_weather", '{"location": "東京"}'),
        (FIRST_MESSAGE_ROLE_RECIPIENT, "", "get_time", "{}"),
    ],
    ids=["recipient-in-channel-constrain-json", "recipient-in-role-header", "first-message-role-recipient"],
)
def test_tool_call(tokenizer: PreTrainedTokenizerFast, text: str, reasoning: str, name: str, arguments: str) -> None:
    result = parse(tokenizer, text)
    assert (result.reasoning_content, result.content) == (reasoning, "")
    assert [(call.name, call.arguments) for call in result.tool_calls] == [(name, arguments)]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", result.tool_calls[0].id)
    assert result.warnings == []


def test_preamble_is_content(tokenizer: PreTrainedTokenizerFast) -> None:
    result = parse(tokenizer, PREAMBLE_AND_TOOL_CALL)
    assert result.content == "Let me check that."
    assert [call.name for call in result.tool_calls] == ["get_time"]


def test_tool_call_ids_are_unique_and_reproducible(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = harmony_ids(tokenizer, TOOL_CALL_CONSTRAIN)
    assert new_parser(tokenizer).parse(ids).tool_calls == new_parser(tokenizer).parse(ids).tool_calls
    random_ids = {HarmonyParser.from_tokenizer(tokenizer).parse(ids).tool_calls[0].id for _ in range(20)}
    assert len(random_ids) == 20


@pytest.mark.parametrize(
    ("text", "expected", "warning"),
    [
        ("Hello there, no harmony here.", ("", "Hello there, no harmony here."), "without a harmony header"),
        ("<|channel|>analysis<|message|>Cut off mid-sent", ("Cut off mid-sent", ""), "ended inside a message"),
        ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fi", ("x", ""), "inside a message header"),
        ("<|channel|>final Oops, no message token<|return|>", ("", " Oops, no message token"), "without <|message|>"),
        ("<|channel|>banter<|message|>odd<|end|>", ("", "odd"), "unknown channel 'banter'"),
        ("<|channel|>final<|message|>a<|end|>b<|return|>", ("", "ab"), "without <|start|>"),
        ("<|channel|>analysis<|message|>a<|channel|>final<|message|>b<|return|>", ("a", "b"), "not ended"),
        ("<|channel|>final<|message|>a<|constrain|>b<|return|>", ("", "ab"), "stray"),
        ("<|channel|>final<|message|>a<|return|>trailing", ("", "a"), "after <|return|>"),
        ("<|channel|>analysis to=python<|message|>print(1)<|call|>", ("print(1)", ""), "recipient 'python'"),
    ],
)
def test_malformed_output_degrades_with_a_warning(
    tokenizer: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture, text: str, expected: tuple, warning: str
) -> None:
    with caplog.at_level(logging.DEBUG, logger="brisk.harmony.parser"):
        result = parse(tokenizer, text)
    assert (result.reasoning_content, result.content) == expected
    assert any(warning in message for message in result.warnings), result.warnings
    # An output cut short (max_tokens does that to every length-limited answer) is logged at debug level only.
    level = logging.DEBUG if "inside a message" in warning else logging.WARNING
    assert {r.levelno for r in caplog.records if warning in r.getMessage()} == {level}  # parsed whole and streamed


def test_truncated_tool_call_keeps_its_arguments(tokenizer: PreTrainedTokenizerFast) -> None:
    result = parse(tokenizer, '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"cut": ')
    assert [(call.name, call.arguments) for call in result.tool_calls] == [("f", '{"cut": ')]
    assert any("not JSON" in warning for warning in result.warnings)


def test_multi_byte_characters_are_never_split(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = harmony_ids(tokenizer, "<|channel|>final<|message|>👨‍👩‍👧🦜<|return|>")
    parser = new_parser(tokenizer)
    deltas = [parser.feed([token]).content for token in token_ids]
    assert len(token_ids) > 6 and "".join(deltas) == "👨‍👩‍👧🦜"
    assert all("\ufffd" not in delta for delta in deltas)


def test_parser_agrees_with_openai_harmony(tokenizer: PreTrainedTokenizerFast, encoding: Any) -> None:
    from openai_harmony import Role

    for text in WELL_FORMED:
        token_ids = harmony_ids(tokenizer, text)
        messages = encoding.parse_messages_from_completion_tokens(token_ids, Role.ASSISTANT)
        expected = {"reasoning_content": "", "content": "", "tool_calls": []}
        for message in messages:
            body = "".join(content.text for content in message.content)
            if message.recipient:
                expected["tool_calls"].append((message.recipient.removeprefix("functions."), body))
            elif message.channel == "analysis":
                expected["reasoning_content"] += body
            else:
                expected["content"] += body
        result = new_parser(tokenizer).parse(token_ids)
        calls = [(call.name, call.arguments) for call in result.tool_calls]
        assert {**as_dict(result), "tool_calls": calls} == expected


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.sampled_from(WELL_FORMED + MALFORMED), cuts=st.lists(st.integers(0, 1000), max_size=12))
def test_streaming_equals_non_streaming(tokenizer: PreTrainedTokenizerFast, text: str, cuts: list[int]) -> None:
    token_ids = harmony_ids(tokenizer, text)
    expected = new_parser(tokenizer).parse(token_ids)
    result, joined = stream(new_parser(tokenizer), token_ids, cuts)
    assert joined == as_dict(result) == as_dict(expected)
    assert result.warnings == expected.warnings


# Pieces of harmony output to shuffle into malformed sequences, and any token at all.
FRAGMENTS = [
    *SPECIAL_IDS,
    "assistant",
    "analysis",
    "final",
    "commentary",
    " to=functions.get_weather",
    " to=python",
    " json",
    " ",
    "Hello world",
    "👨‍👩‍👧",
    '{"a": 1}',
]
GARBAGE = st.lists(
    st.one_of(
        st.sampled_from(FRAGMENTS),
        st.sampled_from([199998, 199999, 200018, 200020, VOCAB_SIZE - 1]),  # other special tokens
        st.integers(0, VOCAB_SIZE - 1),
    ),
    max_size=30,
)


def garbage_ids(tokenizer: PreTrainedTokenizerFast, pieces: list[str | int]) -> list[int]:
    token_ids: list[int] = []
    for piece in pieces:
        token_ids.extend([piece] if isinstance(piece, int) else harmony_ids(tokenizer, piece))
    return token_ids


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=GARBAGE, cuts=st.lists(st.integers(0, 1000), max_size=8))
def test_garbage_never_raises_and_streams_consistently(
    tokenizer: PreTrainedTokenizerFast, pieces: list[str | int], cuts: list[int]
) -> None:
    token_ids = garbage_ids(tokenizer, pieces)
    expected = new_parser(tokenizer).parse(token_ids)
    result, joined = stream(new_parser(tokenizer), token_ids, cuts)
    assert joined == as_dict(result) == as_dict(expected)
    assert result.warnings == expected.warnings
    assert "<|" not in result.content + result.reasoning_content  # no special token leaks into text


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=GARBAGE, cuts=st.lists(st.integers(0, 1000), max_size=8))
def test_bodies_decoded_by_bytes_give_the_window_decode(
    tokenizer: PreTrainedTokenizerFast, pieces: list[str | int], cuts: list[int]
) -> None:
    # o200k is byte-level: message bodies go through TokenBytes and one UTF-8 decoder; the window algorithm (any
    # other tokenizer's path) must give the same reasoning, content, tool calls and warnings, stream and whole.
    token_ids = garbage_ids(tokenizer, pieces)
    by_bytes = new_parser(tokenizer)
    assert by_bytes._token_bytes is not None
    decoder = TokenDecoder(tokenizer, skip_special_tokens=True)
    by_window = HarmonyParser(
        HarmonySpecialTokens.from_tokenizer(tokenizer),
        lambda ids: decoder.decode(list(ids)),
        tool_call_ids=make_tool_call_id_factory(seed=0),
    )
    result, joined = stream(by_bytes, token_ids, cuts)
    expected, expected_joined = stream(by_window, token_ids, cuts)
    assert as_dict(result) == as_dict(expected) and joined == expected_joined
    assert result.warnings == expected.warnings


def test_parser_works_with_any_tokenizer_with_harmony_tokens(tmp_path: Path) -> None:
    tiny = make_tiny_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="lacks harmony's special tokens"):
        HarmonyParser.from_tokenizer(tiny)
    tiny.add_special_tokens({"additional_special_tokens": list(SPECIAL_IDS)})
    special = HarmonySpecialTokens.from_tokenizer(tiny)
    assert special.start != SPECIAL_IDS["<|start|>"] and special.stop_token_ids == (special.return_, special.call)
    token_ids = tiny.encode(
        "<|channel|>analysis<|message|>Café ∑<|end|><|start|>assistant<|channel|>commentary to=functions.f json"
        '<|message|>{"a": 1}<|call|>',
        add_special_tokens=False,
    )
    result = HarmonyParser.from_tokenizer(tiny).parse(token_ids)
    assert result.reasoning_content == "Café ∑"
    assert [(call.name, json.loads(call.arguments)) for call in result.tool_calls] == [("f", {"a": 1})]


def test_special_tokens_of_the_gpt_oss_tokenizer(tokenizer: PreTrainedTokenizerFast) -> None:
    special = HarmonySpecialTokens.from_tokenizer(tokenizer)
    assert special == HarmonySpecialTokens(
        start=200006, end=200007, message=200008, channel=200005, constrain=200003, return_=200002, call=200012
    )
