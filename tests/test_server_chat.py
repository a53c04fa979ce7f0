"""Chat completions on gpt-oss (harmony) through `brisk serve` of the bundled demo model (issue 17's chat fixes):
stop strings cut `content` (whole and streamed alike), logprobs cover exactly the tokens of `content`,
continuous usage stats, bad_words."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

import brisk
from tests.server_utils import RunningServer

DEMO_MODEL = Path(brisk.__file__).parent / "demo_model"
MESSAGES = [{"role": "user", "content": "What say you, good my lord?"}]
GREEDY = {"messages": MESSAGES, "max_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    srv = RunningServer(str(DEMO_MODEL), "--served-model-name", "brisk-demo", "--max_batch_size", "8")
    yield srv
    srv.stop()


def _chat(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**GREEDY, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, **body) -> list[dict]:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**GREEDY, **body, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _streamed_content(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.fixture(scope="module")
def answer(server) -> str:
    content = _chat(server)["choices"][0]["message"]["content"]
    assert content and len(content.split()) >= 4, content  # the demo model answers in its final channel
    return content


def test_stop_string_cuts_content_whole_and_streamed(server, answer):
    stop = answer.split()[2]  # a word in the middle of the answer
    cut = answer[: answer.index(stop)]
    whole = _chat(server, stop=[stop])["choices"][0]
    assert whole["message"]["content"] == (cut or None) and whole["finish_reason"] == "stop"
    chunks = _stream(server, stop=[stop])
    assert _streamed_content(chunks) == cut
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    kept = _chat(server, stop=[stop], include_stop_str_in_output=True)["choices"][0]["message"]["content"]
    assert kept == cut + stop


def test_logprobs_cover_exactly_the_content_tokens(server, answer):
    whole = _chat(server, logprobs=True, top_logprobs=2)["choices"][0]
    entries = whole["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == whole["message"]["content"] == answer
    assert all("<|" not in e["token"] for e in entries)
    streamed = [
        e
        for c in _stream(server, logprobs=True)
        if c["choices"]
        for e in (c["choices"][0]["logprobs"] or {}).get("content") or []
    ]
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]
    stop = answer.split()[2]
    cut = _chat(server, stop=[stop], logprobs=True)["choices"][0]
    tokens = "".join(e["token"] for e in cut["logprobs"]["content"])
    assert tokens.startswith(cut["message"]["content"] or "") and len(tokens) < len(answer)  # nothing past the stop


def test_continuous_usage_stats_grow_chunk_by_chunk(server):
    whole = _chat(server)["usage"]
    chunks = _stream(server, stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in chunks]  # every chunk carries the usage so far
    assert all(c["usage"]["prompt_tokens"] == whole["prompt_tokens"] for c in chunks)
    assert counts[0] == 0 and counts == sorted(counts) and len(set(counts)) > 2
    assert chunks[-1]["choices"] == [] and counts[-1] == counts[-2] == whole["completion_tokens"]


def test_bad_words_are_never_generated(server, answer):
    word = answer.split()[1].strip(".,;:!?")
    banned = _chat(server, bad_words=[word])["choices"][0]["message"]["content"] or ""
    assert word not in banned.split() and banned != answer
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**GREEDY, "bad_words": ["Rosencrantzguildensternish"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    for name, description in (("get_weather", "Weather for a city"), ("get_time", "Local time in a city"))
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tool_choice_required_always_calls_a_tool_streamed_or_not(server, seed):
    body = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": seed, "max_tokens": 24}
    whole = _chat(server, **body)["choices"][0]
    calls = whole["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] in {"get_weather", "get_time"}, whole
    assert whole["message"]["content"] is None and whole["finish_reason"] in ("tool_calls", "length")
    streamed: dict = {}
    for chunk in _stream(server, **body):
        for call in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk["choices"] else []:
            entry = streamed.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name") or ""
            entry["arguments"] += call["function"].get("arguments") or ""
    assert list(streamed.values()) == [calls[0]["function"]]  # the same call, streamed or not

    r = httpx.post(
        f"{server.url}/v1/responses",
        json={
            "input": MESSAGES[0]["content"],
            "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "temperature": 1.0,
            "seed": seed,
            "max_output_tokens": 24,
        },
        timeout=120,
    )
    items = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert len(items) == 1 and items[0]["name"] == calls[0]["function"]["name"], r.text


def test_offline_chat_renders_gpt_oss_prompts_as_the_server_does(server):
    from brisk import LLM, SamplingParams

    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    served = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    with LLM(str(DEMO_MODEL), max_seq_len=512) as llm:
        assert llm.render_chat(messages) == served  # the harmony render, not the template's raw output
        out = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0))[0]
        assert out.prompt_token_ids == served
        with pytest.raises(ValueError, match="wizard"):
            llm.chat([{"role": "wizard", "content": "Hi"}])
