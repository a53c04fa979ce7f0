"""gpt-oss-20b at its real size on this CPU: brisk against llama.cpp on the same random weights, same client.

    python benchmarks/gpt_oss_20b_cpu.py [--peers brisk,llamacpp] [--label-suffix -after] [--threads N]

1. Measures the memory read bandwidth (a 2 GiB sum with the servers' thread count) and prints the decode roofline
   (the bytes one token reads: experts 1.27 GB in MXFP4, attention 1.27 GB and LM head 1.16 GB in bf16).
2. Writes a random gpt-oss-20b once (tests/gpt_oss_checkpoint.py: the public MXFP4 safetensors layout, the real
   o200k_harmony tokenizer; about 13 GB) into --work-dir, and converts it once with llama.cpp's
   convert_hf_to_gguf.py (bf16 for every tensor but the MXFP4 experts, which stay MXFP4).
3. Serves it with each peer in turn (never two at once: each needs ~13 GB), measures with `brisk bench serve`:
   output tok/s at concurrency 1 and 4 (128 prompt / 64 output tokens), the TTFT of a 512-token prompt, and the
   server's peak RSS (its process tree, sampled every 0.5 s), then stops it.
4. Prints a table (tok/s, the fraction of the bandwidth roofline, TTFT, RSS) and writes it to
   --out-dir/summary<suffix>.json with each bench run's JSON beside it.

llama.cpp comes from `bash benchmarks/compare_cpu.sh --peers llamacpp --setup-only` (llama-cpp-python[server]
compiled from its sdist into .peers/llamacpp, its converter beside it; about 8 minutes), or from any venv given
by --llama-python / --converter. Both servers get the same thread count (default: the cores but one, brisk's
own default; the last core runs the client). Takes ~30 min on a 2-core VM: writing the model ~5 min and
converting it ~5 min the first time, each server ~5-10 min.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GB = 1e9
# Bytes one decode step of one sequence reads at gpt-oss-20b's shapes (docs/performance.md; ANCHORS): 4 experts of
# 24 layers in MXFP4 (17 bytes a 32-value block), attention and the LM head in bf16. Router, norms and KV are small.
HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS, HEAD_DIM, ACTIVE = 2880, 2880, 24, 201_088, 64, 8, 64, 4
EXPERT_BYTES = LAYERS * ACTIVE * (2 * INTER * HIDDEN + HIDDEN * INTER) * 17 / 32
ATTENTION_BYTES = LAYERS * 2 * HIDDEN * (HEADS + 2 * KV_HEADS + HEADS) * HEAD_DIM
LM_HEAD_BYTES = 2 * VOCAB * HIDDEN
TOKEN_BYTES = EXPERT_BYTES + ATTENTION_BYTES + LM_HEAD_BYTES
SERVED_NAME = "gpt-oss-20b"
STARTUP_TIMEOUT_S = 1800


def read_bandwidth(threads: int, size: int = 2 << 30, repeats: int = 5) -> float:
    """GB/s of the best of `repeats` sums over `size` bytes (int64, so the adds never limit the reads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(size // 8, dtype=torch.int64)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return size / best / GB
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants (brisk runs its engine in a child process of its own session)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return tree


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            continue
    return total


class Server:
    """One server process (its own process group), its peak tree RSS sampled in a thread."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.log = open(log, "w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.peak_rss = 0
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._done.wait(0.5):
            self.peak_rss = max(self.peak_rss, tree_rss(self.proc.pid))

    def wait_ready(self, port: int) -> None:
        import urllib.request

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                    return
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"the server did not come up in {STARTUP_TIMEOUT_S} s; see {self.log.name}")

    def stop(self) -> None:
        self._done.set()
        tree = process_tree(self.proc.pid)  # the engine process too: it does not share the server's group
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in tree:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in tree):
                self.proc.poll()  # reaps the server; the engine is the server's to reap
                time.sleep(0.5)
        self.proc.wait()
        self.log.close()


def bench(
    port: int,
    model_dir: Path,
    out: Path,
    label: str,
    concurrency: str,
    input_len: int,
    output_len: int,
    num_prompts: int,
) -> dict[str, Any]:
    """One `brisk bench serve` run (completions; the tokenizer counts prompt tokens for servers without
    /tokenize); returns its JSON."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.json"))
    command = [
        str(ROOT / ".venv" / "bin" / "brisk"), "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
        "--model", SERVED_NAME, "--tokenizer", str(model_dir), "--label", label, "--out-dir", str(out),
        "--concurrency", concurrency, "--input-len", str(input_len), "--output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--warmup", "1", "--timeout", "3600",
    ]  # fmt: skip
    subprocess.run(command, check=True)
    (written,) = set(out.glob("*.json")) - before
    return json.loads(written.read_text())


def server_command(peer: str, args: argparse.Namespace, model_dir: Path, gguf: Path, port: int) -> list[str]:
    if peer == "brisk":
        return [
            str(args.brisk), "serve", str(model_dir), "--host", "127.0.0.1", "--port",
            str(port), "--served-model-name", SERVED_NAME, "--max_batch_size", "4", "--max_seq_len", "4096",
            "--extra_llm_api_options", str(args.out_dir / "brisk_options.yaml"),
        ]  # fmt: skip
    return [
        str(args.llama_python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port",
        str(port), "--model_alias", SERVED_NAME, "--n_ctx", "4096", "--n_threads", str(args.threads),
        "--n_threads_batch", str(args.threads), "--use_mmap", "false",
    ]  # fmt: skip


def convert(args: argparse.Namespace, model_dir: Path) -> Path:
    gguf = args.work_dir / "gpt-oss-20b-bf16.gguf"
    if not gguf.exists():
        log = args.work_dir / "convert.log"
        command = [str(args.converter_python), str(args.converter), str(model_dir), "--outfile", f"{gguf}.tmp"]
        with open(log, "w") as f:
            subprocess.run([*command, "--outtype", "bf16"], check=True, stdout=f, stderr=subprocess.STDOUT)
        os.replace(f"{gguf}.tmp", gguf)
    return gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="brisk,llamacpp")
    parser.add_argument("--work-dir", type=Path, default=ROOT / ".peers" / "gpt-oss-20b")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench_results" / "gpt-oss-20b-cpu")
    parser.add_argument("--label-suffix", default="", help="results as <peer><suffix> (e.g. brisk-before)")
    parser.add_argument(
        "--brisk",
        type=Path,
        default=ROOT / ".venv" / "bin" / "brisk",
        help="the brisk served (another checkout's, e.g. before a change); the client is always this checkout's",
    )
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) - 1))
    parser.add_argument("--llama-python", type=Path, default=ROOT / ".peers" / "llamacpp" / "bin" / "python")
    parser.add_argument("--converter", type=Path, default=ROOT / ".peers" / "llamacpp" / "convert_hf_to_gguf.py")
    parser.add_argument("--converter-python", type=Path, default=ROOT / ".peers" / "llamacpp" / "bin" / "python")
    parser.add_argument("--num-prompts", type=int, default=8, help="per concurrency level")
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "brisk_options.yaml").write_text(f"num_cpu_threads: {args.threads}\n")

    bandwidth = read_bandwidth(args.threads)
    ceiling = bandwidth * GB / TOKEN_BYTES
    print(f"read bandwidth ({args.threads} threads): {bandwidth:.1f} GB/s; a token reads {TOKEN_BYTES / GB:.2f} GB "
          f"(experts {EXPERT_BYTES / GB:.2f}, attention {ATTENTION_BYTES / GB:.2f}, LM head {LM_HEAD_BYTES / GB:.2f})"
          f": ceiling {ceiling:.1f} tok/s at concurrency 1")  # fmt: skip

    from tests.gpt_oss_checkpoint import write_gpt_oss_checkpoint

    model_dir = write_gpt_oss_checkpoint(args.work_dir / "model")
    peers = args.peers.split(",")
    gguf = convert(args, model_dir) if "llamacpp" in peers else Path()
    summary: dict[str, Any] = {"bandwidth_gb_s": bandwidth, "token_bytes": TOKEN_BYTES, "ceiling_tok_s": ceiling,
                               "threads": args.threads, "cpus": os.cpu_count(), "peers": {}}  # fmt: skip
    for peer in peers:
        name = f"{peer}{args.label_suffix}"
        out = args.out_dir / name
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        started = time.monotonic()
        server = Server(server_command(peer, args, model_dir, gguf, port), out / "server.log")
        try:
            server.wait_ready(port)
            ready_s = time.monotonic() - started
            decode = bench(port, model_dir, out, f"{name} decode", "1,4", 128, args.output_len, args.num_prompts)
            prompt = bench(port, model_dir, out, f"{name} 512-token prompt", "1", 512, 1, 3)
        finally:
            server.stop()
        by_conc = {p["concurrency"]: p for p in decode["points"]}
        summary["peers"][name] = {
            "ready_s": ready_s,
            "peak_rss_gb": server.peak_rss / GB,
            "tok_s": {str(c): p["output_throughput"] for c, p in by_conc.items()},
            "roofline_fraction_c1": by_conc[1]["output_throughput"] / ceiling,
            "ttft_512_ms": prompt["points"][0]["ttft_ms"]["p50"],
        }
        print(json.dumps({name: summary["peers"][name]}, indent=1))
    path = args.out_dir / f"summary{args.label_suffix}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{'server':<20} {'tok/s c=1':>10} {'tok/s c=4':>10} {'roofline c=1':>13} {'TTFT 512':>10} {'peak RSS':>9}")
    for name, r in summary["peers"].items():
        print(f"{name:<20} {r['tok_s'].get('1', 0):>10.2f} {r['tok_s'].get('4', 0):>10.2f} "
              f"{r['roofline_fraction_c1']:>12.0%} {r['ttft_512_ms'] / 1000:>9.1f}s {r['peak_rss_gb']:>8.1f}G")  # fmt: skip
    print(f"written: {path}")


if __name__ == "__main__":
    main()
