"""Micro-benchmark of random sampling on CPU: the torch sampler (exponential race: V exponential draws a row)
against the C sampler of brisk's CPU kernels (inverse transform: one uniform a row), through `Sampler`.

    python benchmarks/bench_cpu_sampler.py [--batch 1 8 32] [--vocab 4160 201088] [--threads 1] [--out s.json]

Each point samples [batch, vocab] random fp32 logits at temperature 1 (min of --rounds rounds of --iters calls).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone

import torch

from brisk.kernels.cpu_kernels import load_cpu_kernels
from brisk.model_runner.sampler import Sampler
from brisk.model_runner.sampling_batch import SamplingBatch
from brisk.sampling_params import SamplingParams


def time_us(fn, iters: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--vocab", type=int, nargs="+", default=[4160, 201088])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench_cpu_sampler.json")
    args = p.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        print("error: brisk's CPU kernels did not build (no C compiler?)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    samplers = {"torch": Sampler(), "brisk C": Sampler(kernels)}
    rows = []
    print(f"{'batch':>5} {'vocab':>7} {'torch us':>10} {'brisk C us':>11} {'speed-up':>9}")
    for vocab in args.vocab:
        for batch_size in args.batch:
            logits = torch.randn(batch_size, vocab)
            params = [SamplingParams(temperature=1.0)] * batch_size
            batch = SamplingBatch.build(
                params, [[]] * batch_size, [[]] * batch_size, [None] * batch_size, [set()] * batch_size, vocab, "cpu"
            )
            times = {
                name: time_us(lambda s=s, logits=logits, batch=batch: s(logits, batch), args.iters, args.rounds)
                for name, s in samplers.items()
            }
            rows.append(
                {"batch": batch_size, "vocab": vocab, "torch_us": times["torch"], "brisk_c_us": times["brisk C"]}
            )
            print(
                f"{batch_size:>5} {vocab:>7} {times['torch']:>10,.0f} {times['brisk C']:>11,.0f} "
                f"{times['torch'] / times['brisk C']:>8.1f}x"
            )
    with open(args.out, "w") as f:
        json.dump(
            {
                "command": " ".join(sys.argv),
                "machine": platform.processor() or platform.machine(),
                "threads": args.threads,
                "date": datetime.now(timezone.utc).isoformat(),
                "results": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
