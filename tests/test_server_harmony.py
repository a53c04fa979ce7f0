"""gpt-oss through the live server: a tiny random gpt-oss with the real o200k_harmony vocab and chat template.

Random weights write nonsense, so these tests check what must hold whatever the model says: the
prompt is the harmony render, streaming and non-streaming agree field by field, a named tool choice
yields a call to that function, and malformed output never fails a request.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from brisk.harmony import render_with_harmony
from tests.harmony_tokenizer import TIKTOKEN_DIR, make_gpt_oss_tokenizer
from tests.server_utils import RunningServer
from tests.tiny_models import make_tiny_model

SHARED = Path(__file__).resolve().parents[2] / "shared"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_harmony")
    make_tiny_model("gpt_oss", path, seed=0, vocab_size=201088)
    shutil.copy(SHARED / "models" / "gpt-oss-20b" / "generation_config.json", path / "generation_config.json")
    make_gpt_oss_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    path = model_dir
    # The tool-call grammars over the real 201,088-token vocabulary take seconds to compile on a loaded 2-core
    # machine: the default 10 s limit (a 400) is not what these tests are about.
    srv = RunningServer(
        str(path), "--served-model-name", "gpt-oss-tiny", "--max_batch_size", "8", "--grammar_compile_timeout_s", "120"
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def harmony():
    """openai-harmony's renderer, loading the shared o200k_base file offline."""
    import openai_harmony

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", str(TIKTOKEN_DIR))
        encoding = openai_harmony.load_harmony_encoding(openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    return lambda messages, tools=None: render_with_harmony(messages, tools, encoding=encoding)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(client, stream: bool, **kw):
    args = dict(model="gpt-oss-tiny", max_tokens=24, temperature=0, **kw)
    if not stream:
        return client.chat.completions.create(**args).choices[0]
    fields = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        fields["content"] += d.content or ""
        fields["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            call = fields["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or tc.id
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return fields, finish


def test_prompt_is_the_harmony_render(server, harmony):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": "gpt-oss-tiny", "messages": messages, "max_tokens": 1}
    usage = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == len(harmony(messages))


def test_return_token_ids_holds_every_output_token(server, harmony):
    """return_token_ids on gpt-oss: the harmony render, and every output token (channel headers included, which
    no text field shows); a stream's chunks carry the same tokens in order."""
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    body = {"model": "gpt-oss-tiny", "messages": messages, "max_tokens": 24, "temperature": 0}
    body["return_token_ids"] = True
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert whole["prompt_token_ids"] == harmony(messages)
    assert len(whole["choices"][0]["token_ids"]) == whole["usage"]["completion_tokens"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert streamed == whole["choices"][0]["token_ids"]


def test_continue_final_message_continues_the_assistants_answer(server, harmony, model_dir):
    """continue_final_message (vLLM's): the prompt is the conversation so far plus the assistant's answer begun,
    left open (no <|end|>, no new turn), and the output is parsed as that answer's continuation: its text tokens
    are `content`, with no reasoning. echo leads the answer with the begun text, streamed or not; the reasoning
    channel is continued the same way."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    url = f"{server.url}/v1/chat/completions"
    words = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" sea", " blue", " waves", " and", ".")]
    question = {"role": "user", "content": "Tell me about the sea."}
    body = {"model": "gpt-oss-tiny", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    body |= {"continue_final_message": True, "allowed_token_ids": words}  # text tokens only, whatever the weights

    answer = {"role": "assistant", "content": "The sea is"}
    whole = httpx.post(url, json={**body, "messages": [question, answer]}, timeout=60).json()
    before = harmony([question])  # ends in <|start|>assistant
    opened = tokenizer.encode("<|channel|>final<|message|>The sea is", add_special_tokens=False)
    assert whole["prompt_token_ids"] == before + opened
    choice = whole["choices"][0]
    assert choice["message"]["content"] == tokenizer.decode(choice["token_ids"])
    assert not choice["message"].get("reasoning_content")

    echoed = httpx.post(url, json={**body, "messages": [question, answer], "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["message"]["content"] == "The sea is" + choice["message"]["content"]
    stream = {**body, "messages": [question, answer], "echo": True, "stream": True}
    with httpx.stream("POST", url, json=stream, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert text == echoed["choices"][0]["message"]["content"]

    thinking = {"role": "assistant", "content": None, "reasoning_content": "The user asks"}
    thought = httpx.post(url, json={**body, "messages": [question, thinking]}, timeout=60).json()
    opened = tokenizer.encode("<|channel|>analysis<|message|>The user asks", add_special_tokens=False)
    assert thought["prompt_token_ids"] == before + opened
    message = thought["choices"][0]["message"]
    assert message["reasoning_content"] == tokenizer.decode(thought["choices"][0]["token_ids"])
    assert not message.get("content")

    tokenized = httpx.post(
        f"{server.url}/tokenize", json={"messages": [question, answer], "continue_final_message": True}, timeout=60
    ).json()
    assert tokenized["tokens"] == whole["prompt_token_ids"]

    refused = [
        ({"messages": [question, answer], "add_generation_prompt": True}, "continue_final_message"),
        ({"messages": [question]}, "messages"),  # a user message is not the assistant's to continue
        ({"messages": [question, {"role": "assistant", "content": None}]}, "messages"),
    ]
    for extra, param in refused:
        r = httpx.post(url, json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "continue" in r.json()["error"]["message"], r.text  # says what cannot be continued


def test_streaming_and_non_streaming_agree(client):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    whole = _chat(client, False, messages=messages, reasoning_effort="low")
    streamed, finish = _chat(client, True, messages=messages, reasoning_effort="low")
    assert (whole.message.content or "") == streamed["content"]
    assert (getattr(whole.message, "reasoning_content", None) or "") == streamed["reasoning_content"]
    assert len(whole.message.tool_calls or []) == len(streamed["tool_calls"])
    assert whole.finish_reason == finish
    for text in (streamed["content"], streamed["reasoning_content"]):
        assert "<|channel|>" not in text and "<|message|>" not in text  # no harmony tokens leak


def test_named_tool_choice_calls_that_function(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = _chat(client, False, messages=messages, tools=TOOLS, tool_choice=choice)
    assert [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
    assert whole.message.tool_calls[0].id.startswith("call_")
    streamed, _ = _chat(client, True, messages=messages, tools=TOOLS, tool_choice=choice)
    assert [c["name"] for c in streamed["tool_calls"].values()] == ["get_weather"]
    assert streamed["tool_calls"][0]["arguments"] == whole.message.tool_calls[0].function.arguments


def test_multi_turn_tool_use_renders(server, harmony):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temp_c": 3})},
    ]
    body = {"model": "gpt-oss-tiny", "messages": messages, "tools": TOOLS, "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(harmony(messages, TOOLS))


def test_responses_api_function_call(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    r = client.responses.create(
        model="gpt-oss-tiny",
        input="Weather in Rome?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=16,
        temperature=0,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]
    events = list(
        client.responses.create(
            model="gpt-oss-tiny",
            input="Weather in Rome?",
            tools=tools,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=16,
            temperature=0,
            stream=True,
        )
    )
    done = events[-1]
    # the terminal event says how the response ended, as the non-streamed status does
    assert done.type == f"response.{r.status}" and done.response.status == r.status
    assert [i.name for i in done.response.output if i.type == "function_call"] == ["get_weather"]
    assert [i.arguments for i in done.response.output if i.type == "function_call"] == [c.arguments for c in calls]
