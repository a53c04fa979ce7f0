"""brisk.structured at the matcher level: specs, compiler errors and cache, masks, and harmony (gpt-oss) with the
real o200k_harmony vocabulary: reasoning free, the final answer and strict tool arguments constrained."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from pathlib import Path

import msgspec
import pytest
import torch

from brisk.engine.messages import EngineCoreRequest
from brisk.sampling_params import InvalidRequest, SamplingParams
from brisk.structured import StrictTool, StructuredOutputs
from brisk.structured.compiler import GrammarCompiler
from brisk.structured.matcher import allocate_bitmask, apply_token_bitmask
from tests.harmony_tokenizer import TIKTOKEN_FILE, VOCAB_SIZE, make_gpt_oss_tokenizer

pytestmark = pytest.mark.skipif(not TIKTOKEN_FILE.exists(), reason="needs ../shared/tokenizers/o200k_base.tiktoken")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = StrictTool(
    "get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return make_gpt_oss_tokenizer(tmp_path_factory.mktemp("o200k_harmony"))


@pytest.fixture(scope="module")
def harmony(tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE, harmony=True)
    yield compiler
    compiler.close()


@pytest.fixture(scope="module")
def plain(tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE, harmony=False)
    yield compiler
    compiler.close()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(matcher, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """The token ids the matcher allows next, read through the batch mask application."""
    bitmask = allocate_bitmask(2, vocab_size)
    matcher.fill_bitmask(bitmask, 1)
    logits = torch.zeros(2, vocab_size)
    apply_token_bitmask(logits, bitmask, [1])
    assert torch.all(logits[0] == 0)  # rows not named are untouched
    return torch.isfinite(logits[1]).nonzero().flatten()


def test_spec_shape_errors():
    with pytest.raises(InvalidRequest, match="json and regex"):
        StructuredOutputs(json=SCHEMA, regex="a+")
    with pytest.raises(InvalidRequest, match="need one of"):
        StructuredOutputs()
    with pytest.raises(InvalidRequest, match="choice"):
        StructuredOutputs(choice=[])
    assert StructuredOutputs(json=SCHEMA).key() == StructuredOutputs(json=dict(reversed(SCHEMA.items()))).key()
    assert StructuredOutputs(json=SCHEMA).key() != StructuredOutputs(json_object=True).key()
    # SamplingParams carries it and it survives the engine's msgspec boundary
    params = SamplingParams(structured_outputs=StructuredOutputs(json=SCHEMA, tools=(WEATHER,), param="tools"))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(EngineCoreRequest("r", [1], params)), type=EngineCoreRequest)
    assert wire.params.structured_outputs == params.structured_outputs
    assert wire.params.structured_outputs.key() == params.structured_outputs.key()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs(json={"type": "objec"}), "Unsupported type"),
        (StructuredOutputs(json="{not json"), "not valid JSON"),
        (StructuredOutputs(regex="(ab"), "parenthesis"),
        (StructuredOutputs(grammar="root ::= foo"), 'Rule "foo" is not defined'),
        (StructuredOutputs(json={"type": "array", "uniqueItems": True}), "'uniqueItems' at #"),
        (StructuredOutputs(json={"type": "object", "properties": {"a": {"not": {}}}}), "'not' at #/properties/a"),
        (StructuredOutputs(json={"allOf": [{"type": "integer"}, {"minimum": 3}]}), "'allOf'"),
    ],
)
def test_invalid_specs_name_the_problem(plain, spec, message):
    with pytest.raises(InvalidRequest) as error:
        plain.compile(spec)
    assert message in error.value.message
    assert "/project/" not in error.value.message  # the C++ source location is stripped


def test_compile_cache_and_timeout(tokenizer, plain):
    spec = StructuredOutputs(json=SCHEMA)
    first = plain.submit(spec)
    assert isinstance(first, Future) and plain.submit(StructuredOutputs(json=dict(SCHEMA))) is first
    plain.compile(spec)
    slow = GrammarCompiler(tokenizer, VOCAB_SIZE, compile_timeout_s=0.0)
    try:
        with pytest.raises(InvalidRequest, match="longer than 0 s to compile"):
            slow.compile(StructuredOutputs(regex="[a-z]{1,40}@[a-z]{1,40}\\.(com|org)"))
    finally:
        slow.close()


def test_plain_model_whole_output_constrained(tokenizer, plain):
    matcher = plain.matcher(plain.compile(StructuredOutputs(choice=["yes", "no"])))
    first = {tokenizer.decode([t]) for t in allowed(matcher).tolist()}
    assert first and all("yes".startswith(s) or "no".startswith(s) for s in first)
    assert matcher.accept_tokens(ids(tokenizer, "yes")) == len(ids(tokenizer, "yes"))
    assert matcher.accept_token(200002) and matcher.is_terminated()  # <|return|> is a stop token

    matcher = plain.matcher(plain.compile(StructuredOutputs(regex="[0-9]{3}")))
    assert not matcher.accept_token(ids(tokenizer, "a")[0])
    assert matcher.accept_tokens(ids(tokenizer, "123")) == len(ids(tokenizer, "123"))
    assert allowed(matcher).tolist() == [200002]  # only a stop token after a complete match


def test_rollback_and_fork(tokenizer, plain):
    matcher = plain.matcher(plain.compile(StructuredOutputs(json=SCHEMA)))
    prefix = ids(tokenizer, '{"city":"Rome","days":')
    assert matcher.accept_tokens(prefix) == len(prefix)
    before = allowed(matcher)
    sibling = matcher.fork()
    assert matcher.accept_tokens(ids(tokenizer, "3}")) == 2
    assert allowed(matcher).tolist() == [200002]
    matcher.rollback(2)
    assert torch.equal(allowed(matcher), before) and torch.equal(allowed(sibling), before)


def test_batch_mask_rows(tokenizer, plain):
    digits = plain.matcher(plain.compile(StructuredOutputs(regex="[0-9]+")))
    letters = plain.matcher(plain.compile(StructuredOutputs(regex="[a-z]+")))
    bitmask = allocate_bitmask(3, VOCAB_SIZE)
    digits.fill_bitmask(bitmask, 0)
    letters.fill_bitmask(bitmask, 2)
    logits = torch.randn(3, VOCAB_SIZE)
    free = logits[1].clone()
    apply_token_bitmask(logits, bitmask, [0, 2])
    assert torch.equal(logits[1], free)  # an unconstrained row in the same batch is untouched
    for row, pattern in ((0, r"[0-9]+"), (2, r"[a-z]+")):
        top = int(logits[row].argmax())
        assert re.fullmatch(pattern, tokenizer.decode([top]))


def harmony_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)  # the saved tokenizer splits specials to their ids


RETURN, CALL, END = 200002, 200012, 200007
CHANNEL, MESSAGE, START, CONSTRAIN = 200005, 200008, 200006, 200003
STRUCTURAL = (RETURN, CALL, END, CHANNEL, MESSAGE, START, CONSTRAIN)
ANALYSIS = "<|channel|>analysis<|message|>The user wants {json-ish: [unbalanced. Think freely.<|end|><|start|>assistant"
ANSWER = json.dumps({"city": "Rome", "days": 3}, separators=(",", ":"))  # compact, as constrained JSON is


def accepts_whole(tokenizer, compiler, spec, text: str, prompt: list[int] | None = None) -> bool:
    """Whether the turn `text` is accepted token by token and ends the grammar."""
    matcher = compiler.matcher(compiler.compile(spec), spec, prompt)
    tokens = harmony_ids(tokenizer, text)
    return matcher.accept_tokens(tokens) == len(tokens) and matcher.is_terminated()


def test_harmony_turn_reasoning_free_final_constrained(tokenizer, harmony):
    """The turn's structure is constrained from its first token: a channel header, reasoning free of special
    tokens until <|end|>, the next message's <|start|>assistant, then the final answer and <|return|>."""
    matcher = harmony.matcher(harmony.compile(StructuredOutputs(json=SCHEMA)))
    assert allowed(matcher).tolist() == [CHANNEL]  # no free text before a header (no tools: no recipient form)
    header = harmony_ids(tokenizer, "<|channel|>analysis<|message|>")
    assert matcher.accept_tokens(header) == len(header)
    body = set(allowed(matcher).tolist())
    assert len(body) > 199_000 and END in body  # reasoning is any text...
    assert not body & (set(STRUCTURAL) - {END}) and not {t for t in body if t >= 199_998} - {END}  # ...no specials
    for special in set(STRUCTURAL) - {END}:
        probe = matcher.fork()
        assert not probe.accept_token(special), special  # e.g. <|return|> before any final channel
    reasoning = harmony_ids(tokenizer, ANALYSIS[len("<|channel|>analysis<|message|>") :])
    assert matcher.accept_tokens(reasoning) == len(reasoning)
    assert allowed(matcher).tolist() == [CHANNEL]
    final = harmony_ids(tokenizer, "<|channel|>final<|message|>")
    assert matcher.accept_tokens(final) == len(final)
    first = [tokenizer.decode([t]) for t in allowed(matcher).tolist()]
    assert first and all(text.lstrip().startswith("{") for text in first)  # invalid tokens masked
    answer = harmony_ids(tokenizer, ANSWER)
    assert matcher.accept_tokens(answer) == len(answer)
    assert allowed(matcher).tolist() == [RETURN]  # nothing after the JSON but <|return|> (not <|call|>, <|end|>)
    assert matcher.accept_token(RETURN) and matcher.is_terminated()


def test_harmony_json_violations_masked(tokenizer, harmony):
    matcher = harmony.matcher(harmony.compile(StructuredOutputs(json=SCHEMA)))
    matcher.accept_tokens(harmony_ids(tokenizer, "<|channel|>final<|message|>"))
    prefix = harmony_ids(tokenizer, '{"city":"Rome","days":')
    assert matcher.accept_tokens(prefix) == len(prefix)
    for bad in ("0", '"3"', "-1", "true"):
        assert not matcher.accept_token(harmony_ids(tokenizer, bad)[0]), bad
    extra = harmony_ids(tokenizer, '7,"extra":1}')
    assert matcher.accept_tokens(extra) == 1  # additionalProperties: false refuses the comma's key
    # harmony's special tokens are no text: not even inside a JSON string (the parser would read them as structure)
    string = harmony.matcher(harmony.compile(StructuredOutputs(json=SCHEMA)))
    string.accept_tokens(harmony_ids(tokenizer, '<|channel|>final<|message|>{"city":"R'))
    assert not any(string.fork().accept_token(special) for special in STRUCTURAL)
    assert all(t < 199_998 for t in allowed(string).tolist())


@pytest.mark.parametrize(
    "turn",
    [
        "<|channel|>fin<|message|>" + ANSWER + "<|return|>",  # a channel harmony does not have
        "<|channel|>analysis<|end|>",  # a header without <|message|>
        "<|channel|>analysis<|message|>thinking<|return|>",  # the turn ended before any final channel
        "<|return|>",
        "<|channel|>final " + ANSWER + "<|return|>",
        "<|channel|>final<|message|>" + ANSWER + "<|end|>",  # the answer ends the turn
        "<|channel|>final<|message|>" + ANSWER + "<|call|>",
        "<|channel|>commentary<|message|>Let me answer.<|end|><|start|>assistant<|channel|>final<|message|>"
        + ANSWER
        + "<|return|>",  # a preamble would be content before the JSON
        "<|channel|>analysis<|message|>a<|end|><|channel|>final<|message|>" + ANSWER + "<|return|>",  # no <|start|>
        "<|channel|>analysis<|message|>a<|end|><|start|>user<|message|>hi<|end|>",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>",  # no tools offered
        "Sure! " + ANSWER,
    ],
)
def test_harmony_malformed_turns_refused(tokenizer, harmony, turn):
    assert not accepts_whole(tokenizer, harmony, StructuredOutputs(json=SCHEMA), turn)


@pytest.mark.parametrize(
    "turn",
    [
        "<|channel|>final<|message|>" + ANSWER + "<|return|>",
        ANALYSIS + "<|channel|>final<|message|>" + ANSWER + "<|return|>",
        ANALYSIS + ANALYSIS + "<|channel|>final<|message|>" + ANSWER + "<|return|>",
        "<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>final<|message|>" + ANSWER + "<|return|>",
    ],
)
def test_harmony_well_formed_turns_accepted(tokenizer, harmony, turn):
    assert accepts_whole(tokenizer, harmony, StructuredOutputs(json=SCHEMA), turn)


def test_harmony_strict_tool_arguments(tokenizer, harmony):
    spec = StructuredOutputs(tools=(WEATHER,), free_tools=("other",))
    for header in (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
        "<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>",
        "<|channel|>commentary to=functions.get_weather json<|message|>",
        " to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>",
        " to=functions.get_weather<|channel|>commentary json<|message|>",
    ):
        matcher = harmony.matcher(harmony.compile(spec))
        tokens = harmony_ids(tokenizer, ANALYSIS + header)
        assert matcher.accept_tokens(tokens) == len(tokens), header
        assert not matcher.accept_token(harmony_ids(tokenizer, "city")[0])
        arguments = harmony_ids(tokenizer, '{"city":"Oslo"}')
        assert matcher.accept_tokens(arguments) == len(arguments)
        assert allowed(matcher).tolist() == [CALL]  # a call ends with <|call|>
        assert matcher.accept_token(CALL) and matcher.is_terminated()
    # the header must go on to the content type once the strict tool is named
    matcher = harmony.matcher(harmony.compile(spec))
    tokens = harmony_ids(tokenizer, "<|channel|>commentary to=functions.get_weather ")
    assert matcher.accept_tokens(tokens) == len(tokens)
    assert not matcher.accept_token(MESSAGE)
    # the other (not strict) tool's call is free text; a tool the request does not offer is refused
    assert accepts_whole(
        tokenizer, harmony, spec, "<|channel|>commentary to=functions.other <|constrain|>json<|message|>x{<|call|>"
    )
    assert not accepts_whole(
        tokenizer, harmony, spec, "<|channel|>commentary to=functions.nope json<|message|>{}<|call|>"
    )
    # only tools constrained: the final answer is free text, and a preamble (routed to content) is allowed
    assert accepts_whole(
        tokenizer,
        harmony,
        spec,
        ANALYSIS + "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>"
        "It is sunny, {no json}.<|return|>",
    )


def test_harmony_response_format_and_tools_together(tokenizer, harmony):
    spec = StructuredOutputs(json=SCHEMA, tools=(WEATHER,))
    assert accepts_whole(tokenizer, harmony, spec, "<|channel|>final<|message|>" + ANSWER + "<|return|>")
    call = harmony.matcher(harmony.compile(spec))
    tokens = harmony_ids(tokenizer, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>")
    assert call.accept_tokens(tokens) == len(tokens)
    wrong = harmony_ids(tokenizer, '{"days":2}')  # the answer's schema, not the tool's
    assert call.accept_tokens(wrong) < len(wrong)


def test_harmony_turn_taken_up_where_the_prompt_leaves_it(tokenizer, harmony):
    """The grammar is the assistant's turn from `<|start|>assistant`: a prompt that already opened a message (as a
    raw completions prompt may) is accepted first; one the grammar cannot continue is refused."""
    spec = StructuredOutputs(json=SCHEMA)
    chat = harmony_ids(tokenizer, "<|start|>user<|message|>Weather?<|end|><|start|>assistant")
    rest = "<|channel|>final<|message|>" + ANSWER + "<|return|>"
    assert accepts_whole(tokenizer, harmony, spec, rest, chat)
    opened = chat + harmony_ids(tokenizer, "<|channel|>analysis<|message|>Hmm")
    assert accepts_whole(tokenizer, harmony, spec, " ok<|end|><|start|>assistant" + rest, opened)
    assert not accepts_whole(tokenizer, harmony, spec, rest, opened)  # inside the reasoning body: no header now
    for bad in ("<|channel|>bogus<|message|>", "<|channel|>analysis<|message|>x<|return|>"):
        with pytest.raises(InvalidRequest, match="cannot continue"):
            harmony.matcher(harmony.compile(spec), spec, chat + harmony_ids(tokenizer, bad))
    # a forced tool call (from_start): the prompt ends with the call's header; the arguments, then <|call|> only
    forced = StructuredOutputs(json=WEATHER.parameters, from_start=True)
    header = harmony_ids(tokenizer, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>")
    matcher = harmony.matcher(harmony.compile(forced), forced, chat + header)
    arguments = harmony_ids(tokenizer, '{"city":"Oslo"}')
    assert matcher.accept_tokens(arguments) == len(arguments)
    assert allowed(matcher).tolist() == [CALL]


def test_strict_tools_need_harmony(plain):
    with pytest.raises(InvalidRequest, match="harmony"):
        plain.compile(StructuredOutputs(tools=(WEATHER,)))


def test_real_vocab_size_covers_reserved_ids(harmony):
    assert harmony.tokenizer_info.vocab_size == VOCAB_SIZE
    assert Path(TIKTOKEN_FILE).exists()
