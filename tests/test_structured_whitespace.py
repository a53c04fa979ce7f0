"""Structured outputs' JSON is compact by default (separators `,` and `:`, no whitespace outside strings), so a model
cannot spend its max_tokens on whitespace; vLLM's disable_any_whitespace: false (server option or per request)
allows whitespace back, at most grammar_max_json_whitespace characters a run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from brisk import LLM, SamplingParams
from brisk.sampling_params import InvalidRequest
from brisk.server.protocol import ChatCompletionRequest
from brisk.structured import StrictTool, StructuredOutputs
from brisk.structured.compiler import GrammarCompiler

DEMO = str(Path(__file__).resolve().parents[1] / "brisk" / "demo_model")
SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["yes", "no", "perchance"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "names": {"type": "array", "items": {"enum": ["Romeo", "Juliet"]}, "maxItems": 2},
    },
    "required": ["verdict", "count", "names"],
}
COMPACT = '{"verdict":"yes","count":3,"names":["Romeo"]}'
SPACED = '{ "verdict": "yes", "count": 3, "names": ["Romeo"] }'


@pytest.fixture(scope="module")
def compiler():
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), max_json_whitespace=4)
    yield compiler
    compiler.close()


def accepts(compiler: GrammarCompiler, spec: StructuredOutputs, text: str) -> bool:
    return xgr.GrammarMatcher(compiler.compile(spec)).accept_string(text)


def test_compact_by_default_whitespace_on_request(compiler):
    default, compact = StructuredOutputs(json=SCHEMA), StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    spaced = StructuredOutputs(json=SCHEMA, disable_any_whitespace=False)
    for spec in (default, compact):
        assert accepts(compiler, spec, COMPACT)
        assert not accepts(compiler, spec, SPACED)
        assert not accepts(compiler, spec, '{"verdict": "yes","count":3,"names":["Romeo"]}')  # not even one space
        assert accepts(compiler, spec, '{"verdict":"yes","count":3,"names":[]}')
        assert not accepts(compiler, spec, '{"verdict":"maybe","count":3,"names":[]}')  # still the schema
    assert accepts(compiler, spaced, SPACED) and accepts(compiler, spaced, COMPACT)
    assert spaced.key() != default.key()  # cached apart
    json_object = StructuredOutputs(json_object=True)
    assert accepts(compiler, json_object, '{"a":[1,2,{"b":null}],"c":{}}')
    for spaced_somewhere in ('{"a": [1,2]}', '{"a":[1, 2]}', '{"a":[1],"c":{"d":1, "e":2}}', '{"a":1 }'):
        assert not accepts(compiler, json_object, spaced_somewhere)
    # whitespace inside strings is the string's own
    assert accepts(compiler, StructuredOutputs(json={"type": "object"}), '{"a":"x  y"}')


def test_whitespace_allowed_is_bounded(compiler):
    spaced = StructuredOutputs(json=SCHEMA, disable_any_whitespace=False)
    assert accepts(compiler, spaced, '{"verdict":    "yes","count":3,"names":[]}')  # 4: grammar_max_json_whitespace
    assert not accepts(compiler, spaced, '{"verdict":     "yes","count":3,"names":[]}')  # 5


def test_compact_schema_errors_are_400s(compiler):
    with pytest.raises(InvalidRequest, match="invalid structured_outputs"):
        compiler.compile(StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}))


def test_request_field_beside_response_format():
    """vLLM's per-request switch: structured_outputs holding only disable_any_whitespace, beside response_format."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}},
    }
    spec = ChatCompletionRequest(**body).to_sampling_params({}).structured_outputs
    assert spec is not None and spec.disable_any_whitespace is None  # the server's setting decides
    spaced = {**body, "structured_outputs": {"disable_any_whitespace": False}}
    spec = ChatCompletionRequest(**spaced).to_sampling_params({}).structured_outputs
    assert spec is not None and spec.json == SCHEMA and spec.disable_any_whitespace is False
    tools = {**spaced, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}]}
    spec = ChatCompletionRequest(**tools).to_sampling_params({}).structured_outputs
    assert spec is not None and spec.tools and spec.disable_any_whitespace is False
    both = {**body, "structured_outputs": {"regex": "a+"}}
    with pytest.raises(InvalidRequest, match="not both"):
        ChatCompletionRequest(**both).to_sampling_params({})
    alone = {"messages": body["messages"], "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}}
    spec = ChatCompletionRequest(**alone).to_sampling_params({}).structured_outputs
    assert spec is not None and spec.disable_any_whitespace is False


def _final_channel_prompt(llm: LLM) -> list[int]:
    """A chat prompt that opens the final channel: the output is the answer alone."""
    prompt = llm.render_chat([{"role": "user", "content": "Shall I compare thee to a summer's day?"}])
    return prompt + llm.tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False)


# More than the longest compact instance of SCHEMA has characters (61), so more than it can have tokens.
MAX_TOKENS = 64
OUTSIDE_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')


def _samples(llm: LLM, spec: StructuredOutputs, n: int = 36) -> list[tuple[str, str]]:
    prompt = {"prompt_token_ids": _final_channel_prompt(llm)}
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i, structured_outputs=spec) for i in range(n)]
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate([prompt] * n, params)]


def test_hot_sampling_never_runs_out_of_tokens_on_whitespace():
    """The bundled model at temperature 1 (the issue's failure: whitespace until max_tokens, then invalid JSON):
    every answer is compact JSON of the schema that ends well within max_tokens; with whitespace allowed the same
    model does put whitespace between tokens, never more than grammar_max_json_whitespace a run."""
    with LLM(DEMO, max_seq_len=512, device="cpu", grammar_max_json_whitespace=3) as llm:
        compact = _samples(llm, StructuredOutputs(json=SCHEMA))
        spaced = _samples(llm, StructuredOutputs(json=SCHEMA, disable_any_whitespace=False))
    for text, finish in compact:
        assert finish == "stop", text
        assert text == json.dumps(json.loads(text), separators=(",", ":")), text
    gaps = [run for text, _ in spaced for run in re.findall(r"\s+", OUTSIDE_STRINGS.sub('""', text))]
    assert gaps and max(len(g) for g in gaps) <= 3
    for text, finish in spaced:
        if finish == "stop":
            json.loads(text)


def test_strict_tool_arguments_are_compact_too():
    tool = StrictTool("f", {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    harmony = GrammarCompiler(tokenizer, len(tokenizer), harmony=True)
    try:
        turn = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"
        for args, ok in (('{"x":1}', True), ('{"x": 1}', False)):
            matcher = xgr.GrammarMatcher(harmony.compile(StructuredOutputs(tools=(tool,))))
            ids = tokenizer.encode(turn.replace("{}", args), add_special_tokens=False)
            assert all(matcher.accept_token(t) for t in ids) is ok
    finally:
        harmony.close()
