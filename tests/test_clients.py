"""Real client libraries against `brisk serve` of the bundled demo model (issue 17): an openai-agents Agent with a
function tool through the Responses model (two turns, the second via previous_response_id, streamed and not) and
the Chat Completions model. Skipped with the reason where the `clients` extra is not installed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import brisk
from tests.server_utils import RunningServer

agents = pytest.importorskip("agents", reason="openai-agents is in the `clients` extra (pip install -e '.[clients]')")
from openai import AsyncOpenAI  # noqa: E402

DEMO_MODEL = Path(brisk.__file__).parent / "demo_model"


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
        model_settings=agents.ModelSettings(
            tool_choice="required", max_tokens=96, temperature=0, extra_body={"repetition_penalty": 1.3}
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


def test_agent_with_a_function_tool_on_the_chat_completions_model(client):
    calls: list[str] = []
    agent = _agent(agents.OpenAIChatCompletionsModel(model="brisk-demo", openai_client=client), calls)
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Verona?", max_turns=4))
    assert len(calls) == 1 and isinstance(result.final_output, str)
    assert result.context_wrapper.usage.requests >= 2 and result.context_wrapper.usage.output_tokens > 0


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
