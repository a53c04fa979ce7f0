"""Chat completions on gpt-oss (harmony) through `brisk serve` of the bundled demo model (issue 17's chat fixes):
stop strings cut `content` (whole and streamed alike), logprobs cover exactly the tokens of `content` (the
reasoning's come apart, when asked), continuous usage stats, bad_words, tool_choice required."""

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


def test_reasoning_logprobs_apart_and_only_when_asked(server, answer):
    # The demo model answers in its final channel alone (it was trained so), so its reasoning_logprobs are empty:
    # the split itself is checked on a harmony output with both channels below.
    whole = _chat(server, logprobs=True, reasoning_logprobs=True, top_logprobs=1)["choices"][0]
    assert whole["reasoning_logprobs"] == {"content": []} and not whole["message"].get("reasoning_content")
    assert "".join(e["token"] for e in whole["logprobs"]["content"]) == answer  # content's stay content's alone
    assert "reasoning_logprobs" not in _chat(server, logprobs=True)["choices"][0]
    chunks = [c["choices"][0] for c in _stream(server, logprobs=True, reasoning_logprobs=True) if c["choices"]]
    assert all(c["reasoning_logprobs"] == {"content": []} for c in chunks[1:])  # every chunk past the role's
    assert not any("reasoning_logprobs" in c for c in _stream(server, logprobs=True) if c["choices"])
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**GREEDY, "reasoning_logprobs": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_logprobs", r.text


@pytest.mark.parametrize("piece", [1, 3, 64])
def test_harmony_parser_marks_reasoning_and_content_tokens_apart(piece):
    # What chat's `logprobs` and `reasoning_logprobs` keep: each token of an analysis + final output marked as
    # reasoning or content (headers neither), whatever the pieces the stream delivers it in.
    from transformers import AutoTokenizer

    from brisk.server.output_parsers import HarmonyChoiceParser

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    output = "<|channel|>analysis<|message|>Who is there?<|end|><|start|>assistant<|channel|>final<|message|>Nay, answer me.<|return|>"
    ids = tokenizer.encode(output, add_special_tokens=False)
    parser = HarmonyChoiceParser(tokenizer, [])
    reasoning, content = [], []
    for start in range(0, len(ids), piece):
        chunk = ids[start : start + piece]
        parser.feed(chunk, tokenizer.decode(chunk))
        assert not any(r and c for r, c in zip(parser.reasoning_tokens, parser.content_tokens))
        reasoning += [t for t, r in zip(chunk, parser.reasoning_tokens) if r]
        content += [t for t, c in zip(chunk, parser.content_tokens) if c]
    message = parser.finish()
    assert message == {"content": "Nay, answer me.", "reasoning_content": "Who is there?"}
    assert tokenizer.decode(reasoning) == message["reasoning_content"]
    assert tokenizer.decode(content) == message["content"]
    # vLLM's include_reasoning: false: the same output, its reasoning left out of the message and every delta
    quiet = HarmonyChoiceParser(tokenizer, [], include_reasoning=False)
    deltas = [quiet.feed(ids[start : start + piece], "") for start in range(0, len(ids), piece)]
    assert quiet.finish() == {"content": "Nay, answer me."}
    assert not any("reasoning_content" in d for d in deltas) and any("content" in d for d in deltas)


def test_continuous_usage_stats_grow_chunk_by_chunk(server):
    whole = _chat(server)["usage"]
    chunks = _stream(server, stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in chunks]  # every chunk carries the usage so far
    assert all(c["usage"]["prompt_tokens"] == whole["prompt_tokens"] for c in chunks)
    assert counts[0] == 0 and counts == sorted(counts) and len(set(counts)) > 2
    assert chunks[-1]["choices"] == [] and counts[-1] == counts[-2] == whole["completion_tokens"]


def test_completions_continuous_usage_stats_grow_chunk_by_chunk(server):
    body = {"prompt": "What say you, good my lord?", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["usage"]
    for options, closing in (({"continuous_usage_stats": True}, False), ({"include_usage": True}, True)):
        r = httpx.post(
            f"{server.url}/v1/completions", json={**body, "stream": True, "stream_options": options}, timeout=120
        )
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        if not closing:  # every chunk carries the usage so far; no usage chunk of its own without include_usage
            counts = [c["usage"]["completion_tokens"] for c in chunks]
            assert all(c["usage"]["prompt_tokens"] == whole["prompt_tokens"] for c in chunks)
            assert counts == sorted(counts) and len(set(counts)) > 2 and counts[-1] == whole["completion_tokens"]
            assert all(c["choices"] for c in chunks)
        else:  # the usage in a closing chunk only
            assert [c["usage"] for c in chunks[:-1] if c.get("usage")] == [] and chunks[-1]["usage"] == whole


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
    chunks = _stream(server, **body)
    finishing = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    # the finish_reason comes alone after the call's last delta (the openai SDK's stream helper needs it so)
    assert [c["delta"] for c in finishing] == [{}] and finishing[0]["finish_reason"] == whole["finish_reason"]
    for chunk in chunks:
        for call in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk["choices"] else []:
            entry = streamed.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name") or ""
            entry["arguments"] += call["function"].get("arguments") or ""
    assert list(streamed.values()) == [calls[0]["function"]]  # the same call, streamed or not

    request = {
        "input": MESSAGES[0]["content"],
        "tools": [{"type": "function", **t["function"]} for t in TOOLS],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": seed,
        "max_output_tokens": 24,
    }
    r = httpx.post(f"{server.url}/v1/responses", json=request, timeout=120)
    items = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert len(items) == 1 and items[0]["name"] == calls[0]["function"]["name"], r.text
    events = httpx.post(f"{server.url}/v1/responses", json={**request, "stream": True}, timeout=120).text
    done = [json.loads(x[6:]) for x in events.splitlines() if x.startswith("data: {")]
    streamed_items = [e["item"] for e in done if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["name"], i["arguments"]) for i in streamed_items] == [
        ("function_call", items[0]["name"], items[0]["arguments"])
    ]


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


@pytest.mark.parametrize("piece", [1, 5])
def test_a_call_written_under_tool_choice_none_is_dropped(piece):
    # tool_choice "none" with the tools shown (--no-exclude-tools-when-tool-choice-none, vLLM's default): a call
    # the model writes anyway is not returned, and the answer stays plain text.
    from transformers import AutoTokenizer

    from brisk.server.output_parsers import HarmonyChoiceParser

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    output = (
        "<|channel|>analysis<|message|>Ask the sky.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "York"}<|call|>'
    )
    ids = tokenizer.encode(output, add_special_tokens=False)
    messages = []
    for include_tool_calls in (True, False):
        parser = HarmonyChoiceParser(tokenizer, [], include_tool_calls=include_tool_calls)
        deltas = [parser.feed(ids[start : start + piece], "") for start in range(0, len(ids), piece)]
        assert any("tool_calls" in d for d in deltas) is include_tool_calls is parser.has_tool_calls
        messages.append(parser.finish())
    called, dropped = messages
    assert called["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "York"}'}
    assert dropped == {"content": None, "reasoning_content": "Ask the sky."}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _prompt_shows_the_tool(server, route: str) -> bool:
    if route == "/v1/chat/completions":
        body = {**GREEDY, "max_tokens": 4, "tools": [WEATHER], "tool_choice": "none", "return_token_ids": True}
        r = httpx.post(f"{server.url}{route}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        prompt = r.json()["prompt_token_ids"]
    else:  # the Responses API: the prompt's length (it reports no ids), with and without the tool
        lengths = []
        for tools in ([], [{"type": "function", **WEATHER["function"]}]):
            body = {"input": "What say you?", "max_output_tokens": 4, "tools": tools, "tool_choice": "none"}
            r = httpx.post(f"{server.url}{route}", json=body, timeout=120)
            assert r.status_code == 200, r.text
            lengths.append(r.json()["usage"]["input_tokens"])
        return lengths[1] > lengths[0]
    from transformers import AutoTokenizer

    return "get_weather" in AutoTokenizer.from_pretrained(DEMO_MODEL).decode(prompt)


def test_tool_choice_none_shows_the_tools_only_when_asked(server):
    """By default tool_choice "none" leaves the tools out of the prompt; --no-exclude-tools-when-tool-choice-none
    (vLLM's default) shows them, in chat completions and Responses alike."""
    for route in ("/v1/chat/completions", "/v1/responses"):
        assert not _prompt_shows_the_tool(server, route), route
    shown = RunningServer(
        str(DEMO_MODEL), "--served-model-name", "brisk-demo", "--no-exclude-tools-when-tool-choice-none"
    )
    try:
        for route in ("/v1/chat/completions", "/v1/responses"):
            assert _prompt_shows_the_tool(shown, route), route
    finally:
        shown.stop()
