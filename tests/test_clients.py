"""Real client libraries against `brisk serve` of the bundled demo model (issue 17): an openai-agents Agent with a
function tool through the Responses model (two turns, the second via previous_response_id, streamed and not) and
the Chat Completions model (streamed and not); langchain-openai (invoke, stream, bind_tools with tool_choice
"any"); litellm (tool_choice "required", streaming); lm-eval (generate_until, multiple_choice). Skipped with the
reason where the `clients` extra (or litellm's directory) is not installed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

import brisk
from tests.server_utils import RunningServer

agents = pytest.importorskip("agents", reason="openai-agents is in the `clients` extra (pip install -e '.[clients]')")
from openai import AsyncOpenAI  # noqa: E402

DEMO_MODEL = Path(brisk.__file__).parent / "demo_model"


class Forecast(BaseModel):
    """Ask for the forecast (no arguments: the demo model cannot write JSON, and a call without any is forced
    whole)."""


class Weather(BaseModel):
    city: str = Field(max_length=12)  # bounded, so the tiny model's constrained answer ends
    sunny: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RunningServer(
        str(DEMO_MODEL), "--served-model-name", "brisk-demo", "--state-dir", str(tmp_path_factory.mktemp("state"))
    )
    yield srv
    srv.stop()


def _agent(model, calls: list[str]):
    # A function without parameters: its call can be forced whole (arguments `{}`); the demo model cannot write
    # JSON arguments (constrained decoding of arguments is structured outputs' work).
    @agents.function_tool
    def get_weather() -> str:
        """The weather in Verona."""
        calls.append("called")
        return "It is sunny in Verona."

    return agents.Agent(
        name="bard",
        instructions="Answer in one line.",
        tools=[get_weather],
        model=model,
        # the demo model knows no tools: require a call on the first turn (the SDK resets it after a call)
        # (and a repetition penalty keeps the tiny model's answers from looping until max_tokens)
        # (include_usage: the SDK asks a server that is not OpenAI's for streamed usage only when told to)
        model_settings=agents.ModelSettings(
            tool_choice="required",
            max_tokens=96,
            temperature=0,
            include_usage=True,
            extra_body={"repetition_penalty": 1.3},
        ),
    )


@pytest.fixture
def client(server):  # one per test: an async client belongs to the event loop of its asyncio.run
    agents.set_tracing_disabled(True)
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_agent_with_a_function_tool_on_the_responses_model_two_turns(client):
    calls: list[str] = []
    agent = _agent(agents.OpenAIResponsesModel(model="brisk-demo", openai_client=client), calls)

    async def run():
        first = await agents.Runner.run(agent, "What is the weather in Verona?", max_turns=4)
        second = await agents.Runner.run(
            agent, "And in Padua?", previous_response_id=first.last_response_id, max_turns=4
        )
        streamed = agents.Runner.run_streamed(agent, "And in Mantua?", max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        return first, second, streamed, kinds

    first, second, streamed, kinds = asyncio.run(run())
    assert len(calls) == 3  # the tool ran on every run
    assert isinstance(first.final_output, str) and isinstance(second.final_output, str)
    assert first.last_response_id and second.last_response_id != first.last_response_id
    assert first.context_wrapper.usage.requests >= 2 and first.context_wrapper.usage.input_tokens > 0
    # the second run continued the first: its first model call saw the stored conversation
    assert second.raw_responses[0].usage.input_tokens > first.raw_responses[0].usage.input_tokens
    assert "raw_response_event" in kinds and isinstance(streamed.final_output, str)
    assert streamed.context_wrapper.usage.requests >= 2 and streamed.context_wrapper.usage.output_tokens > 0
    assert any(isinstance(item, agents.ToolCallOutputItem) for item in streamed.new_items)


def test_agent_with_a_function_tool_on_the_chat_completions_model_streamed_and_not(client):
    calls: list[str] = []
    agent = _agent(agents.OpenAIChatCompletionsModel(model="brisk-demo", openai_client=client), calls)

    async def run():
        result = await agents.Runner.run(agent, "What is the weather in Verona?", max_turns=4)
        streamed = agents.Runner.run_streamed(agent, "And in Padua?", max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        return result, streamed, kinds

    result, streamed, kinds = asyncio.run(run())
    assert len(calls) == 2  # the tool ran in both runs
    assert isinstance(result.final_output, str) and isinstance(streamed.final_output, str)
    for run in (result, streamed):
        usage = run.context_wrapper.usage
        assert usage.requests >= 2 and usage.input_tokens > 0 and usage.output_tokens > 0
        assert any(isinstance(item, agents.ToolCallOutputItem) for item in run.new_items)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


def test_lm_eval_local_completions_generate_until(server, tmp_path):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the `clients` extra")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "data.jsonl"
    lines = [
        {"question": f"ROMEO: {q}\nJULIET:", "answer": " O Romeo"}
        for q in ("Hark!", "Speak!", "Lady!", "Fair!", "Stay!", "Now!")
    ]
    data.write_text("\n".join(json.dumps(line) for line in lines))
    (tmp_path / "brisk_tiny_gen.yaml").write_text(
        "\n".join(
            [
                "task: brisk_tiny_gen",
                "dataset_path: json",
                "dataset_kwargs:",
                "  data_files:",
                f"    test: {data}",
                "test_split: test",
                "output_type: generate_until",
                'doc_to_text: "{{question}}"',
                'doc_to_target: "{{answer}}"',
                "generation_kwargs:",
                '  until: ["\\n"]',
                "  max_gen_toks: 8",
                "  do_sample: false",
                "metric_list:",
                "  - metric: exact_match",
            ]
        )
    )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model=brisk-demo,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={DEMO_MODEL},tokenized_requests=False,num_concurrent=1,max_retries=1"
        ),
        tasks=["brisk_tiny_gen"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        limit=5,
    )
    scores = results["results"]["brisk_tiny_gen"]
    assert 0.0 <= scores["exact_match,none"] <= 1.0  # a score was computed over the 5 documents
    assert results["n-samples"]["brisk_tiny_gen"]["effective"] == 5


def test_lm_eval_local_completions_multiple_choice(server, tmp_path):
    # loglikelihood requests: /v1/completions with echo, logprobs and max_tokens 0 (the prompt tokens' logprobs).
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the `clients` extra")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "data.jsonl"
    lines = [
        {"question": f"ROMEO: {q}\nJULIET:", "choices": [" O Romeo", " Good night", " Away"], "label": i % 3}
        for i, q in enumerate(("Hark!", "Speak!", "Lady!", "Fair!", "Stay!", "Now!"))
    ]
    data.write_text("\n".join(json.dumps(line) for line in lines))
    (tmp_path / "brisk_tiny_mc.yaml").write_text(
        "\n".join(
            [
                "task: brisk_tiny_mc",
                "dataset_path: json",
                "dataset_kwargs:",
                "  data_files:",
                f"    test: {data}",
                "test_split: test",
                "output_type: multiple_choice",
                'doc_to_text: "{{question}}"',
                'doc_to_choice: "{{choices}}"',
                'doc_to_target: "{{label}}"',
                "metric_list:",
                "  - metric: acc",
            ]
        )
    )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model=brisk-demo,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={DEMO_MODEL},tokenized_requests=False,num_concurrent=1,max_retries=1"
        ),
        tasks=["brisk_tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        limit=5,
    )
    scores = results["results"]["brisk_tiny_mc"]
    assert isinstance(scores["acc,none"], float) and 0.0 <= scores["acc,none"] <= 1.0
    assert results["n-samples"]["brisk_tiny_mc"]["effective"] == 5


# ---- langchain-openai ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(server):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is in the `clients` extra")
    return langchain_openai.ChatOpenAI(
        model="brisk-demo",
        base_url=f"{server.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=64,
        max_retries=0,
        timeout=120,
    )


def _weather_tool():
    from langchain_core.tools import tool

    @tool
    def get_weather() -> str:
        """The weather in Verona."""
        return "It is sunny in Verona."

    return get_weather


def test_langchain_invoke_and_stream_agree(chat_model):
    answer = chat_model.invoke("What say you, good my lord?")
    assert isinstance(answer.content, str) and answer.content
    assert answer.usage_metadata["input_tokens"] > 0 and answer.usage_metadata["output_tokens"] > 0
    chunks = list(chat_model.stream("What say you, good my lord?"))
    assert "".join(c.content for c in chunks) == answer.content  # greedy: the same answer, streamed


def test_langchain_bind_tools_any_returns_a_tool_call_streamed_or_not(chat_model):
    bound = chat_model.bind_tools([_weather_tool()], tool_choice="any")  # OpenAI's tool_choice "required"
    message = bound.invoke("What is the weather in Verona?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {})], message
    assert message.response_metadata["finish_reason"] == "tool_calls"
    merged = None
    for chunk in bound.stream("What is the weather in Verona?"):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {})]
    result = _weather_tool().invoke(message.tool_calls[0])  # the call runs as the tool
    assert "sunny" in result.content


def test_langchain_structured_output_by_function_calling(chat_model):
    # room for the JSON whitespace a constrained tiny model runs to (bounded per gap by the grammar)
    roomy = chat_model.model_copy(update={"max_tokens": 400})
    structured = roomy.with_structured_output(Weather, method="function_calling", strict=True)
    out = structured.invoke("Is it sunny in Verona?")
    assert isinstance(out, Weather) and isinstance(out.city, str)


# ---- litellm -------------------------------------------------------------------------------------------------
# litellm wants openai<3 where openai-agents wants openai>=3: it lives in its own directory (the `litellm` extra,
# installed by `make install` into .venv/litellm-site) and runs in a subprocess with that directory first on the
# path, as a litellm user's process would be.
LITELLM_SITE = Path(sys.prefix) / "litellm-site"
LITELLM_SCRIPT = """
import json, sys
import litellm
url = sys.argv[1]
tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in Verona.",
          "parameters": {"type": "object", "properties": {}}}}]
messages = [{"role": "user", "content": "What is the weather in Verona?"}]
common = dict(model="openai/brisk-demo", api_base=url, api_key="unused", temperature=0, max_tokens=48)
forced = litellm.completion(messages=messages, tools=tools, tool_choice="required", **common)
chunks = list(litellm.completion(messages=messages, tools=tools, tool_choice="required", stream=True, **common))
streamed_calls = {}
for chunk in chunks:
    for call in chunk.choices[0].delta.tool_calls or []:
        entry = streamed_calls.setdefault(call.index, {"name": "", "arguments": ""})
        entry["name"] += call.function.name or ""
        entry["arguments"] += call.function.arguments or ""
plain = litellm.completion(messages=messages, **common)
text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=messages, stream=True, **common))
print(json.dumps({
    "calls": [{"name": c.function.name, "arguments": c.function.arguments} for c in forced.choices[0].message.tool_calls or []],
    "finish_reason": forced.choices[0].finish_reason,
    "streamed_calls": list(streamed_calls.values()),
    "plain": plain.choices[0].message.content,
    "usage": plain.usage.total_tokens,
    "streamed": text,
}))
"""


def test_litellm_completion_tool_choice_required_and_streamed(server):
    if not (LITELLM_SITE / "litellm").is_dir():
        pytest.skip(f"litellm is in the `litellm` extra, installed by `make install` into {LITELLM_SITE}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LITELLM_SITE), str(Path(__file__).resolve().parents[1])])}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no fetch of the price list from the network
    proc = subprocess.run(
        [sys.executable, "-c", LITELLM_SCRIPT, f"{server.url}/v1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["calls"] == [{"name": "get_weather", "arguments": "{}"}] and out["finish_reason"] == "tool_calls"
    assert out["streamed_calls"] == out["calls"]  # the forced call, streamed or not
    assert out["plain"] and out["streamed"] == out["plain"] and out["usage"] > 0


# ---- openai's .parse helpers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sync_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_parse_strict_function_tools_chat_and_responses(sync_client):
    import openai

    question = [{"role": "user", "content": "What is the weather in Verona?"}]
    chat = sync_client.chat.completions.parse(
        model="brisk-demo",
        messages=question,
        tools=[openai.pydantic_function_tool(Forecast)],  # strict: true, as .parse requires
        tool_choice="required",
        max_tokens=24,
    )
    (call,) = chat.choices[0].message.tool_calls
    assert call.function.name == "Forecast" and call.function.parsed_arguments == Forecast()
    with sync_client.chat.completions.stream(
        model="brisk-demo",
        messages=question,
        tools=[openai.pydantic_function_tool(Forecast)],
        tool_choice="required",
        max_tokens=24,
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [e.parsed_arguments for e in done] == [Forecast()]
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == Forecast()
    tool = {"type": "function", "name": "Forecast", "strict": True, **_responses_parameters(Forecast)}
    response = sync_client.responses.parse(
        model="brisk-demo", input="What is the weather in Verona?", tools=[tool], tool_choice="required"
    )
    (item,) = [i for i in response.output if i.type == "function_call"]
    assert item.name == "Forecast" and json.loads(item.arguments) == {} and response.usage.output_tokens > 0


def _responses_parameters(model: type[BaseModel]) -> dict:
    import openai

    return {"parameters": openai.pydantic_function_tool(model)["function"]["parameters"]}


def test_openai_parse_response_format_chat_and_responses(sync_client):
    # Sampled: the grammar constrains the whole harmony turn (headers included), so even the 2.85M-parameter demo
    # model always reaches a final answer that parses (it once wrote a malformed header in CI when only the final
    # channel was constrained: 1 in 200 at temperature 1, 26 in 120 at 1.6; now none in either).
    question = [{"role": "user", "content": "Is it sunny in Verona?"}]
    chat = sync_client.chat.completions.parse(
        model="brisk-demo", messages=question, response_format=Weather, max_tokens=400, temperature=1.0
    )
    assert isinstance(chat.choices[0].message.parsed, Weather)
    response = sync_client.responses.parse(
        model="brisk-demo", input="Is it sunny in Verona?", text_format=Weather, max_output_tokens=400, temperature=1.0
    )
    assert isinstance(response.output_parsed, Weather)
