"""Reliability of a live `brisk serve` under load and faults: timeouts, slow readers, NaN logits,
hundreds of concurrent streams, a disconnect storm, and SIGTERM while busy.

The module's tiny Llama has one poisoned token: its input embedding is NaN (the byte-level token of
byte 0xFF, which encoding valid UTF-8 text never produces), so a prompt holding it makes the model
emit NaN logits for that request only. Its output row is zero, so its logit is 0 while hundreds of
others are spread around it: greedy decoding never picks it and seeded sampling (deterministic)
does not here, so generated text never feeds it back. Every test ends with the server idle (no KV
blocks in use) and answering a normal request.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from brisk.engine.client import DeltaBuffer
from brisk.engine.output_processor import CompletionDelta
from tests.server_utils import RunningServer, is_idle, wait_until
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

MODEL = "tiny"
GREEDY = {"temperature": 0, "ignore_eos": True}
RUNNING = f'brisk:num_requests_running{{model_name="{MODEL}"}}'
COALESCED = f'brisk:stream_deltas_coalesced{{model_name="{MODEL}"}}'


# ---- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama_poisoned")
    # Untied embeddings: poisoning an input row must leave the output projection (lm_head) intact.
    make_tiny_model("llama", path, seed=0, tie_word_embeddings=False)
    tokenizer = make_tiny_tokenizer(path)
    weights_file = path / "model.safetensors"
    tensors = load_file(weights_file)
    poison = poison_token_id(tokenizer)
    tensors["model.embed_tokens.weight"][poison] = float("nan")
    tensors["lm_head.weight"][poison] = 0.0
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return path


def poison_token_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("ÿ")  # byte-level BPE's token for the byte 0xFF


@pytest.fixture(scope="module")
def poison(model_dir) -> int:
    from transformers import AutoTokenizer

    return poison_token_id(AutoTokenizer.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = RunningServer(str(model_dir), "--served-model-name", MODEL)
    yield srv
    srv.stop()


# ---- helpers ---------------------------------------------------------------------------------------


def assert_idle_and_serving(server: RunningServer) -> None:
    assert wait_until(lambda: is_idle(server.metrics(), MODEL)), server.metrics()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2, **GREEDY}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def complete(server: RunningServer, prompt, **kw) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(lines: list[str]) -> list[dict | str]:
    """The `data:` payloads of an SSE stream: dicts, and the final "[DONE]"."""
    events: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def stream_events(http: httpx.AsyncClient, url: str, body: dict) -> list[dict | str]:
    async with http.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return sse_events([line async for line in r.aiter_lines()])


def streamed_completion(events: list[dict | str]) -> tuple[str, list[str]]:
    """(text, finish reasons) of a one-choice /v1/completions stream that ended with [DONE]."""
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert all("error" not in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1  # one request's chunks only
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return text, reasons


# ---- unit: the bounded delta buffer ------------------------------------------------------------------
def _delta(index: int, text: str, finish: str | None = None) -> CompletionDelta:
    return CompletionDelta("r", index, text, [len(text)], None, finish, None, output=None)


def test_delta_buffer_coalesces_a_slow_consumer():
    async def run():
        buffer = DeltaBuffer(max_pending=8)
        for i in range(1000):
            buffer.put(_delta(i % 2, f"{i},", "length" if i >= 998 else None))
            assert len(buffer) <= 8 + 1  # bounded whatever the consumer does
        taken = [await buffer.get() for _ in range(len(buffer))]
        return buffer, taken

    buffer, taken = asyncio.run(run())
    for index in (0, 1):
        mine = [d for d in taken if d.index == index]
        assert "".join(d.text for d in mine) == "".join(f"{i}," for i in range(index, 1000, 2))  # nothing lost
        assert sum(len(d.token_ids) for d in mine) == 500 and mine[-1].finish_reason == "length"
    assert buffer.num_coalesced > 900


# ---- timeouts --------------------------------------------------------------------------------------
def test_request_timeout_aborts_and_frees_kv(server):
    # 1,000 tokens take ~0.8 s here; a 0.2 s timeout leaves a margin however much faster the engine gets
    long = {"max_tokens": 1000, **GREEDY, "timeout": 0.2}

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            whole = http.post(f"{server.url}/v1/completions", json={"prompt": "slow", **long})
            chat = stream_events(
                http, f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "slow"}], **long}
            )
            responses = http.post(
                f"{server.url}/v1/responses",
                json={"input": "slow", "max_output_tokens": 1000, **GREEDY, "timeout": 0.2},
            )
            return await asyncio.gather(whole, chat, responses)

    start = time.monotonic()
    whole, chat, responses = asyncio.run(run())
    assert time.monotonic() - start < 30
    assert whole.status_code == 200
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and whole.json()["usage"]["completion_tokens"] < 1000
    assert chat[-1] == "[DONE]"
    assert [c["choices"][0]["finish_reason"] for c in chat[:-1] if c["choices"]][-1] == "abort"
    assert responses.status_code == 200
    assert responses.json()["status"] == "incomplete"
    assert responses.json()["incomplete_details"] == {"reason": "aborted"}
    assert_idle_and_serving(server)


# ---- NaN logits ------------------------------------------------------------------------------------
def test_nan_logits_fail_only_the_affected_request(server, poison):
    healthy = [[5 + i, 40, 41, 42] for i in range(4)]
    expected = [complete(server, p, max_tokens=6, **GREEDY)["choices"][0]["text"] for p in healthy]
    poisoned = [7, poison, 8]

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            url = f"{server.url}/v1/completions"
            bad_whole = http.post(url, json={"prompt": poisoned, "max_tokens": 6, **GREEDY})
            bad_stream = stream_events(http, url, {"prompt": poisoned, "max_tokens": 6, **GREEDY})
            good = [http.post(url, json={"prompt": p, "max_tokens": 6, **GREEDY}) for p in healthy]
            return await asyncio.gather(bad_whole, bad_stream, *good)

    bad_whole, bad_stream, *good = asyncio.run(run())
    assert bad_whole.status_code == 500
    error = bad_whole.json()["error"]
    assert error["code"] == "model_error" and error["type"] == "server_error"
    assert bad_stream[-1] == "[DONE]" and bad_stream[-2]["error"]["code"] == "model_error"
    assert [r.status_code for r in good] == [200] * len(healthy)
    assert [r.json()["choices"][0]["text"] for r in good] == expected  # neighbours in the batch unaffected
    assert_idle_and_serving(server)


def test_engine_core_fails_only_nan_rows(model_dir, poison):
    """In-process: the poisoned request's completions end with "error", their KV blocks are freed, the
    request beside it in the batch runs to its end untouched."""
    from brisk.config import EngineConfig
    from brisk.engine.core import EngineCore
    from brisk.engine.messages import EngineCoreRequest
    from brisk.sampling_params import SamplingParams

    core = EngineCore(EngineConfig.build(str(model_dir), device="cpu", kv_cache_config={"max_blocks": 64}))
    params = SamplingParams(n=2, max_tokens=5, temperature=0, ignore_eos=True)
    core.add_request(EngineCoreRequest("bad", [7, poison, 8], params))
    core.add_request(EngineCoreRequest("good", [7, 9, 8], params))
    finish: dict[tuple[str, int], str] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[(out.request_id, out.index)] = out.finish_reason
    assert finish == {("bad", 0): "error", ("bad", 1): "error", ("good", 0): "length", ("good", 1): "length"}
    assert tokens.get(("bad", 0), []) == [] and len(tokens[("good", 0)]) == 5
    assert core.kv.usage == 0.0 and not core.requests


# ---- slow readers ----------------------------------------------------------------------------------
def test_slow_reader_is_coalesced_not_lost(server):
    """A client that stops reading its stream: the engine finishes anyway, and the stream, read late,
    is complete (deltas were merged instead of queued one per token)."""
    body = {
        "prompt": "a slow reader",
        "n": 8,
        "max_tokens": 100,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
        "logprobs": 20,
    }  # about 1 MB of events, five times what the socket buffers hold
    expected = [c["text"] for c in complete(server, **body)["choices"]]
    coalesced_before = server.metrics().get(COALESCED, 0.0)

    payload = json.dumps({**body, "stream": True}).encode()
    with socket.socket() as sock:
        # A small window and a small MSS keep the kernel buffers on both sides small (on loopback the
        # server's send buffer would otherwise grow to megabytes), so the server really has to wait.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        sock.connect(("127.0.0.1", server.port))
        # HTTP/1.0: the response body is delimited by the connection closing, not chunked.
        sock.sendall(
            b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        received = b""
        while b"data: " not in received:
            received += sock.recv(1024)
        # Now stop reading. The engine still finishes the request; the server keeps serving others.
        assert wait_until(lambda: server.metrics().get(RUNNING) == 0.0)
        assert complete(server, "meanwhile", max_tokens=2, **GREEDY)["choices"][0]["finish_reason"] == "length"
        while chunk := sock.recv(1 << 16):
            received += chunk

    events = sse_events(received.split(b"\r\n\r\n", 1)[1].decode().split("\n"))
    assert events[-1] == "[DONE]"
    texts = ["".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == i) for i in range(8)]
    assert texts == expected
    assert len(events) - 1 < 8 * 100, len(received)  # fewer chunks than tokens: the backlog was merged
    assert server.metrics()[COALESCED] > coalesced_before
    assert_idle_and_serving(server)


# ---- load ------------------------------------------------------------------------------------------
def test_concurrent_streams_match_requests_sent_alone(server, pytestconfig):
    num_streams = pytestconfig.getoption("--load-streams")  # 256 by default
    prompts = [f"load test prompt number {i}" for i in range(32)]
    copies = -(-num_streams // len(prompts))
    alone = {p: complete(server, p, max_tokens=8, **GREEDY)["choices"][0]["text"] for p in prompts}

    async def run():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            url = f"{server.url}/v1/completions"
            requests = [p for p in prompts for _ in range(copies)]
            random.Random(0).shuffle(requests)
            results = await asyncio.gather(
                *(stream_events(http, url, {"prompt": p, "max_tokens": 8, **GREEDY}) for p in requests)
            )
            return requests, results

    requests, results = asyncio.run(run())
    assert len(results) == len(prompts) * copies
    ids = set()
    for prompt, events in zip(requests, results):
        text, reasons = streamed_completion(events)
        assert reasons == ["length"]  # exactly one end per stream
        assert text == alone[prompt]
        ids.add(events[0]["id"])
    assert len(ids) == len(prompts) * copies  # none duplicated
    assert_idle_and_serving(server)


def test_disconnect_storm_releases_everything(server):
    rng = random.Random(1234)

    async def hang_up_streaming(http: httpx.AsyncClient, i: int, after_chunks: int) -> None:
        async with http.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={"prompt": f"storm {i}", "max_tokens": 200, "stream": True, **GREEDY},
        ) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= after_chunks:
                    return  # leaving the block closes the connection

    async def hang_up_waiting(http: httpx.AsyncClient, i: int, after_s: float) -> None:
        try:
            await asyncio.wait_for(
                http.post(
                    f"{server.url}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": f"storm {i}"}], "max_tokens": 200, **GREEDY},
                ),
                after_s,
            )
        except asyncio.TimeoutError:
            pass  # cancelled mid-request: the connection is dropped

    async def run():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            clients = [hang_up_streaming(http, i, rng.randint(0, 8)) for i in range(200)]
            clients += [hang_up_waiting(http, i, rng.uniform(0.05, 1.5)) for i in range(50)]
            rng.shuffle(clients)
            await asyncio.gather(*clients)

    asyncio.run(run())
    assert_idle_and_serving(server)


# ---- SIGTERM ---------------------------------------------------------------------------------------
def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def process_cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def test_sigterm_drains_then_exits_zero(model_dir):
    shutdown_timeout = 2.0
    srv = RunningServer(str(model_dir), "--served-model-name", MODEL, "--shutdown-timeout", str(shutdown_timeout))
    try:
        engine_pids = [pid for pid in child_pids(srv.proc.pid) if b"spawn_main" in process_cmdline(pid)]
        assert len(engine_pids) == 1
        url = f"{srv.url}/v1/completions"
        # Long ones (48 sequences of 1000 tokens: ~5 s of engine work on the CI machine) cannot finish within the
        # shutdown timeout; the short one, 2 tokens from its end when the signal comes, can.
        long = {"prompt": "long", "n": 16, "max_tokens": 1000, **GREEDY}
        short = {"prompt": "short", "max_tokens": 3, **GREEDY}

        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                started = [asyncio.Event() for _ in range(4)]

                async def stream(body: dict, first_chunk: asyncio.Event) -> list:
                    async with http.stream("POST", url, json={**body, "stream": True}) as r:
                        lines = []
                        async for line in r.aiter_lines():
                            lines.append(line)
                            first_chunk.set()
                        return sse_events(lines)

                tasks = [asyncio.create_task(stream(long, started[i])) for i in range(3)]
                tasks.append(asyncio.create_task(stream(short, started[3])))
                await asyncio.gather(*(e.wait() for e in started))  # every request is in flight
                os.kill(srv.proc.pid, signal.SIGTERM)
                signalled = time.monotonic()
                while (await http.get(f"{srv.url}/health")).status_code == 200:
                    assert time.monotonic() - signalled < 10, "the server did not start draining"
                    await asyncio.sleep(0.05)  # polling the observable drain state, with a deadline
                refused = await http.post(url, json=short)
                return signalled, refused, await asyncio.gather(*tasks)

        signalled, refused, (*long_streams, short_stream) = asyncio.run(run())
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        _, short_reasons = streamed_completion(short_stream)
        assert short_reasons == ["length"]  # finished within the drain
        for events in long_streams:
            assert events[-1] == "[DONE]"
            reasons = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"][0]["finish_reason"]]
            assert sorted(reasons) == ["abort"] * 16  # aborted at the shutdown timeout, every choice told
        assert srv.proc.wait(timeout=60) == 0
        assert time.monotonic() - signalled < shutdown_timeout + 15
        assert not Path(f"/proc/{engine_pids[0]}").exists()  # the engine went with it (killed and reaped)
    finally:
        srv.stop()
