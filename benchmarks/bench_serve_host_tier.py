"""The host KV tier through the server: `brisk bench serve --multi-turn` against two `brisk serve`s, one run.

    python benchmarks/bench_serve_host_tier.py [--model PATH] [--conversations 8] [--turns 8] [--first-len 128]
                                               [--turn-len 32] [--output-len 8] [--max-batch-size 4]
                                               [--concurrency 4] [--pool-fraction 0.25] [--host-cache-mib 256]
                                               [--rounds 1] [--endpoint completions]
                                               [--out bench_results/serve_host_tier.json]

Two servers of the same model start side by side with the same small device KV pool (`kv_cache_config.max_blocks`:
--pool-fraction of the conversations' last-turn history, never less than a full batch needs): one without a host
tier (evicted prefix blocks are recomputed), one with `kv_cache_config.host_cache_size` (they are copied back).
Each round runs the same multi-turn workload (same seed) on one server, then the other, interleaved, so the
machine's load drift hits both alike; only one server works at a time. From each run: the prompt tokens the server
computed (prompt - usage.prompt_tokens_details.cached_tokens, summed over the requests), the tokens its host tier
gave back (/metrics brisk:external_prefix_cache_hits, read before and after), and mean TTFT (request sent to first
token; requests wait for a slot on the client, not in the server, so this is the prefill and the step it shares).
Prints a table and writes it as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from brisk.bench import serve as bench_serve
from brisk.bench.report import machine_info
from brisk.kv_cache.manager import cdiv

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "brisk" / "demo_model"
STARTUP_TIMEOUT_S = 300
CONFIGS = ("device pool only", "with host tier")


def kv_groups(model: str) -> int:
    """KV groups of the model (one per attention kind: full, sliding), which every token of a request occupies."""
    config = json.loads((Path(model) / "config.json").read_text())
    return len(set(config.get("layer_types") or ["full_attention"]))


class Server:
    """`brisk serve MODEL` with an extra_llm_api_options YAML, on a free port, its log in `log_path`."""

    def __init__(self, model: str, options: dict, flags: list[str], workdir: str, name: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = os.path.join(workdir, f"{name}.yaml")
        Path(config).write_text(yaml.safe_dump(options))
        self.log_path = os.path.join(workdir, f"{name}.log")
        cmd = [sys.executable, "-m", "brisk.cli", "serve", model, "--port", str(self.port)]
        cmd += ["--extra_llm_api_options", config, *flags]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # waiting for a separate process to come up
        raise RuntimeError(f"server not ready in {STARTUP_TIMEOUT_S} s; see {self.log_path}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bench(server: Server, args: argparse.Namespace, seed: int, out_dir: str) -> dict:
    """One `brisk bench serve --multi-turn` run against `server`; its multi-turn point."""
    argv = ["--base-url", server.url, "--endpoint", args.endpoint, "--multi-turn", str(args.turns)]
    argv += ["--num-conversations", str(args.conversations), "--concurrency", str(args.concurrency)]
    argv += ["--input-len", str(args.first_len), "--turn-input-len", str(args.turn_len)]
    argv += ["--output-len", str(args.output_len), "--warmup", "0", "--seed", str(seed), "--out-dir", out_dir]
    if bench_serve.main(argv) != 0:
        raise RuntimeError(f"brisk bench serve {' '.join(argv)} failed")
    (path,) = glob.glob(os.path.join(out_dir, "*.json"))
    (point,) = json.loads(Path(path).read_text())["points"]
    return point


def row(name: str, points: list[dict]) -> dict:
    summaries = [p["multi_turn"] for p in points]
    records = [r for p in points for r in p["requests"]]
    counters = [s["server_counters"] or {} for s in summaries]
    later = [r["ttft_ms"] for r in records if r["turn"]]
    return {
        "config": name,
        "requests": len(records),
        "prompt_tokens": sum(s["prompt_tokens"] for s in summaries),
        "computed_tokens": sum(s["computed_tokens"] for s in summaries),
        "cached_tokens": sum(s["cached_tokens"] for s in summaries),
        "host_hit_tokens": sum(c.get("external_prefix_cache_hits", 0.0) for c in counters),
        "bytes_to_host": sum(c.get("kv_offload_bytes_to_host", 0.0) for c in counters),
        "bytes_to_device": sum(c.get("kv_offload_bytes_to_device", 0.0) for c in counters),
        "preemptions": sum(c.get("num_preemptions", 0.0) for c in counters),
        "mean_ttft_ms": statistics.fmean(r["ttft_ms"] for r in records),
        "mean_ttft_later_turns_ms": statistics.fmean(later) if later else None,
        "duration_s": sum(p["duration_s"] for p in points),
        "ttft_by_turn_ms": [
            statistics.fmean(r["ttft_ms"] for r in records if r["turn"] == t)
            for t in range(len(summaries[0]["by_turn"]))
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--first-len", type=int, default=128)
    parser.add_argument("--turn-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (the client's limit)")
    parser.add_argument("--pool-fraction", type=float, default=0.25)
    parser.add_argument("--host-cache-mib", type=float, default=256)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="workloads run on both servers, interleaved")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--out", default="bench_results/serve_host_tier.json")
    args = parser.parse_args()

    # generous: the chat template and re-tokenized seams add a few tokens a turn
    final_len = args.first_len + args.turns * (args.turn_len + args.output_len) + 16 * args.turns
    per_conversation = kv_groups(args.model) * cdiv(final_len, args.block_size)
    history_blocks = per_conversation * args.conversations
    pool = max(int(history_blocks * args.pool_fraction), per_conversation * args.max_batch_size + 1)
    kv = {"max_blocks": pool, "tokens_per_block": args.block_size}
    flags = ["--max_batch_size", str(args.max_batch_size), "--max_seq_len", str(final_len + 64)]
    host_bytes = int(args.host_cache_mib * 2**20)
    workdir = tempfile.mkdtemp(prefix="bench-serve-host-tier-")
    servers = {
        CONFIGS[0]: Server(args.model, {"kv_cache_config": kv}, flags, workdir, "device"),
        CONFIGS[1]: Server(
            args.model, {"kv_cache_config": {**kv, "host_cache_size": host_bytes}}, flags, workdir, "host"
        ),
    }
    points: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    try:
        for server in servers.values():
            server.wait_ready()
        for r in range(args.rounds):
            for name, server in servers.items():  # interleaved; the same seed: the same conversations
                points[name].append(bench(server, args, seed=r, out_dir=os.path.join(workdir, f"{name}-{r}")))
    finally:
        for server in servers.values():
            server.stop()
    rows = [row(name, points[name]) for name in CONFIGS]
    base, tier = rows
    print(
        f"\n{args.conversations} conversations x {args.turns} turns x {args.rounds} round(s), /v1/{args.endpoint}, "
        f"{args.concurrency} requests in flight, batch {args.max_batch_size}; device pool {pool} blocks of "
        f"{args.block_size} (~{pool / history_blocks:.0%} of the last turn's history); host tier "
        f"{args.host_cache_mib:g} MiB\n"
    )
    header = ["config", "prompt tok", "computed", "cached", "host hits", "mean TTFT ms", "TTFT t>1 ms", "total s"]
    table = [header] + [
        [
            r["config"],
            f"{r['prompt_tokens']:,}",
            f"{r['computed_tokens']:,}",
            f"{r['cached_tokens']:,}",
            f"{r['host_hit_tokens']:,.0f}",
            f"{r['mean_ttft_ms']:.1f}",
            f"{r['mean_ttft_later_turns_ms'] or 0:.1f}",
            f"{r['duration_s']:.1f}",
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
    ratios = {
        "computed_tokens": tier["computed_tokens"] / base["computed_tokens"],
        "mean_ttft": tier["mean_ttft_ms"] / base["mean_ttft_ms"],
        "mean_ttft_later_turns": (tier["mean_ttft_later_turns_ms"] or 0) / (base["mean_ttft_later_turns_ms"] or 1),
        "duration": tier["duration_s"] / base["duration_s"],
    }
    print(
        f"with the host tier: {ratios['computed_tokens']:.2f}x the prompt tokens computed, mean TTFT "
        f"{ratios['mean_ttft']:.2f}x (turns 2+: {ratios['mean_ttft_later_turns']:.2f}x), total {ratios['duration']:.2f}x"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "load_average": os.getloadavg(),
        "platform": platform.platform(),
        "args": vars(args),
        "device_pool_blocks": pool,
        "history_blocks": history_blocks,
        "rows": rows,
        "ratios": ratios,
        "points": points,
    }
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out} (server logs in {workdir})")


if __name__ == "__main__":
    main()
