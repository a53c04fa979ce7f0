"""Shared timing helpers for the GPU micro-benchmarks (CUDA events, optional CUDA-graph replay)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], iters: int, graph: bool, rounds: int = 1) -> float:
    """Mean milliseconds per call of fn, from CUDA events around `iters` back-to-back calls; with several rounds,
    the best round's (a GPU just out of idle clocks runs its first tens of milliseconds slower)."""
    for _ in range(3):  # compile / autotune / allocator warm-up
        fn()
    torch.cuda.synchronize()
    run: Callable[[], object] = fn
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm the side stream's allocator pool before capture
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    run()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def copy_gbps(num_bytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth (read + write), the ceiling the kernels are compared with."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * num_bytes / time_ms(lambda: dst.copy_(src), iters=20, graph=False, rounds=5) / 1e6  # ~0.15 s
