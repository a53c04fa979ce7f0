"""Half-precision CPU matmuls at a few row counts (`brisk.layers.linear.onednn_rows`) against each at its own row
count: time and the memory oneDNN keeps, each case in a fresh process (oneDNN's kernel caches are per process).

    python benchmarks/bench_onednn_rows.py [--rounds 8] [--steps 120] [--out rows.json]

- engine: the bundled demo model (a tiny gpt-oss, bf16), one engine, `--rounds` rounds of 48 greedy requests of
  48 tokens (prompts of 5-40 tokens, every 8th of 900) over a 512-token step budget: steps of many sizes, as a
  server under load runs. Wall time of each round; the C heap in use (glibc's mallinfo2) and resident memory after
  the first round and after the last.
- matmuls: gpt-oss-20b's bf16 prompt-side matmuls (QKV 2880->5120, output 4096->2880, one expert's gate_up
  2880->5760 and down 2880->2880), `--steps` steps of random sizes in 17-2048 rows (one seed, the same in both
  cases): the wall time of all of them (the kernels made for new shapes included), the C heap in use after.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

CASES = ("each at its own rows", "onednn_rows")
PROMPT_SEED = 0  # the engine part's prompts, the same in both cases


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _heap_mb() -> float:
    """Bytes the C heap has handed out and not had back (glibc), in MB."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 1e6


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _use_case(case: str) -> None:
    if case == CASES[0]:
        import brisk.layers.linear as linear_module

        linear_module.onednn_rows = lambda x: x.shape[0]  # the A side of the A/B: every matmul at its own rows


def _engine_case(case: str, rounds: int) -> dict:
    import brisk
    from brisk import LLM, SamplingParams

    _use_case(case)
    rng = random.Random(PROMPT_SEED)
    demo = str(Path(brisk.__file__).parent / "demo_model")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    seconds, memory = [], []
    with LLM(demo, max_batch_size=16, max_num_tokens=512, max_seq_len=1024) as llm:
        for _ in range(rounds):
            prompts = [
                {"prompt_token_ids": [rng.randint(10, 4000) for _ in range(900 if i % 8 == 0 else rng.randint(5, 40))]}
                for i in range(48)
            ]
            start = time.perf_counter()
            llm.generate(prompts, params)
            seconds.append(time.perf_counter() - start)
            memory.append((_heap_mb(), _rss_mb()))
    return {"round_s": seconds, "heap_mb": [m[0] for m in memory], "rss_mb": [m[1] for m in memory]}


def _matmul_case(case: str, steps: int) -> dict:
    import torch

    from brisk.host import keep_freed_memory_in_the_heap
    from brisk.layers.linear import linear, prepack_cpu_weight

    _use_case(case)
    keep_freed_memory_in_the_heap()  # as the engine runs
    gen = torch.Generator().manual_seed(0)
    shapes = {"qkv": (5120, 2880), "o": (2880, 4096), "gate_up": (5760, 2880), "down": (2880, 2880)}
    weights = {name: torch.randn(shape, generator=gen).bfloat16() for name, shape in shapes.items()}
    packed = {name: prepack_cpu_weight(w) for name, w in weights.items() if name in ("qkv", "o")}
    rng = random.Random(1)
    sizes = [rng.randint(17, 2048) for _ in range(steps)]
    inputs = {k: torch.randn(2048, shape[1], generator=gen).bfloat16() for k, shape in shapes.items()}
    linear(inputs["qkv"][:64], weights["qkv"], None, packed.get("qkv"))  # the libraries' first-call set-up
    heap = _heap_mb()
    start = time.perf_counter()
    for rows in sizes:
        for name, weight in weights.items():
            linear(inputs[name][:rows], weight, None, packed.get(name))
    return {"seconds": time.perf_counter() - start, "heap_growth_mb": _heap_mb() - heap, "rows": sum(sizes)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--out", default=None)
    p.add_argument("--child", nargs=2, metavar=("PART", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        part, case = args.child
        result = _engine_case(case, args.rounds) if part == "engine" else _matmul_case(case, args.steps)
        print(json.dumps(result))
        return 0

    results: dict[str, dict] = {}
    for part in ("engine", "matmuls"):
        for case in CASES:
            command = [sys.executable, __file__, "--child", part, case, "--rounds", str(args.rounds)]
            command += ["--steps", str(args.steps)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results[f"{part}: {case}"] = json.loads(done.stdout.strip().splitlines()[-1])

    print(f"engine: the demo model, {args.rounds} rounds of 48 requests (48 tokens each, 512-token steps)\n")
    print("| case | first round s | later rounds s (median) | C heap MB after round 1 / last | RSS MB after 1 / last |")
    print("|---|---:|---:|---:|---:|")
    for case in CASES:
        r = results[f"engine: {case}"]
        later = sorted(r["round_s"][1:])[len(r["round_s"][1:]) // 2]
        print(
            f"| {case} | {r['round_s'][0]:.2f} | {later:.2f} | {r['heap_mb'][0]:.0f} / {r['heap_mb'][-1]:.0f} | "
            f"{r['rss_mb'][0]:.0f} / {r['rss_mb'][-1]:.0f} |"
        )
    print(f"\nmatmuls: gpt-oss-20b's four bf16 prompt-side shapes, {args.steps} steps of 17-2048 rows\n")
    print("| case | seconds | rows a second (each shape) | C heap growth MB |")
    print("|---|---:|---:|---:|")
    for case in CASES:
        r = results[f"matmuls: {case}"]
        print(f"| {case} | {r['seconds']:.2f} | {r['rows'] / r['seconds']:.0f} | {r['heap_growth_mb']:.0f} |")
    if args.out:
        meta = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "command": " ".join(sys.argv),
        }
        Path(args.out).write_text(json.dumps({**meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
