"""Micro-benchmark of the fused Triton MoE layer at gpt-oss shapes (GPU only).

    python benchmarks/bench_moe.py [--batch 1 8 64 512] [--bf16-weights] [--kernels auto gemm gemv] [--out moe.json]

For each batch size T: random router logits -> top-k routing (outside the timing), then the timed
`fused_experts` (alignment, gate_up + SwiGLU, down + routing weight, sum over k) with random MXFP4 weights
(or bf16 with --bf16-weights). Reported:
    weight GB/s   bytes of the experts actually touched (packed blocks + scales + biases) / time. Each touched
                  expert's weights must be read once, so at decode this is the number to hold against copy GB/s.
    TFLOP/s       2 * T * k * (2I*H + H*I) / time (the useful matmul work).
    align us      the alignment alone (slots grouped by expert; one program up to 1024 slots, three launches past
                  that): its share of a layer at prefill sizes.
    copy GB/s     a device-to-device copy of a large buffer, (read + write bytes) / time: the practical ceiling.
--kernels times each batch with each named kernel, in one run: auto (default_config's choice), gemm (the
grouped tl.dot GEMM at every batch) and gemv (the MXFP4 decode GEMV at every batch; MXFP4 only), and prints
each against the first named (`vs first`).
Weights of --layers distinct layers are cycled through so each call finds its experts cold in L2, as in a real
forward pass. Timing replays a CUDA graph of all the layers (no launch overhead) unless --eager.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from gpu_timing import copy_gbps, time_ms  # benchmarks/ is on sys.path when run as a script


def random_layer(e: int, h: int, i: int, bf16_weights: bool, gen: torch.Generator) -> dict[str, torch.Tensor | None]:
    def randint(lo: int, hi: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(lo, hi, shape, dtype=torch.uint8, device="cuda", generator=gen)

    def randn(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) * std

    if bf16_weights:
        weights = dict(
            gate_up=randn((e, 2 * i, h), 0.02), gate_up_scales=None, down=randn((e, h, i), 0.02), down_scales=None
        )
    else:
        weights = dict(
            gate_up=randint(0, 256, (e, 2 * i, h // 32, 16)),
            gate_up_scales=randint(118, 122, (e, 2 * i, h // 32)),
            down=randint(0, 256, (e, h, i // 32, 16)),
            down_scales=randint(118, 122, (e, h, i // 32)),
        )
    return dict(weights, gate_up_bias=randn((e, 2 * i), 0.1), down_bias=randn((e, h), 0.1))


def expert_bytes(layer: dict[str, torch.Tensor | None]) -> int:
    """Bytes of one expert's weights, scales and biases."""
    return sum(t[0].numel() * t.element_size() for t in layer.values() if t is not None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 128, 256, 512, 8192])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--intermediate", type=int, default=2880)
    p.add_argument("--layers", type=int, default=4, help="distinct weight sets cycled per timed call (cold L2)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--bf16-weights", action="store_true", help="unquantized experts instead of MXFP4")
    p.add_argument("--eager", action="store_true", help="time eager launches instead of a CUDA graph replay")
    p.add_argument(
        "--kernels", nargs="+", choices=["auto", "gemm", "gemv"], default=["auto"], help="compare kernels, same run"
    )
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()

    if not torch.cuda.is_available():
        print(
            "bench_moe.py measures the Triton MoE kernels on a CUDA GPU; none is available here. "
            "(The kernels are checked on CPU by tests/test_triton_moe.py under TRITON_INTERPRET=1.)",
            file=sys.stderr,
        )
        return 2

    from brisk.kernels.triton_moe import default_config, fused_experts, moe_align_block_size
    from brisk.layers.moe import select_experts

    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [random_layer(e, h, i, args.bf16_weights, gen) for _ in range(args.layers)]
    per_expert = expert_bytes(layers[0])
    peak = copy_gbps()
    device = torch.cuda.get_device_name()
    print(
        f"{device}: E={e} top-{k} H={h} I={i} {'bf16' if args.bf16_weights else 'MXFP4'} weights, "
        f"{per_expert / 1e6:.1f} MB per expert, copy {peak:.0f} GB/s, {'eager' if args.eager else 'CUDA graph'}"
    )
    print(
        f"{'T':>5} {'kernel':>6} {'experts':>7} {'block_m':>7} {'us/layer':>9} {'weight GB/s':>11} {'% copy':>7} "
        f"{'TFLOP/s':>8} {'align us':>8} {'vs first':>8}"
    )
    gemv_up_to = {"auto": None, "gemm": -1.0, "gemv": float("inf")}
    mxfp4 = not args.bf16_weights

    rows = []
    for t, kernel in ((t, kernel) for t in args.batch for kernel in args.kernels):
        hidden = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16, generator=gen)
        topk_ids, topk_weights = select_experts(logits, k)
        touched = int(topk_ids.unique().numel())

        up_cfg = default_config(t, k, e, 2 * i, h, mxfp4=mxfp4, gemv_up_to=gemv_up_to[kernel])
        down_cfg = default_config(t, k, e, h, i, mxfp4=mxfp4, gemv_up_to=gemv_up_to[kernel])

        def forward(hidden=hidden, topk_ids=topk_ids, topk_weights=topk_weights, cfgs=(up_cfg, down_cfg)) -> None:
            for layer in layers:
                fused_experts(
                    hidden, topk_ids, topk_weights, **layer, swiglu_alpha=1.702, swiglu_limit=7.0, configs=cfgs
                )

        ms = time_ms(forward, args.iters, graph=not args.eager) / len(layers)
        gbps = touched * per_expert / ms / 1e6
        tflops = 2 * t * k * (2 * i * h + h * i) / ms / 1e9
        align_ms = (
            0.0  # the GEMV launches no alignment
            if up_cfg.gemv
            else time_ms(
                lambda ids=topk_ids, m=up_cfg.block_m: moe_align_block_size(ids, m, e), args.iters, graph=not args.eager
            )
        )
        first = next((r for r in rows if r["batch"] == t), None)
        vs_first = first["us_per_layer"] / (ms * 1e3) if first else 1.0  # > 1: this kernel is faster
        rows.append(
            dict(
                batch=t,
                kernel=kernel,
                gemv=up_cfg.gemv,
                speedup_vs_first=vs_first,
                experts_touched=touched,
                us_per_layer=ms * 1e3,
                weight_gbps=gbps,
                fraction_of_copy=gbps / peak,
                tflops=tflops,
                block_m=up_cfg.block_m,
                align_us=align_ms * 1e3,
            )
        )
        print(
            f"{t:>5} {kernel + ('*' if up_cfg.gemv else ''):>6} {touched:>7} {up_cfg.block_m:>7} {ms * 1e3:>9.1f} "
            f"{gbps:>11.0f} {100 * gbps / peak:>6.1f}% {tflops:>8.1f} {align_ms * 1e3:>8.1f} {vs_first:>7.2f}x"
        )

    if args.out:
        meta = dict(
            device=device,
            experts=e,
            top_k=k,
            hidden=h,
            intermediate=i,
            layers=args.layers,
            weights="bf16" if args.bf16_weights else "mxfp4",
            copy_gbps=peak,
            graph=not args.eager,
            torch=torch.__version__,
        )
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
