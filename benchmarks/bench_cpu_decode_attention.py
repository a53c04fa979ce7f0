"""brisk's C decode attention kernel on this CPU at gpt-oss's attention shapes: bf16 vs FP8 KV at long context.

    python benchmarks/bench_cpu_decode_attention.py [--isa avx512 avx2] [--cases 1x8192 8x8192 32x2048]
                                                    [--repeats 20] [--threads N]
                                                    [--out bench_results/cpu_decode_attention.json]

One call is one layer's decode step: `CpuKernels.decode_attention` for `batch` sequences with one new token each
over `context` cached tokens (64 query heads, 8 KV heads, head_dim 64, blocks of 32 tokens in shuffled order, with
sinks; FP8 with per-KV-head scales), on --threads threads (default: torch's count). Reported per instruction-set build, case and cache
dtype: ms per call (the median of --repeats calls after one warm-up call; a shared machine's noise is one-sided), the KV bytes the call reads over that time
(batch * context * 8 * 64 * 2 * bytes per element), and FP8's time over bf16's. The same script at an older commit
(PYTHONPATH=that checkout) gives a before / after.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_record import write_record  # benchmarks/ is on sys.path when run as a script

from brisk.kernels.cpu_kernels import load_cpu_kernels

ROOT = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 8, 64, 32
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def time_call(isa: str, batch: int, context: int, dtype: torch.dtype, repeats: int) -> float:
    """ms per decode_attention call."""
    kernels = load_cpu_kernels(isa)
    assert kernels is not None, f"the {isa} build did not load"
    gen = torch.Generator().manual_seed(0)
    pages = -(-context // BLOCK)
    num_blocks = batch * pages + 1  # block 0: the null block, never read
    block_tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, pages).to(torch.int32)
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in "kv")
    scales = torch.full((KV_HEADS,), 0.5) if dtype == torch.float8_e4m3fn else None
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(q)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    sinks = torch.randn(HEADS, generator=gen)

    def call() -> None:
        kernels.decode_attention(
            q, out, None, None, k_cache, v_cache, block_tables, seq_lens, sinks, HEAD_DIM**-0.5, None, scales, scales
        )

    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", nargs="+", default=["avx512", "avx2"])
    parser.add_argument("--cases", nargs="+", default=["1x8192", "8x8192", "32x2048"], help="batch x context")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=str(ROOT / "bench_results" / "cpu_decode_attention.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(
        f"{'isa':<8}{'batch':>6}{'context':>9}{'bf16 ms':>9}{'fp8 ms':>9}{'bf16 GB/s':>11}{'fp8 GB/s':>10}{'fp8/bf16':>10}"
    )
    for isa in args.isa:
        for case in args.cases:
            batch, context = (int(x) for x in case.split("x"))
            row: dict = {"isa": isa, "batch": batch, "context": context, "threads": torch.get_num_threads()}
            for name, dtype in DTYPES.items():
                ms = time_call(isa, batch, context, dtype, args.repeats)
                kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
                row[f"{name}_ms"], row[f"{name}_gb_s"] = ms, kv_bytes / ms / 1e6
            row["fp8_over_bf16"] = row["fp8_ms"] / row["bf16_ms"]
            rows.append(row)
            print(
                f"{isa:<8}{batch:>6}{context:>9}{row['bf16_ms']:>9.2f}{row['fp8_ms']:>9.2f}{row['bf16_gb_s']:>11.2f}"
                f"{row['fp8_gb_s']:>10.2f}{row['fp8_over_bf16']:>10.2f}"
            )
    write_record(args.out, args, rows=rows)


if __name__ == "__main__":
    main()
