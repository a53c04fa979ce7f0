"""Paged-attention test cases shared by the kernel tests: a random step over a NaN-initialised paged cache
(shuffled block ids, spare null columns, released blocks before the window), run by any backend and compared
with the reference `TorchAttentionBackend`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.layers.attention import Attention, AttentionMetadata, TorchAttentionBackend


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    page: int  # KV cache block size
    block_n: int  # kernel KV tile


TINY = Shape(heads=4, kv_heads=2, head_dim=16, page=4, block_n=16)
REAL = Shape(heads=64, kv_heads=8, head_dim=64, page=32, block_n=64)


@dataclass
class Case:
    """One step over a paged cache: the inputs both backends get, plus fresh cache copies."""

    shape: Shape
    window: int | None
    meta: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def layer(self, backend) -> Attention:
        s = self.shape
        layer = Attention(s.heads, s.kv_heads, s.head_dim, s.head_dim**-0.5, 0, self.window)
        layer.k_cache, layer.v_cache, layer.backend = self.k_cache.clone(), self.v_cache.clone(), backend
        return layer

    def run(self, backend, use_sinks: bool) -> tuple[torch.Tensor, Attention]:
        layer = self.layer(backend)
        out = backend.forward(layer, self.q, self.k, self.v, self.meta, self.sinks if use_sinks else None)
        return out, layer

    def reference(self, use_sinks: bool) -> torch.Tensor:
        return self.run(TorchAttentionBackend(), use_sinks)[0]


def make_case(
    shape: Shape,
    specs: list[tuple[int, int]],  # per sequence: (new tokens, context length after the step)
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device = torch.device("cpu"),
) -> Case:
    """Random step with shuffled block ids, spare null columns, and released (null) blocks before the
    window. Cached context (the prefix) is filled in; everything never written stays NaN."""
    g = torch.Generator().manual_seed(seed)
    s = shape
    pages = [-(-seq_len // s.page) for _, seq_len in specs]
    num_blocks = 1 + sum(pages) + 3  # block 0 is the null block; a few spare ones leave holes
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    k_cache = torch.full((num_blocks, s.page, s.kv_heads, s.head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    width = max(pages) + 2
    tables, slots, qsl = [], [], [0]
    for (n_q, seq_len), n_pages in zip(specs, pages):
        ctx = seq_len - n_q
        first_k = 0 if window is None else max(0, ctx - window + 1)
        live = first_k // s.page  # pages before this one have been released to the null block
        row = [0] * live + [ids.pop() for _ in range(n_pages - live)]
        tables.append(row + [0] * (width - n_pages))
        # Cached context, written by earlier steps.
        cached = torch.tensor(
            [row[p // s.page] * s.page + p % s.page for p in range(live * s.page, ctx)], dtype=torch.long
        )
        for cache in (k_cache, v_cache):
            cache.view(-1, s.kv_heads, s.head_dim)[cached] = torch.randn(
                len(cached), s.kv_heads, s.head_dim, generator=g
            ).to(dtype)
        slots += [row[p // s.page] * s.page + p % s.page for p in range(ctx, seq_len)]
        qsl.append(qsl[-1] + n_q)
    t = qsl[-1]

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(dtype).to(device)

    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=[seq_len for _, seq_len in specs],
        block_tables=[torch.tensor(tables, dtype=torch.int32, device=device)],
        slot_mappings=[torch.tensor(slots, dtype=torch.int64, device=device)],
    )
    return Case(
        s,
        window,
        meta,
        rand(t, s.heads, s.head_dim),
        rand(t, s.kv_heads, s.head_dim),
        rand(t, s.kv_heads, s.head_dim),
        rand(s.heads) * 2,
        k_cache.to(device),
        v_cache.to(device),
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any()
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
