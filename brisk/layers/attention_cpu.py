"""CPU attention backend: the decode kernel of `brisk.kernels.cpu_kernels` behind `AttentionBackend`.

Sequences with one new token (every sequence of a decode step, the running ones of a mixed step) go to the C
kernel, which reads each sequence's KV blocks where they lie in the cache: no gather into a padded copy, no
masks, one call per layer whatever the batch. A sequence with a few new tokens (speculative decoding's 1 + k, up
to SHORT_QUERY_MAX) goes there too, each token as a sequence of its own that ends at it (causal by length). Longer
queries (prefill, prefill chunks) keep the reference's per-sequence path, whose matmuls are what a prompt needs. Both write rows of one fp32 output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from brisk.kernels.cpu_kernels import CACHE_DTYPE_CODES, CpuKernels
from brisk.layers.attention import Attention, AttentionMetadata, TorchAttentionBackend, store_kv
from brisk.layers.kv_fp8 import is_fp8


@dataclass
class _StepPlan:
    """One step's metadata as the kernel reads it, built once per step by `prepare` and read by every layer."""

    seq_lens: torch.Tensor  # [B] int32
    rows: torch.Tensor | None  # [Nd] int32 q rows of the one-new-token sequences; None: all of them, in order
    seq_ids: torch.Tensor | None  # [Nd] int32 their sequence indices; None as above
    num_decode: int
    has_multi_token: bool  # some sequence brings several new tokens (per-sequence path)
    torch_chunks: dict = field(default_factory=dict)  # the reference path's decode chunks (other cache dtypes)
    # Short multi-token queries, one kernel row per token: its q row, its sequence, its context length.
    short_rows: torch.Tensor | None = None
    short_seqs: torch.Tensor | None = None
    short_lens: torch.Tensor | None = None
    short_tables: dict = field(default_factory=dict)  # per KV group: the block table row of each token's sequence


SHORT_QUERY_MAX = 16  # new tokens of a sequence that the decode kernel takes one by one


def build_step_plan(meta: AttentionMetadata) -> _StepPlan:
    if meta.decode_only:
        seq_lens = meta.seq_lens_tensor
        if seq_lens is None:
            seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
        return _StepPlan(seq_lens, None, None, meta.num_seqs, False)
    qsl = meta.query_start_loc
    decode = [i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] == 1]
    seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int32)
    short = [i for i in range(meta.num_seqs) if 1 < qsl[i + 1] - qsl[i] <= SHORT_QUERY_MAX]
    has_multi = any(qsl[i + 1] - qsl[i] > SHORT_QUERY_MAX for i in range(meta.num_seqs))
    if len(decode) == meta.num_seqs:  # a pure decode step: row i is sequence i
        return _StepPlan(seq_lens, None, None, len(decode), has_multi)
    rows = torch.tensor([qsl[i] for i in decode], dtype=torch.int32)
    plan = _StepPlan(seq_lens, rows, torch.tensor(decode, dtype=torch.int32), len(decode), has_multi)
    if short:
        tok_rows, tok_seqs, tok_lens = [], [], []
        for i in short:
            n = qsl[i + 1] - qsl[i]
            for j in range(n):
                tok_rows.append(qsl[i] + j)
                tok_seqs.append(i)
                tok_lens.append(meta.seq_lens[i] - n + 1 + j)
        plan.short_rows = torch.tensor(tok_rows, dtype=torch.int32)
        plan.short_seqs = torch.tensor(tok_seqs, dtype=torch.int64)
        plan.short_lens = torch.tensor(tok_lens, dtype=torch.int32)
    return plan


class CpuAttentionBackend(TorchAttentionBackend):
    """Paged attention on CPUs. Share one instance across layers: the step plan is built once per step."""

    name = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        super().__init__()
        self.kernels = kernels

    @classmethod
    def supports(cls, device: torch.device, cpu_kernels: CpuKernels | None) -> bool:
        return device.type == "cpu" and cpu_kernels is not None

    @classmethod
    def create(cls, cpu_kernels: CpuKernels | None) -> CpuAttentionBackend:
        if cpu_kernels is None:
            raise ValueError("the CPU attention backend needs brisk's CPU kernels")
        return cls(cpu_kernels)

    def prepare(self, meta: AttentionMetadata) -> _StepPlan:
        return build_step_plan(meta)

    def _decode_chunks(self, meta: AttentionMetadata) -> dict:
        return meta.plan_for(self).torch_chunks

    def forward(self, layer: Attention, q, k, v, meta, sinks):
        if layer.k_cache.dtype not in CACHE_DTYPE_CODES:  # the kernel reads fp32, bf16 and FP8 E4M3 caches
            return super().forward(layer, q, k, v, meta, sinks)
        store_kv(layer, k, v, meta.slot_mappings[layer.kv_group])
        k_scales, v_scales = (layer.k_scale, layer.v_scale) if is_fp8(layer.k_cache) else (None, None)
        plan = meta.plan_for(self)
        qf = q.float()
        if qf.stride(2) != 1 or qf.stride(1) != qf.shape[2]:
            qf = qf.contiguous()
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if plan.num_decode:
            block_tables = meta.block_tables[layer.kv_group]
            if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
                block_tables = block_tables.to(torch.int32).contiguous()
            self.kernels.decode_attention(
                qf,
                out,
                plan.rows,
                plan.seq_ids,
                layer.k_cache,
                layer.v_cache,
                block_tables,
                plan.seq_lens,
                None if sinks is None else sinks.float(),
                layer.scale,
                layer.sliding_window,
                k_scales,
                v_scales,
            )
        if plan.short_rows is not None:
            assert plan.short_seqs is not None and plan.short_lens is not None
            tables = plan.short_tables.get(layer.kv_group)
            if tables is None:
                tables = meta.block_tables[layer.kv_group][plan.short_seqs].to(torch.int32).contiguous()
                plan.short_tables[layer.kv_group] = tables
            self.kernels.decode_attention(
                qf,
                out,
                plan.short_rows,
                None,
                layer.k_cache,
                layer.v_cache,
                tables,
                plan.short_lens,
                None if sinks is None else sinks.float(),
                layer.scale,
                layer.sliding_window,
                k_scales,
                v_scales,
            )
        if plan.has_multi_token:
            self._per_sequence(layer, q, meta, sinks, out, multi_token_only=True, max_query_len=SHORT_QUERY_MAX)
        return out.to(q.dtype)
