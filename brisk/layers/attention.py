"""Attention over the paged KV cache: the metadata a step carries, the layer, and the backend interface.

KV cache layout (per layer): `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim] (the
block size is the layer's KV group's: a group stored in FP8 beside one in the model's dtype holds more tokens a
block), in the model's dtype or FP8 E4M3 with the layer's static `k_scale` / `v_scale` [num_kv_heads] (layers/kv_fp8.py).
Block 0 is the null block: never allocated, it pads block tables and stands in for blocks a sliding
window has released. Each layer belongs to a KV group (full attention, sliding window); each group has
its own block table per request, see `kv_cache/manager.py`.

Backends implement `AttentionBackend.forward`. `TorchAttentionBackend` is the reference: exact, any
device (see its docstring for how it batches). The Triton backend (layers/attention_triton.py, GPUs) and the CPU
backend (layers/attention_cpu.py, a C decode kernel) plug in behind the same interface; layers/backends.py holds
the registry (`make_attention_backend` picks one) and the runner binds it to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from brisk.layers.kv_fp8 import as_bytes, dequantize_kv, is_fp8, quantize_kv

if TYPE_CHECKING:
    from brisk.kernels.cpu_kernels import CpuKernels


@dataclass
class AttentionMetadata:
    """Describes one forward step: B sequences, T new tokens laid out back to back."""

    query_start_loc: list[int]  # [B+1] offsets of each sequence's new tokens in the flat batch
    seq_lens: list[int]  # [B] context length after this step (cached + new)
    block_tables: list[torch.Tensor]  # per KV group: [B, max_blocks] int32, padded with the null block 0
    slot_mappings: list[torch.Tensor]  # per KV group: [T] int64 slot = block * block_size + offset; -1 skips
    dp_num_tokens: list[int] | None = None  # attention data parallel: T of every DP rank (MoE gathers them)
    # Static-buffer (CUDA graph) steps: the device copies of seq_lens / query_start_loc the backend must read
    # instead of building its own, and the bound on any context length (split-K sizes without a host sync).
    seq_lens_tensor: torch.Tensor | None = None  # [B] int32
    query_start_loc_tensor: torch.Tensor | None = None  # [B+1] int32
    max_seq_len: int | None = None
    decode_only: bool = False  # every sequence has one new token
    static_query_len: int = 0  # static-buffer steps: every sequence's new tokens (speculative verification: k + 1)
    # The backend's per-step metadata, built once by `AttentionBackend.prepare` and read by every layer.
    attn_plan: Any = field(default=None, repr=False)
    attn_plan_backend: Any = field(default=None, repr=False)  # the backend that built attn_plan

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def plan_for(self, backend: AttentionBackend) -> Any:
        """The step's plan; built here for metadata that no runner prepared (tests, direct layer calls)."""
        if self.attn_plan_backend is not backend:
            self.attn_plan, self.attn_plan_backend = backend.prepare(self), backend
        return self.attn_plan


class AttentionBackend:
    name = "base"
    # No host synchronisation, no data-dependent shapes in forward once prepared: a CUDA graph can capture it.
    graph_safe = False

    @classmethod
    def supports(cls, device: torch.device, cpu_kernels: CpuKernels | None) -> bool:
        """Whether this backend can run on `device` (auto picks the first registered one that can)."""
        return True

    @classmethod
    def create(cls, cpu_kernels: CpuKernels | None) -> AttentionBackend:
        return cls()

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Per-step metadata every layer of the step shares: called once per step, before the forward."""
        return None

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        meta: AttentionMetadata,
        sinks: torch.Tensor | None,  # [H] learned logits joined to the softmax denominator
    ) -> torch.Tensor:  # [T, H, D]
        raise NotImplementedError


class Attention(nn.Module):
    """Paged attention for one layer. The runner binds `k_cache`, `v_cache`, `kv_group` and `backend`."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_idx: int,
        sliding_window: int | None = None,
        first_kv_head: int = 0,
        model_num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        # This rank's KV heads among the model's (tensor parallel): where a checkpoint's per-head KV scales are
        self.first_kv_head = first_kv_head
        self.model_num_kv_heads = model_num_kv_heads or num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.kv_group = 0
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # An FP8 cache's static scales per KV head (fp32, on the layer's device): the checkpoint's, else 1.
        self.k_scale = torch.ones(num_kv_heads, dtype=torch.float32)
        self.v_scale = torch.ones(num_kv_heads, dtype=torch.float32)
        self.backend: AttentionBackend = TorchAttentionBackend()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KVH*D] (after RoPE); returns [T, H*D]."""
        t = q.shape[0]
        if t == 0:  # an idle attention-DP rank still runs the step for the MoE collectives
            return q
        out = self.backend.forward(
            self,
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            meta,
            sinks,
        )
        return out.reshape(t, self.num_heads * self.head_dim)


def store_kv(layer: Attention, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    flat_k = layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim)
    flat_v = layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim)
    if bool((slots < 0).any()):  # rare (slot -1: a token whose KV is not kept): drop those rows
        valid = slots >= 0
        slots, k, v = slots[valid], k[valid], v[valid]
    if is_fp8(flat_k):
        as_bytes(flat_k).index_copy_(0, slots, as_bytes(quantize_kv(k, layer.k_scale)))
        as_bytes(flat_v).index_copy_(0, slots, as_bytes(quantize_kv(v, layer.v_scale)))
        return
    flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, v.to(flat_v.dtype))


@dataclass
class _DecodeChunk:
    """What a slice of a pure-decode step's sequences needs per KV group (and window), built once per step and
    shared by every layer of the group: the blocks to gather, the padded positions to zero, the score bias."""

    seqs: slice  # which sequences of the batch
    blocks: torch.Tensor  # [n * blocks_per_seq] int64, each sequence's blocks back to back (null-padded)
    dead_rows: torch.Tensor  # rows of the gathered [n * padded] context that are not attended (zeroed)
    bias: torch.Tensor  # [n, 1, 1, padded] fp32: 0 where attended, -inf elsewhere


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention: causal, GQA, sliding window, sinks; softmax in fp32.

    Sequences with several new tokens (prefill, chunked prefill) are computed one at a time. A batch of
    pure decodes (one new token each: the common step of a busy CPU server) is computed at once: every
    sequence's blocks are gathered into one padded [B, KV heads, context, D] tensor and attended with two
    batched matmuls, so the step costs a fixed number of ops whatever the batch.
    """

    name = "torch"
    # Above this many context elements (batch x padded context x KV heads x head dim) a decode batch is
    # computed sequence by sequence instead, to bound the temporary memory.
    max_batched_decode_elements = 1 << 25
    # A decode batch is attended in chunks of sequences whose gathered fp32 keys fit in a core's L2 cache
    # (~512 KiB): each chunk's gather, copy and two matmuls then run on cache-hot data (measured 2x faster at
    # batch 32 than one pass over the whole batch: docs/performance.md).
    decode_chunk_elements = 1 << 17
    # A prompt's queries are attended in chunks whose fp32 scores (heads x queries x context) hold at most this many
    # elements: the temporaries of a 4,096-token gpt-oss-20b prompt were 4.3 GB a copy in one piece, and the C heap
    # keeps what a step frees (host.py), so a prompt's peak stayed in the process's RSS.
    prefill_score_elements = 1 << 22

    def prepare(self, meta: AttentionMetadata) -> Any:
        # Decode chunks per (KV group, window), filled by the first layer of each kind that runs the step.
        chunks: dict[tuple[int, int | None], tuple[int, list[_DecodeChunk]]] = {}
        return chunks

    def forward(self, layer, q, k, v, meta, sinks):
        store_kv(layer, k, v, meta.slot_mappings[layer.kv_group])
        if q.shape[0] == meta.num_seqs:
            padded, chunks = self._decode_plan(layer, meta)
            if meta.num_seqs * padded * layer.num_kv_heads * layer.head_dim <= self.max_batched_decode_elements:
                out = torch.empty_like(q)
                for chunk in chunks:
                    out[chunk.seqs] = self._decode_batch(layer, q[chunk.seqs], sinks, chunk, padded)
                return out
        return self._per_sequence(layer, q, meta, sinks)

    def _decode_chunks(self, meta: AttentionMetadata) -> dict[tuple[int, int | None], tuple[int, list[_DecodeChunk]]]:
        return meta.plan_for(self)

    def _decode_plan(self, layer: Attention, meta: AttentionMetadata) -> tuple[int, list[_DecodeChunk]]:
        """(padded context length, chunks) of this step's decode batch for the layer's KV group and window."""
        decode_chunks = self._decode_chunks(meta)
        key = (layer.kv_group, layer.sliding_window)
        plan = decode_chunks.get(key)
        if plan is None:
            bs, dev = layer.k_cache.shape[1], layer.k_cache.device
            blocks_per_seq = -(-max(meta.seq_lens) // bs)
            padded = blocks_per_seq * bs
            seq_lens = torch.tensor(meta.seq_lens, device=dev)
            pos = torch.arange(padded, device=dev)
            allowed = pos[None, :] < seq_lens[:, None]
            if layer.sliding_window is not None:
                allowed &= pos[None, :] >= (seq_lens - layer.sliding_window)[:, None]
            bias = torch.zeros(allowed.shape, device=dev).masked_fill_(~allowed, float("-inf"))
            blocks = meta.block_tables[layer.kv_group][:, :blocks_per_seq].long()
            per_chunk = max(1, self.decode_chunk_elements // (padded * layer.num_kv_heads * layer.head_dim))
            chunks = [
                _DecodeChunk(
                    seqs=slice(start, start + per_chunk),
                    blocks=blocks[start : start + per_chunk].reshape(-1),
                    dead_rows=(~allowed[start : start + per_chunk]).flatten().nonzero().flatten(),
                    bias=bias[start : start + per_chunk, None, None, :],
                )
                for start in range(0, meta.num_seqs, per_chunk)
            ]
            plan = decode_chunks[key] = (padded, chunks)
        return plan

    @staticmethod
    def _decode_batch(layer, q, sinks, chunk: _DecodeChunk, padded: int) -> torch.Tensor:
        """Every sequence has one new token (at position seq_len - 1): attend over the padded contexts at once."""
        b, kvh, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kvh

        def gather(cache: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:  # -> [B * kvh, padded, d] fp32
            rows = as_bytes(cache).index_select(0, chunk.blocks).view(b * padded, kvh * d)
            # Padding, released and not-yet-written slots hold whatever the pool last put there (NaN even):
            # zero them, so a -inf score times a zero value is all they contribute.
            rows.index_fill_(0, chunk.dead_rows, 0)
            # One copy to head-major fp32: bf16 bmm on CPU costs more per call than the conversion saves.
            out = torch.empty(b, kvh, padded, d, dtype=torch.float32, device=rows.device)
            out.copy_(rows.view(cache.dtype).view(b, padded, kvh, d).transpose(1, 2))
            if is_fp8(cache):
                out.mul_(kv_scale.view(1, kvh, 1, 1))
            return out.view(b * kvh, padded, d)

        k_ctx, v_ctx = gather(layer.k_cache, layer.k_scale), gather(layer.v_cache, layer.v_scale)
        scores = torch.bmm(q.reshape(b * kvh, group, d).float(), k_ctx.transpose(1, 2))
        scores = scores.view(b, kvh, group, padded) * layer.scale + chunk.bias
        if sinks is not None:
            scores = torch.cat([scores, sinks.float().view(1, kvh, group, 1).expand(b, kvh, group, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        out = torch.bmm(probs.reshape(b * kvh, group, padded), v_ctx)
        return out.view(b, layer.num_heads, d).to(q.dtype)

    def _per_sequence(
        self,
        layer,
        q,
        meta,
        sinks,
        out: torch.Tensor | None = None,
        multi_token_only: bool = False,
        max_query_len: int = 1,
    ) -> torch.Tensor:
        """Each sequence on its own (into `out` if given), its queries in chunks whose fp32 scores stay under
        `prefill_score_elements`; `multi_token_only` leaves the rows of sequences with at most `max_query_len` new
        tokens alone (another kernel computes them)."""
        out = torch.empty_like(q) if out is None else out
        for i, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            n_q = end - start
            if n_q == 0 or (multi_token_only and n_q <= max_query_len):
                continue
            rows = max(1, self.prefill_score_elements // (layer.num_heads * seq_len))
            for chunk_start in range(start, end, rows):
                chunk_end = min(end, chunk_start + rows)
                chunk_len = seq_len - (end - chunk_end)  # the context the chunk's last query sees
                out[chunk_start:chunk_end] = self._attend_queries(
                    layer,
                    q[chunk_start:chunk_end],
                    meta.block_tables[layer.kv_group][i],
                    chunk_len,
                    layer.k_cache.shape[1],
                    sinks,
                ).to(out.dtype)
        return out

    @staticmethod
    def _attend_queries(layer, q, block_table, seq_len: int, bs: int, sinks) -> torch.Tensor:
        """Consecutive queries q [n_q, heads, d] of one sequence, the last at position seq_len - 1, over its cached
        keys (causal, the layer's window) -> [n_q, heads, d] fp32."""
        kvh, d = layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // kvh
        window = layer.sliding_window
        n_q = q.shape[0]
        first_q_pos = seq_len - n_q
        # Keys older than the window are never read (their blocks may already be released).
        first_k = 0 if window is None else max(0, first_q_pos - window + 1)
        first_block = first_k // bs
        n_blocks = (seq_len + bs - 1) // bs
        blocks = block_table[first_block:n_blocks].long()
        k_ctx, v_ctx = (
            dequantize_kv(
                as_bytes(cache)
                .index_select(0, blocks)
                .view(cache.dtype)
                .reshape(-1, kvh, d)[: seq_len - first_block * bs],
                kv_scale,
            )
            for cache, kv_scale in ((layer.k_cache, layer.k_scale), (layer.v_cache, layer.v_scale))
        )
        k_pos = torch.arange(first_block * bs, seq_len, device=q.device)
        q_pos = torch.arange(first_q_pos, seq_len, device=q.device)
        qi = q.float().view(n_q, kvh, group, d)
        scores = torch.einsum("qhgd,khd->hgqk", qi, k_ctx) * layer.scale
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(kvh, group, 1, 1).expand(kvh, group, n_q, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        return torch.einsum("hgqk,khd->qhgd", probs, v_ctx).reshape(n_q, layer.num_heads, d)
