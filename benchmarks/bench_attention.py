"""Micro-benchmark of the Triton paged attention kernels at gpt-oss shapes (GPU only).

    python benchmarks/bench_attention.py [--batch 1 8 64] [--context 1024 8192] [--out attention.json]

Decode (one new token per sequence, bf16, 64 q heads / 8 KV heads, head_dim 64, block 32, shuffled block
ids): for each batch x context the timed call is `paged_decode_attention` (split-K kernel + reduce).
    KV GB/s     bytes of K and V the step must read (batch * context * KV heads * head_dim * 2 * 2) / time.
    copy GB/s   a device-to-device copy of a large buffer, (read + write bytes) / time: the practical ceiling.
    % copy      KV GB/s / copy GB/s.
Sliding-window rows (window 128) are timed too; their bytes count only the keys inside the window.
Distinct caches for enough layers to exceed L2 are cycled so every call reads cold KV, as in a real
forward pass. Timing replays a CUDA graph of those calls (no launch overhead) unless --eager.
A prefill row reports causal TFLOP/s for one fresh prompt of each context length.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from gpu_timing import copy_gbps, time_ms  # benchmarks/ is on sys.path when run as a script

HEADS, KV_HEADS, HEAD_DIM, PAGE = 64, 8, 64, 32
L2_FLUSH_BYTES = 256 << 20  # cycle caches until this much KV is touched per pass (> H100/H200 L2)


def paged_setup(batch: int, context: int, layers: int, gen: torch.Generator):
    pages = -(-context // PAGE)
    num_blocks = batch * pages + 1
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, pages).to(torch.int32).cuda()
    shape = (num_blocks, PAGE, KV_HEADS, HEAD_DIM)
    caches = [
        (
            torch.randn(shape, device="cuda", dtype=torch.bfloat16),
            torch.randn(shape, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(layers)
    ]
    return table, caches


def bench_decode(batch: int, context: int, window: int | None, graph: bool, gen: torch.Generator) -> dict:
    from brisk.kernels.triton_attention import default_partition_size, paged_decode_attention

    visible = context if window is None else min(context, window)
    kv_bytes = batch * visible * KV_HEADS * HEAD_DIM * 2 * 2
    layer_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2
    layers = max(1, min(64, -(-L2_FLUSH_BYTES // layer_bytes)))
    table, caches = paged_setup(batch, context, layers, gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    sinks = torch.randn(HEADS, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    seq_ids = torch.arange(batch, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

    def step() -> None:
        for k_cache, v_cache in caches:
            paged_decode_attention(
                q,
                k_cache,
                v_cache,
                table,
                seq_lens,
                HEAD_DIM**-0.5,
                sliding_window=window,
                sinks=sinks,
                out=out,
                seq_ids=seq_ids,
                cu_seqlens_q=cu,
                max_seq_len=context,
            )

    ms = time_ms(step, iters=20, graph=graph) / layers
    max_kv = context if window is None else min(context, window + 64)
    part = default_partition_size(batch, KV_HEADS, max_kv, 64, q.device)
    return dict(
        batch=batch,
        context=context,
        window=window,
        us=ms * 1e3,
        kv_gbps=kv_bytes / ms / 1e6,
        partition_size=part,
        partitions=-(-max_kv // part),
        layers_cycled=layers,
    )


def bench_prefill(context: int, window: int | None, graph: bool, gen: torch.Generator) -> dict:
    from brisk.kernels.triton_attention import default_prefill_block_q, paged_prefill_attention, prefill_tiles

    table, caches = paged_setup(1, context, 1, gen)
    k_cache, v_cache = caches[0]
    q = torch.randn(context, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu = torch.tensor([0, context], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    # The tile list is built once, outside the timing, as the backend does once per step.
    block_q = default_prefill_block_q(HEADS, KV_HEADS)
    seqs, starts = prefill_tiles([0, context], [context], block_q)
    ts = torch.tensor(seqs, dtype=torch.int32, device="cuda")
    tst = torch.tensor(starts, dtype=torch.int32, device="cuda")
    ms = time_ms(
        lambda: paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            table,
            cu,
            seq_lens,
            HEAD_DIM**-0.5,
            sliding_window=window,
            out=out,
            tile_seqs=ts,
            tile_starts=tst,
            block_q=block_q,
        ),
        iters=10,
        graph=graph,
    )
    pairs = context * (context + 1) / 2 if window is None else sum(min(i + 1, window) for i in range(context))
    flops = 4 * HEADS * HEAD_DIM * pairs  # QK^T and PV, 2 flops per multiply-add
    return dict(context=context, window=window, us=ms * 1e3, tflops=flops / ms / 1e9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--window", type=int, default=128, help="sliding window for the windowed rows (0: skip)")
    p.add_argument("--eager", action="store_true", help="time eager launches instead of a CUDA graph")
    p.add_argument("--out", help="write the results as JSON to this path")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU (the Triton kernels do not run compiled on CPU); none found.")

    gen = torch.Generator().manual_seed(0)
    graph = not args.eager
    copy = copy_gbps()
    windows: list[int | None] = [None] + ([args.window] if args.window else [])
    decode = [bench_decode(b, c, w, graph, gen) for w in windows for c in args.context for b in args.batch]
    prefill = [bench_prefill(c, w, graph, gen) for w in windows for c in args.context]

    print(
        f"device: {torch.cuda.get_device_name()}   copy: {copy:.0f} GB/s   timing: {'eager' if args.eager else 'cuda graph'}"
    )
    print(
        f"{'decode':>8} {'batch':>6} {'context':>8} {'window':>7} {'us':>9} {'KV GB/s':>9} {'% copy':>7} {'splits':>7}"
    )
    for r in decode:
        print(
            f"{'':>8} {r['batch']:>6} {r['context']:>8} {str(r['window'] or '-'):>7} {r['us']:>9.1f} "
            f"{r['kv_gbps']:>9.0f} {100 * r['kv_gbps'] / copy:>6.0f}% {r['partitions']:>7}"
        )
    print(f"{'prefill':>8} {'':>6} {'context':>8} {'window':>7} {'us':>9} {'TFLOP/s':>9}")
    for r in prefill:
        print(f"{'':>8} {'':>6} {r['context']:>8} {str(r['window'] or '-'):>7} {r['us']:>9.1f} {r['tflops']:>9.1f}")
    if args.out:
        result = dict(
            device=torch.cuda.get_device_name(),
            copy_gbps=copy,
            graph=graph,
            heads=HEADS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=PAGE,
            decode=decode,
            prefill=prefill,
        )
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
