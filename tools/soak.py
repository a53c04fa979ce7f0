"""Soak test: a mixed workload against one `brisk serve` for a fixed time.

The server runs with `check_kv_invariants: true` (KV block accounting verified after every engine step;
a violation kills the engine, which the soak sees as failed requests and a failing /health) and a KV
pool small enough that long prompts force preemption. Meanwhile the soak samples the RSS of the server and of
each process below it (engine, ranks, API servers) and the server's metrics. At the end it waits for the server to
go idle, checks that every KV block is free, stops the server with SIGTERM and expects exit code 0.

    python tools/soak.py --minutes 10 --out soak.json        # prints a markdown summary
    python tools/soak.py --minutes 10 --features             # with FP8 KV, a host tier, speculation, more kinds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

DEMO_MODEL = Path(__file__).resolve().parents[1] / "brisk" / "demo_model"
SERVER_OPTIONS = """\
check_kv_invariants: true
max_batch_size: 16
max_num_tokens: 512
kv_cache_config:
  max_blocks: 120       # 119 usable blocks of 32 tokens, 2 KV groups: two long prompts nearly fill it
"""
# --features: FP8 KV (full attention; the sliding windows kept in the model dtype), a host tier that evicted prefix
# blocks go to, and n-gram speculation, on the same small pool. Appended to SERVER_OPTIONS: its first lines go on
# SERVER_OPTIONS' last mapping, kv_cache_config.
FEATURE_OPTIONS = """\
  dtype: fp8
  dtype_skip_layers: [sliding_window]
  host_cache_size: 16000000
speculative_config:
  decoding_type: NGram
  max_draft_len: 3
"""
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
KINDS = {  # kind: weight
    "stream_chat": 3,
    "completion": 3,
    "abort": 2,
    "long": 1,
    "prefix": 2,
}
FEATURE_KINDS = {"responses": 2, "n2": 1, "json": 1, "tools": 1, "logprobs": 1}
WORDS = "thou art the king of all that is and was in this fair land my lord good sir".split()
SHARED_PREFIX = " ".join(WORDS * 12)  # prefix-cache reuse across requests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    """Every process below pid (the engine, its other ranks, the API-server processes), each with its own RSS."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        return []
    return children + [grandchild for child in children for grandchild in _children(child)]


def _rss_below_mb(pid: int) -> float:
    """The RSS of every process below pid, summed (shared pages counted in each)."""
    return sum(_rss_mb(p) for p in _children(pid))


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


async def _feature_request(http: httpx.AsyncClient, rng: random.Random, kind: str, words: str) -> str:
    """One request of the --features kinds; '<kind>:ok' only where its answer has the shape asked for."""
    if kind == "responses":  # stored, and half the time continued from the stored one
        r = await http.post("/v1/responses", json={"input": words, "max_output_tokens": 24})
        if r.status_code != 200 or rng.random() < 0.5:
            return f"{kind}:{'ok' if r.status_code == 200 else r.status_code}"
        body = {"input": words, "max_output_tokens": 24, "previous_response_id": r.json()["id"], "stream": True}
        async with http.stream("POST", "/v1/responses", json=body) as r:
            events = [line async for line in r.aiter_lines() if line.startswith("event:")]
        # the last event ends the response: completed, or incomplete where max_output_tokens cut it
        done = (
            r.status_code == 200
            and events
            and events[-1] in ("event: response.completed", "event: response.incomplete")
        )
        return f"{kind}:{'ok' if done else r.status_code}"
    if kind == "logprobs":
        body = {"prompt": words, "max_tokens": 8, "logprobs": 3, "echo": True}
        r = await http.post("/v1/completions", json=body)
        if r.status_code != 200:
            return f"{kind}:{r.status_code}"
        lp = r.json()["choices"][0]["logprobs"]
        return f"{kind}:{'ok' if len(lp['tokens']) == len(lp['token_logprobs']) > 8 else 'bad'}"
    body = {"messages": [{"role": "user", "content": words}], "max_tokens": 48}
    if kind == "n2":
        body.update(n=2, temperature=0.8, seed=rng.randint(0, 1000))
    elif kind == "json":
        # a schema of its own most of the time (one of 1,000 names): compiled, cached, and evicted past 256 kept
        schema = json.loads(json.dumps(JSON_SCHEMA).replace('"age"', f'"age{rng.randrange(1000)}"'))
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
        body["max_tokens"] = 200
    else:
        body.update(tools=TOOLS, tool_choice="required")
    r = await http.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        return f"{kind}:{r.status_code}"
    choices = r.json()["choices"]
    if kind == "n2":
        return f"{kind}:{'ok' if [c['index'] for c in choices] == [0, 1] else 'bad'}"
    message, finish = choices[0]["message"], choices[0]["finish_reason"]
    try:
        if kind == "json" and finish == "stop":
            json.loads(message["content"])
        if kind == "tools" and finish in ("stop", "tool_calls"):
            json.loads(message["tool_calls"][0]["function"]["arguments"])
    except (ValueError, KeyError, IndexError, TypeError):
        return f"{kind}:bad"
    return f"{kind}:ok"


async def _one_request(http: httpx.AsyncClient, rng: random.Random, kinds: dict[str, int]) -> str:
    """Runs one request of a random kind; returns '<kind>:<outcome>'."""
    kind = rng.choices(list(kinds), list(kinds.values()))[0]
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
    if kind in FEATURE_KINDS:
        try:
            return await _feature_request(http, rng, kind, words)
        except httpx.HTTPError as exc:
            return f"{kind}:{type(exc).__name__}"
    if kind == "stream_chat":
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": 64, "stream": True}
        url = "/v1/chat/completions"
    elif kind == "long":
        body = {"prompt": " ".join(rng.choice(WORDS) for _ in range(900)), "max_tokens": 32}
        url = "/v1/completions"
    elif kind == "prefix":
        body = {"prompt": SHARED_PREFIX + " " + words, "max_tokens": 16}
        url = "/v1/completions"
    else:
        body = {"prompt": words, "max_tokens": 48, "stream": kind == "abort"}
        url = "/v1/completions"
    try:
        if not body.get("stream"):
            r = await http.post(url, json=body)
            return f"{kind}:{'ok' if r.status_code == 200 else r.status_code}"
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return f"{kind}:{r.status_code}"
            keep = rng.randint(1, 10) if kind == "abort" else None
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    if '"error"' in line:
                        return f"{kind}:stream_error"
                    chunks += 1
                    if keep is not None and chunks >= keep:
                        return f"{kind}:disconnected"  # leaving the block hangs up mid-stream
            return f"{kind}:ok"
    except httpx.HTTPError as exc:
        return f"{kind}:{type(exc).__name__}"


async def _soak(url: str, server_pid: int, minutes: float, concurrency: int, seed: int, kinds: dict[str, int]) -> dict:
    deadline = time.monotonic() + minutes * 60
    outcomes: Counter[str] = Counter()
    samples: list[dict] = []

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        # Generous: on a small KV pool a request may queue behind long prompts for minutes on a busy CPU.
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            while time.monotonic() < deadline:
                outcomes[await _one_request(http, rng, kinds)] += 1

    async def sampler() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            while time.monotonic() < deadline:
                metrics = (await http.get("/metrics")).text
                below = _children(server_pid)
                samples.append(
                    {
                        "t_s": round(time.monotonic() - (deadline - minutes * 60), 1),
                        "server_rss_mb": round(_rss_mb(server_pid), 1),
                        "processes_below_rss_mb": round(sum(_rss_mb(p) for p in below), 1),
                        "each_rss_mb": {f"{p} {_name(p)}": round(_rss_mb(p), 1) for p in below},
                        "kv_usage": _metric(metrics, "brisk:kv_cache_usage_perc"),
                        "running": _metric(metrics, "brisk:num_requests_running"),
                        "health": (await http.get("/health")).status_code,
                    }
                )
                await asyncio.sleep(5)  # a sampling period, not synchronisation

    await asyncio.gather(sampler(), *(worker(i) for i in range(concurrency)))
    return {"outcomes": dict(outcomes), "samples": samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument("--serve-flags", default="", help="more `brisk serve` flags, e.g. '--tensor-parallel-size 2'")
    parser.add_argument(
        "--features",
        action="store_true",
        help="FP8 KV, a host KV tier and n-gram speculation on the server; Responses (stored, continued), n=2, "
        "JSON-schema, tool and logprobs requests among the kinds",
    )
    args = parser.parse_args(argv)

    options = Path(tempfile.mkdtemp(prefix="brisk-soak-")) / "soak.yaml"
    options.write_text(SERVER_OPTIONS + (FEATURE_OPTIONS if args.features else ""))
    kinds = KINDS | (FEATURE_KINDS if args.features else {})
    port = _free_port()
    log = open(options.with_suffix(".log"), "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "brisk.cli",
            "serve",
            args.model,
            "--port",
            str(port),
            "--extra_llm_api_options",
            str(options),
            *shlex.split(args.serve_flags),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    while time.monotonic() - started < 300:
        if server.poll() is not None:
            print(f"server exited with {server.returncode}; log: {log.name}", file=sys.stderr)
            return 1
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # readiness polling
    rss_start = {"server_mb": _rss_mb(server.pid), "processes_below_mb": _rss_below_mb(server.pid)}

    result = asyncio.run(_soak(url, server.pid, args.minutes, args.concurrency, args.seed, kinds))

    idle_by = time.monotonic() + 60
    final = ""
    while time.monotonic() < idle_by:
        final = httpx.get(f"{url}/metrics", timeout=10).text
        if _metric(final, "brisk:kv_cache_usage_perc") == 0.0 and _metric(final, "brisk:num_requests_running") == 0:
            break
        time.sleep(0.5)  # polling an observable condition with a deadline
    rss_end = {"server_mb": _rss_mb(server.pid), "processes_below_mb": _rss_below_mb(server.pid)}
    health = httpx.get(f"{url}/health", timeout=10).status_code
    server.send_signal(signal.SIGTERM)
    exit_code = server.wait(timeout=120)

    outcomes = Counter(result["outcomes"])
    failures = {k: v for k, v in outcomes.items() if not k.endswith((":ok", ":disconnected"))}
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs, {os.uname().machine}",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "requests": sum(outcomes.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "failures": failures,
        "preemptions": _metric(final, "brisk:num_preemptions_total"),
        "prefix_cache_hits_tokens": _metric(final, "brisk:prefix_cache_hits_total"),
        "host_tier_hits_tokens": _metric(final, "brisk:external_prefix_cache_hits_total"),
        "final_kv_usage": _metric(final, "brisk:kv_cache_usage_perc"),
        "final_health": health,
        "rss_start": rss_start,
        "rss_end": rss_end,
        "rss_max": {
            "server_mb": max(s["server_rss_mb"] for s in result["samples"]),
            "processes_below_mb": max(s["processes_below_rss_mb"] for s in result["samples"]),
        },
        "unhealthy_samples": sum(s["health"] != 200 for s in result["samples"]),
        "server_exit_code": exit_code,
        "samples": result["samples"],
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    print(
        "| requests | failures | preemptions | final KV usage | server RSS start/end/max MB | "
        "RSS of the processes below it (engine, ranks, API servers; summed) start/end/max MB | exit |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {summary['requests']} | {sum(failures.values())} | {summary['preemptions']:.0f} | "
        f"{summary['final_kv_usage']} | {rss_start['server_mb']:.0f} / {rss_end['server_mb']:.0f} / "
        f"{summary['rss_max']['server_mb']:.0f} | {rss_start['processes_below_mb']:.0f} / {rss_end['processes_below_mb']:.0f} / "
        f"{summary['rss_max']['processes_below_mb']:.0f} | {exit_code} |"
    )
    print("outcomes:", json.dumps(summary["outcomes"]))
    ok = not failures and summary["final_kv_usage"] == 0.0 and exit_code == 0 and health == 200
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
