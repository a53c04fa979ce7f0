"""A live `brisk serve` process on a tiny Llama, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import httpx
import openai
import pytest

from tests.server_utils import RunningServer, is_idle, wait_until
from tests.tiny_models import make_tiny_llama_with_tokenizer

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_server")
    make_tiny_llama_with_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = RunningServer(model_dir, "--served-model-name", "tiny", "--max_batch_size", "16", "--max_num_tokens", "256")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == "Hello world"
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.get(f"{server.url}/tokenizer_info")  # off without --enable-tokenizer-info-endpoint
    assert r.status_code == 404 and "--enable-tokenizer-info-endpoint" in r.json()["error"]["message"]


def test_chat_plain_and_streaming_agree(server, client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    prompt_tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]
    assert full.usage.prompt_tokens == prompt_tokens
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == prompt_tokens + 12
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == prompt_tokens


def test_completions_all_prompt_forms(server, client):
    kw = dict(model="tiny", max_tokens=6, **GREEDY)
    one = client.completions.create(prompt="The king", **kw)
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The king"}).json()["tokens"]
    by_ids = client.completions.create(prompt=ids, **kw)
    assert by_ids.choices[0].text == one.choices[0].text
    many = client.completions.create(prompt=["The king", "A queen"], **kw)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == one.choices[0].text
    many_ids = client.completions.create(prompt=[ids, ids], **kw)
    assert [c.text for c in many_ids.choices] == [one.choices[0].text] * 2
    assert many.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="The king", stream=True, **kw))
    assert streamed == one.choices[0].text


def test_responses_plain_and_streaming(client):
    kw = dict(model="tiny", max_output_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.responses.create(input="The king", **kw)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 10 and whole.output_text
    events = list(client.responses.create(input=[{"role": "user", "content": "The king"}], stream=True, **kw))
    kinds = [e.type for e in events]
    # cut by max_output_tokens: the stream ends with response.incomplete, as OpenAI's does
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    assert events[-1].response.status == "incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_n_seed_and_logprobs(client):
    kw = dict(model="tiny", prompt="Once", max_tokens=8, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seed reproducible across requests
    assert len({c.text for c in a.choices}) > 1 and [c.index for c in a.choices] == [0, 1, 2]
    lp = client.completions.create(model="tiny", prompt="Once", max_tokens=4, logprobs=2, **GREEDY)
    assert len(lp.choices[0].logprobs.token_logprobs) == 4
    assert all(len(t) >= 1 for t in lp.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy = top-1


def test_stop_sequences(client):
    base = client.completions.create(model="tiny", prompt="The king", max_tokens=12, **GREEDY).choices[0].text
    stop = base[4:6]
    out = client.completions.create(model="tiny", prompt="The king", max_tokens=12, stop=[stop], **GREEDY).choices[0]
    assert out.text == base[: base.index(stop)] and out.finish_reason == "stop"


def _status(url: str, method: str = "post", **kw) -> tuple[int, dict]:
    r = getattr(httpx, method)(url, timeout=30, **kw)
    return r.status_code, r.json()


def test_error_statuses(server):
    u = server.url
    code, body = _status(f"{u}/v1/completions", json={"prompt": "x", "bogus": 1})
    assert code == 400 and body["error"]["param"] == "bogus" and body["error"]["type"] == "invalid_request_error"
    code, body = _status(f"{u}/v1/completions", json={"prompt": "x", "max_tokens": 5000})
    assert code == 400 and body["error"]["code"] == "context_length_exceeded"
    code, body = _status(f"{u}/v1/completions", json={"prompt": [1, 2, 10**7], "max_tokens": 2})
    assert code == 400 and "vocabulary" in body["error"]["message"]
    code, body = _status(f"{u}/v1/completions", json={"prompt": "x", "temperature": -1})
    assert code == 400
    code, body = _status(f"{u}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert code == 404 and body["error"]["code"] == "model_not_found"
    code, body = _status(f"{u}/v1/nothing-here", json={})
    assert code == 404 and "error" in body
    code, body = _status(f"{u}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert code == 400
    code, body = _status(f"{u}/v1/completions", json={"prompt": "x" * (9 << 20)})
    assert code == 413
    code, body = _status(
        f"{u}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
    )
    assert code == 400 and body["error"]["param"] == "response_format"  # a json_schema format without its schema
    assert httpx.get(f"{u}/health").status_code == 200  # still serving


async def _stream_text(aclient, prompt: str) -> str:
    stream = await aclient.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8, stream=True, **GREEDY
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream])


def test_64_concurrent_streams_complete(aclient):
    prompts = [f"request number {i}" for i in range(64)]

    async def whole(prompt: str) -> str:
        r = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8, **GREEDY
        )
        return r.choices[0].message.content

    async def run():
        streamed = await asyncio.gather(*(_stream_text(aclient, p) for p in prompts))
        expected = await asyncio.gather(*(whole(p) for p in prompts))
        return streamed, expected

    streamed, expected = asyncio.run(run())
    assert all(expected)
    assert streamed == expected  # each stream complete and identical to the same request served whole


def test_disconnects_release_kv_blocks(server):
    async def connect_and_drop(i: int):
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream(
                "POST",
                f"{server.url}/v1/completions",
                json={"prompt": f"drop {i}", "max_tokens": 400, "stream": True, "ignore_eos": True},
            ) as r:
                async for _ in r.aiter_lines():
                    break  # first chunk, then hang up

    async def run():
        await asyncio.gather(*(connect_and_drop(i) for i in range(16)))

    asyncio.run(run())
    assert wait_until(lambda: is_idle(server.metrics(), "tiny")), server.metrics()
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_metrics_exposed(server, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3, **GREEDY)
    m = server.metrics()
    assert m['brisk:generation_tokens_total{model_name="tiny"}'] >= 3
    assert m['brisk:request_success_total{finished_reason="length",model_name="tiny"}'] >= 1
    assert any(k.startswith("brisk:time_to_first_token_seconds_bucket") for k in m)
    assert 'brisk:prefix_cache_queries_total{model_name="tiny"}' in m


def test_api_key_queue_limit_and_stream_interval(model_dir, tmp_path):
    options = tmp_path / "options.yaml"
    options.write_text("stream_interval: 4\n")
    srv = RunningServer(
        model_dir,
        "--api-key",
        "sekret",
        "--max_batch_size",
        "1",
        "--max_num_waiting",
        "0",
        "--extra_llm_api_options",
        str(options),
    )
    try:
        assert httpx.get(f"{srv.url}/health").status_code == 200  # health needs no key
        code, body = _status(f"{srv.url}/v1/models", method="get")
        assert code == 401 and body["error"]["code"] == "invalid_api_key"
        code, _ = _status(f"{srv.url}/v1/models", method="get", headers={"Authorization": "Bearer wrong"})
        assert code == 401
        ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekret", max_retries=0)
        assert ok.models.list().data

        async def run():
            async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer sekret"}) as http:
                async with http.stream(
                    "POST",
                    f"{srv.url}/v1/completions",
                    json={"prompt": "hold", "max_tokens": 300, "stream": True, "ignore_eos": True},
                ) as r:
                    async for _ in r.aiter_lines():
                        second = await http.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
                        return second

        second = asyncio.run(run())
        assert second.status_code == 429 and second.headers["retry-after"]
        assert second.json()["error"]["code"] == "queue_full"

        # The held stream was dropped above; its abort reaches the engine asynchronously.
        auth = {"Authorization": "Bearer sekret"}
        assert wait_until(
            lambda: (
                not any(v for k, v in srv.metrics(headers=auth).items() if k.startswith("brisk:num_requests_in_flight"))
            )
        )
        # stream_interval 4: 10 tokens arrive in 3 chunks (4 + 4 + the final 2), never one per token
        chunks = list(
            ok.completions.create(
                model=model_dir,
                prompt="The king",
                max_tokens=10,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        )
        assert len(chunks) == 3 and chunks[-1].choices[0].finish_reason == "length"
    finally:
        srv.stop()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_engine_death_fails_requests_and_exits_nonzero(model_dir):
    srv = RunningServer(model_dir)
    try:
        engine_pids = _children(srv.proc.pid)  # the engine core is the server's only child process
        assert engine_pids
        with httpx.stream(
            "POST",
            f"{srv.url}/v1/completions",
            timeout=60,
            json={"prompt": "x", "max_tokens": 900, "stream": True, "ignore_eos": True},
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            for pid in engine_pids:
                os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        assert any('"engine_dead"' in line for line in rest)  # the in-flight request is told, not left hanging
        assert rest[-1] == "data: [DONE]"
        assert srv.proc.wait(timeout=30) != 0
    finally:
        srv.stop()


def test_return_token_ids(server):
    """vLLM's return_token_ids: the prompt's ids as rendered (/tokenize's) and each choice's output ids, which a
    stream spreads over its chunks in order; without it, no such field."""
    url = server.url
    messages = [{"role": "user", "content": "Tell me a story"}]
    prompt = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    body = httpx.post(f"{url}/v1/chat/completions", json={**chat, "return_token_ids": True}).json()
    choice = body["choices"][0]
    assert body["prompt_token_ids"] == prompt and len(choice["token_ids"]) == body["usage"]["completion_tokens"] == 9
    detok = httpx.post(f"{url}/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert detok == choice["message"]["content"]
    plain = httpx.post(f"{url}/v1/chat/completions", json=chat).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**chat, "return_token_ids": True, "stream": True}
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == choice["token_ids"]

    completion = {"model": "tiny", "prompt": ["Once upon", "a time"], "max_tokens": 5, "temperature": 0, "n": 2}
    completion |= {"ignore_eos": True, "return_token_ids": True}
    prompts = [httpx.post(f"{url}/tokenize", json={"prompt": p}).json()["tokens"] for p in completion["prompt"]]
    whole = httpx.post(f"{url}/v1/completions", json=completion).json()["choices"]
    assert [c["prompt_token_ids"] for c in whole] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert all(len(c["token_ids"]) == 5 for c in whole)
    with httpx.stream("POST", f"{url}/v1/completions", json={**completion, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for c in whole:
        mine = [ch for chunk in chunks for ch in chunk["choices"] if ch["index"] == c["index"]]
        assert mine[0]["prompt_token_ids"] == c["prompt_token_ids"] and all(
            "prompt_token_ids" not in m for m in mine[1:]
        )
        assert [t for m in mine for t in m["token_ids"]] == c["token_ids"]
    echo = httpx.post(f"{url}/v1/completions", json={**completion, "max_tokens": 0, "echo": True}).json()["choices"]
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in echo] == [(prompts[0], [])] * 2 + [(prompts[1], [])] * 2


def test_cache_salt_isolates_the_prefix_cache(server):
    """vLLM's cache_salt on all three APIs: a prompt's cached tokens come back only under its salt."""
    url = server.url
    words = " ".join(f"w{i}" for i in range(80))  # a prompt of many blocks, fresh in this server

    def cached(path: str, salt: str | None, **body) -> int:
        body = {"model": "tiny", "temperature": 0, **body} | ({"cache_salt": salt} if salt else {})
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        return (usage.get("prompt_tokens_details") or usage.get("input_tokens_details"))["cached_tokens"]

    completion = {"prompt": words, "max_tokens": 1}
    hits = [cached("/v1/completions", s, **completion) for s in ("tenant-a", "tenant-b", "tenant-a", None)]
    assert hits[0] == hits[1] == hits[3] == 0 and hits[2] > 0
    chat = {"messages": [{"role": "user", "content": words + " again"}], "max_tokens": 1}
    assert cached("/v1/chat/completions", "tenant-c", **chat) == 0
    assert cached("/v1/chat/completions", "tenant-c", **chat) > 0
    assert cached("/v1/chat/completions", "tenant-d", **chat) == 0
    responses = {"input": words + " once more", "max_output_tokens": 1, "store": False}
    assert cached("/v1/responses", "tenant-e", **responses) == 0
    assert cached("/v1/responses", "tenant-e", **responses) > 0
    assert cached("/v1/responses", None, **responses) == 0
    assert (
        httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "cache_salt": ""}).status_code == 400
    )


def test_allowed_token_ids(server):
    url = server.url
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 3}
    body |= {"ignore_eos": True, "return_token_ids": True}
    free = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["token_ids"]
    allowed = [t for t in range(5, 200) if t not in free][:3]
    r = httpx.post(f"{url}/v1/completions", json={**body, "allowed_token_ids": allowed})
    assert r.status_code == 200 and set(r.json()["choices"][0]["token_ids"]) <= set(allowed), r.text
    messages = [{"role": "user", "content": "Hi"}]
    chat = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 4,
        "allowed_token_ids": allowed,
        "return_token_ids": True,
    }
    assert set(httpx.post(f"{url}/v1/chat/completions", json=chat).json()["choices"][0]["token_ids"]) <= set(allowed)
    for bad in (
        {"allowed_token_ids": [10**7]},
        {"allowed_token_ids": []},
        {"response_format": {"type": "json_object"}},
    ):
        r = httpx.post(f"{url}/v1/chat/completions", json={**chat, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_truncate_prompt_tokens(server):
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens (truncation_side right: its first N); a text longer
    than the context is cut instead of refused; echo shows what was kept."""
    url = server.url
    text = " ".join(f"w{i}" for i in range(40))
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"]
    body = {"model": "tiny", "prompt": text, "max_tokens": 1, "return_token_ids": True, "truncate_prompt_tokens": 5}
    left = httpx.post(f"{url}/v1/completions", json=body).json()
    assert left["choices"][0]["prompt_token_ids"] == ids[-5:] and left["usage"]["prompt_tokens"] == 5
    right = httpx.post(f"{url}/v1/completions", json={**body, "truncation_side": "right"}).json()
    assert right["choices"][0]["prompt_token_ids"] == ids[:5]
    echo = httpx.post(f"{url}/v1/completions", json={**body, "echo": True, "max_tokens": 0}).json()["choices"][0]
    assert echo["text"] == httpx.post(f"{url}/detokenize", json={"tokens": ids[-5:]}).json()["prompt"]
    huge = {"model": "tiny", "prompt": "w " * 40000, "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=huge).status_code == 400
    assert (
        httpx.post(f"{url}/v1/completions", json={**huge, "truncate_prompt_tokens": 16}).json()["usage"][
            "prompt_tokens"
        ]
        == 16
    )
    chat = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    assert (
        httpx.post(f"{url}/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 7}).json()["usage"][
            "prompt_tokens"
        ]
        == 7
    )
    assert httpx.post(f"{url}/v1/completions", json={**body, "truncate_prompt_tokens": -2}).status_code == 400


def test_request_id_names_the_completion_as_in_vllm(server):
    url = server.url
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json={**chat, "request_id": "abc"}).json()["id"] == "chatcmpl-abc"
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "request_id": "abc"}, headers={"X-Request-Id": "hdr"})
    assert r.json()["id"] == "chatcmpl-hdr"  # the header first, as vLLM takes it
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True, "request_id": "xyz"},
    ) as s:
        ids = {json.loads(line[6:])["id"] for line in s.iter_lines() if line.startswith("data: {")}
    assert ids == {"cmpl-xyz"}
    fresh = [httpx.post(f"{url}/v1/chat/completions", json=chat).json()["id"] for _ in range(2)]
    assert fresh[0] != fresh[1] and all(i.startswith("chatcmpl-") for i in fresh)
    # a Response's request_id is its id (vLLM's), once: the store holds it
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2, "request_id": "resp_abc"}
    assert httpx.post(f"{url}/v1/responses", json=body).json()["id"] == "resp_abc"
    r = httpx.post(f"{url}/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


def test_logprob_token_ids_list_the_chosen_ids(server):
    """vLLM's logprob_token_ids: chat's top_logprobs and a completion's top_logprobs hold the sampled token's entry,
    then the chosen ids' (in order) with the logprobs a wide top-n shows; they need logprobs (400 naming the field)."""
    url, chosen = server.url, [11, 3, 29]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    chat |= {"logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True}
    names = [f"token_id:{t}" for t in chosen]
    picked = httpx.post(f"{url}/v1/chat/completions", json={**chat, "logprob_token_ids": chosen}).json()["choices"][0]
    wide = httpx.post(f"{url}/v1/chat/completions", json={**chat, "top_logprobs": 20}).json()["choices"][0]
    assert picked["token_ids"] == wide["token_ids"]
    for entry, reference in zip(picked["logprobs"]["content"], wide["logprobs"]["content"]):
        top = [t["token"] for t in entry["top_logprobs"]]
        assert top == [entry["token"], *(n for n in names if n != entry["token"])]
        known = {t["token"]: t["logprob"] for t in reference["top_logprobs"]}
        for t in entry["top_logprobs"]:
            if t["token"] in known:
                assert t["logprob"] == pytest.approx(known[t["token"]], abs=1e-4)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "logprobs": 0}
    body |= {"return_tokens_as_token_ids": True, "logprob_token_ids": chosen}
    choice = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    for token, top in zip(choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]):
        assert list(top) == [token, *(n for n in names if n != token)]
    refusals = [
        ("/v1/chat/completions", {**chat, "logprobs": False, "logprob_token_ids": chosen}),
        ("/v1/completions", {**body, "logprobs": None}),
        ("/v1/completions", {**body, "echo": True, "max_tokens": 0}),
        ("/v1/completions", {**body, "logprob_token_ids": [10**7]}),
        ("/v1/completions", {**body, "logprob_token_ids": []}),
    ]
    for route, refused in refusals:
        r = httpx.post(f"{url}{route}", json=refused)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids", r.text


def test_logprobs_name_tokens_by_id(server):
    """return_tokens_as_token_ids: each logprob's token is `token_id:N` of the output's own ids; a completion's
    text offsets stay offsets into its text."""
    url = server.url
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    body |= {"ignore_eos": True, "return_token_ids": True}
    named = httpx.post(f"{url}/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    plain = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in named["token_ids"]]
    assert all(k.startswith("token_id:") for top in named["logprobs"]["top_logprobs"] for k in top)
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    chat |= {"logprobs": True, "top_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = httpx.post(f"{url}/v1/chat/completions", json=chat).json()["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]


# ---- system_fingerprint and prompt_tokens_details (vLLM's --fingerprint-mode, --enable-prompt-tokens-details) ------
def _sse_events(url: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _fingerprints(url: str) -> dict[str, object]:
    """Each kind of answer's system_fingerprint: the whole answers', and of each stream's chunks the last one's
    (None where absent); a stream's other chunks must carry none."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2}
    completion = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "n": 2}
    found: dict[str, object] = {}
    for route, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        whole = httpx.post(f"{url}{route}", json=body, timeout=60).json()
        found[f"{route} whole"] = whole.get("system_fingerprint", None)
        found[f"{route} usage"] = whole["usage"]
        for usage in (False, True):
            events = _sse_events(url, route, {**body, "stream": True, "stream_options": {"include_usage": usage}})
            stamped = [e for e in events if "system_fingerprint" in e]
            finishing = [e for e in events if any(c.get("finish_reason") for c in e["choices"])]
            # stamped: the chunks that may end the stream (each choice's finish, or the usage chunk after them)
            assert stamped == ([events[-1]] if usage else finishing) or not stamped, (route, usage)
            found[f"{route} stream usage={usage}"] = [e["system_fingerprint"] for e in stamped] or None
    return found


def test_system_fingerprint_and_prompt_tokens_details_by_default(server):
    """Whole answers and a stream's closing chunks carry brisk-<version>-<hash of the engine options> (vLLM's full
    mode, its default); usage has prompt_tokens_details.cached_tokens (OpenAI's; vLLM's default leaves it out)."""
    import brisk

    found = _fingerprints(server.url)
    fingerprint = found["/v1/chat/completions whole"]
    assert isinstance(fingerprint, str) and re.fullmatch(
        rf"brisk-{re.escape(brisk.__version__)}-[0-9a-f]{{8}}", fingerprint
    )
    for route in ("/v1/chat/completions", "/v1/completions"):
        assert found[f"{route} whole"] == fingerprint
        assert found[f"{route} stream usage=True"] == [fingerprint]  # the usage chunk only
        assert found[f"{route} stream usage=False"] == [fingerprint] * 2  # each choice's finish_reason chunk
        assert found[f"{route} usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_fingerprint_modes_and_prompt_tokens_details_off(model_dir):
    """--fingerprint-mode custom sends --fingerprint-value as it is; none sends no system_fingerprint;
    --disable-prompt-tokens-details makes usage.prompt_tokens_details null."""
    args = ("--served-model-name", "tiny", "--max_batch_size", "4", "--max_num_tokens", "256")
    srv = RunningServer(model_dir, *args, "--fingerprint-mode", "custom", "--fingerprint-value", "fp_test")
    try:
        found = _fingerprints(srv.url)
    finally:
        srv.stop()
    for route in ("/v1/chat/completions", "/v1/completions"):
        assert found[f"{route} whole"] == "fp_test"
        assert found[f"{route} stream usage=False"] == ["fp_test"] * 2
        assert found[f"{route} usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    srv = RunningServer(model_dir, *args, "--fingerprint-mode", "none", "--disable-prompt-tokens-details")
    try:
        found = _fingerprints(srv.url)
    finally:
        srv.stop()
    for route in ("/v1/chat/completions", "/v1/completions"):
        assert found[f"{route} whole"] is None
        assert found[f"{route} stream usage=False"] is None and found[f"{route} stream usage=True"] is None
        assert found[f"{route} usage"]["prompt_tokens_details"] is None
