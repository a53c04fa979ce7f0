"""One gpt-oss-20b MoE layer on the CPU (32 MXFP4 experts of 2,880 x 2,880, top-4): before / after brisk's C
kernels read the experts in place.

    python benchmarks/bench_mxfp4_cpu.py [--tokens 1 4 16 512] [--threads 2] [--paths kernels torch] [--out x.json]

Paths: `kernels` = brisk's CPU kernels bound (decode-sized steps: one fused C call reading the packed E2M1 blocks
and E8M0 scales; prompt-sized: per-expert brisk_mxfp4_linear for up to MXFP4_DIRECT_MAX_ROWS rows, else one C pass
of dequantization to bf16 and torch's matmul); `torch` = what brisk ran before (every picked expert dequantized by
torch ops, then F.linear). bf16 activations, as served on a CPU with native bf16. Per point: the best of --repeats
calls, in ms; `GB/s` = bytes of the experts the step touches (blocks, scales, biases) / time, to hold against the
machine's read bandwidth (printed first). Random routing from a fixed seed; each call sees its experts cold in L2
only when the layer's 13 MB x touched experts outgrow it. On a shared machine read the ratios, not the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpt_oss_20b_cpu import read_bandwidth
from brisk.kernels.cpu_kernels import load_cpu_kernels
from brisk.layers.moe import FusedMoE, select_experts

E, K, H, INTER = 32, 4, 2880, 2880


def layer(gen: torch.Generator) -> FusedMoE:
    moe = FusedMoE(E, K, H, INTER, quantization="mxfp4").to(torch.bfloat16)
    for name, param in moe.named_parameters():
        if name.endswith("blocks"):
            param.data.copy_(torch.randint(0, 256, param.shape, dtype=torch.uint8, generator=gen))
        elif name.endswith("scales"):
            param.data.copy_(torch.randint(118, 122, param.shape, dtype=torch.uint8, generator=gen))
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
    return moe


def touched_bytes(moe: FusedMoE, ids: torch.Tensor) -> int:
    per_expert = sum(
        p[0].numel() * p.element_size()
        for p in (moe.gate_up_proj_blocks, moe.gate_up_proj_scales, moe.down_proj_blocks, moe.down_proj_scales)
    )
    per_expert += (moe.gate_up_proj_bias[0].numel() + moe.down_proj_bias[0].numel()) * 2
    return per_expert * len(torch.unique(ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 512])
    parser.add_argument("--paths", nargs="+", default=["kernels", "torch"], choices=["kernels", "torch"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(args.threads)
    print(f"read bandwidth, {args.threads} threads: {bandwidth:.1f} GB/s")
    gen = torch.Generator().manual_seed(0)
    moe = layer(gen)
    kernels = load_cpu_kernels("auto")
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, H, generator=gen).bfloat16()
        ids, weights = select_experts(torch.randn(tokens, E, generator=gen).bfloat16(), K)
        nbytes = touched_bytes(moe, ids)
        times = {}
        for path in args.paths:
            moe.cpu_kernels = kernels if path == "kernels" else None
            best = float("inf")
            for _ in range(args.repeats if path == "kernels" or tokens < 64 else 1):
                start = time.perf_counter()
                moe.backend.forward(moe, x, ids, weights)
                best = min(best, time.perf_counter() - start)
            times[path] = best
            rows.append(dict(tokens=tokens, path=path, ms=best * 1e3, gb_s=nbytes / best / 1e9))
        line = "  ".join(f"{p} {t * 1e3:9.1f} ms {nbytes / t / 1e9:6.1f} GB/s" for p, t in times.items())
        ratio = f"  torch / kernels {times['torch'] / times['kernels']:.1f}x" if len(times) == 2 else ""
        print(f"T={tokens:<4} experts touched {len(torch.unique(ids)):>2}  {line}{ratio}")
    if args.out:
        args.out.write_text(json.dumps(dict(bandwidth_gb_s=bandwidth, threads=args.threads, points=rows), indent=1))


if __name__ == "__main__":
    main()
