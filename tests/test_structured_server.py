"""The structured-output request surface through `brisk serve` and the offline LLM (issue 18): every form is
parsed, compiled at validation (bad input: a 400 naming the problem), then generated under its grammar."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import brisk
from brisk.sampling_params import InvalidRequest, SamplingParams
from brisk.structured import StrictTool, StructuredOutputs
from tests.server_utils import RunningServer

DEMO_MODEL = Path(brisk.__file__).parent / "demo_model"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
COMPLETIONS = ("/v1/completions", {"prompt": "Hi", "max_tokens": 4})
RESPONSES = ("/v1/responses", {"input": "Hi", "max_output_tokens": 4})

VALID = [
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
        "response_format",
    ),
    (CHAT, {"structured_outputs": {"json": SCHEMA}}, "structured_outputs"),
    (CHAT, {"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    (CHAT, {"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs"),
    (CHAT, {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, "structured_outputs"),
    (COMPLETIONS, {"structured_outputs": {"json_object": True}}, "structured_outputs"),
    (CHAT, {"guided_json": SCHEMA}, "guided_json"),  # vLLM <= 0.11's fields
    (RESPONSES, {"text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}}}, "text.format"),
    (RESPONSES, {"text": {"format": {"type": "json_object"}}}, "text.format"),
]
# Strict function tools alone (clients such as openai-agents mark every function tool strict).
STRICT_TOOLS = [
    (
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": SCHEMA}}]},
    ),
    (RESPONSES, {"tools": [{"type": "function", "name": "get_weather", "strict": True, "parameters": SCHEMA}]}),
]
INVALID = [
    (CHAT, {"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "parenthesis is not closed"),
    (CHAT, {"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs", 'Rule "foo" is not defined'),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "objec"}}}},
        "response_format",
        'Unsupported type "objec"',
    ),
    (
        RESPONSES,
        {"text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "array", "uniqueItems": True}}}},
        "text.format",
        "'uniqueItems'",
    ),
    (CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "regex and choice"),
    (
        CHAT,
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "not both",
    ),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    (CHAT, {"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "one kind of structured output"),
    # the regex above, compiled once (cached): this request's error still names its own field
    (COMPLETIONS, {"guided_regex": "(ab"}, "guided_regex", "parenthesis is not closed"),
    (CHAT, {"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "cannot be combined"),
    (RESPONSES, {"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format", "needs name"),
    (
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "objec"}}}]},
        "tools",
        'Unsupported type "objec"',
    ),
]


@pytest.fixture(scope="module")
def server():
    srv = RunningServer(str(DEMO_MODEL), "--served-model-name", "brisk-demo", "--max_batch_size", "4")
    yield srv
    srv.stop()


def post(server, endpoint: tuple[str, dict], extra: dict) -> httpx.Response:
    path, base = endpoint
    return httpx.post(f"{server.url}{path}", json={**base, **extra}, timeout=120)


@pytest.mark.parametrize(("endpoint", "extra", "param"), VALID)
def test_valid_structured_request_generates(server, endpoint, extra, param):
    r = post(server, endpoint, extra)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("endpoint", "extra"), STRICT_TOOLS)
def test_strict_tools_are_accepted(server, endpoint, extra):
    r = post(server, endpoint, extra)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("endpoint", "extra", "param", "message"), INVALID)
def test_invalid_structured_request_names_the_problem(server, endpoint, extra, param, message):
    r = post(server, endpoint, extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"], error
    assert (error["param"] or "").startswith(param.split(".")[0]), error


def test_plain_text_formats_still_generate(server):
    assert post(server, CHAT, {"response_format": {"type": "text"}}).status_code == 200
    assert post(server, RESPONSES, {"text": {"format": {"type": "text"}}}).status_code == 200
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": False, "parameters": SCHEMA}}]
    assert post(server, CHAT, {"tools": tools}).status_code == 200


def test_offline_llm_checks_then_enforces():
    from brisk.llm import LLM

    with LLM(str(DEMO_MODEL), max_batch_size=2) as llm:
        with pytest.raises(InvalidRequest, match="parenthesis"):
            llm.generate("Hi", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputs(regex="(ab")))
        choice = StructuredOutputs(choice=["yes", "no"], from_start=True)
        (out,) = llm.generate("Hi", SamplingParams(max_tokens=8, n=4, seed=0, structured_outputs=choice))
        assert all(o.text in ("yes", "no") and o.finish_reason == "stop" for o in out.outputs), out.outputs
        assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # plain still runs
        strict_tool = StructuredOutputs(tools=(StrictTool("get_weather", SCHEMA),), param="tools")
        params = SamplingParams(max_tokens=2, structured_outputs=strict_tool)
        assert llm.generate("Hi", params)[0].outputs[0].token_ids


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_offered_tools_join_the_spec(choice):
    """On gpt-oss the grammar is the whole turn, so every tool the prompt offers is named in the spec: strict ones
    constrain their arguments, the others may still be called (free_tools); tool_choice none offers none."""
    from brisk.server.protocol import ChatCompletionRequest, ResponsesRequest

    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "strict": True}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    ]
    answer = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    chat = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "Hi"}], tools=tools, tool_choice=choice, response_format=answer
    )
    spec = chat.to_sampling_params({}).structured_outputs
    assert spec is not None and spec.json == SCHEMA
    responses = ResponsesRequest(
        model="m",
        input="Hi",
        tools=[{"type": "function", **tool["function"]} for tool in tools],
        tool_choice=choice,
        text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}},
    )
    assert responses.to_sampling_params({}).structured_outputs.key() == spec.key()  # type: ignore[union-attr]
    if choice == "auto":
        assert spec.tools == (StrictTool("get_weather", SCHEMA),) and spec.free_tools == ("get_time",)
    else:
        assert spec.tools == () and spec.free_tools == ()
    # tools that are not strict and no answer: nothing to constrain
    plain = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], tools=tools[1:])
    assert plain.to_sampling_params({}).structured_outputs is None
