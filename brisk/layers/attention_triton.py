"""Triton attention backend: the GPU kernels of `brisk.kernels.triton_attention` behind `AttentionBackend`.

Mixed batches: sequences with one new token go to the split-K decode kernel, the others to the
prefill kernel; both write their own rows of one output tensor. The split costs nothing extra since
both kernels find their tokens through cu_seqlens (no gather or scatter of q/out), and it keeps each
kernel on its best shape: the prefill kernel's tiles would waste all but one token row on a decode
sequence, while the decode kernel packs the query heads of a KV head into the rows and splits long
contexts over many programs, which matters most when decodes dominate the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from brisk.host import to_device
from brisk.kernels.triton_attention import (
    default_prefill_block_q,
    fp8_as_codes,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tiles,
    store_kv_cache,
)
from brisk.layers.attention import Attention, AttentionBackend, AttentionMetadata
from brisk.layers.kv_fp8 import FP8_KV_DTYPE


@dataclass(frozen=True)
class Tiles:
    """Launch shapes of the attention kernels for one query dtype."""

    prefill_block_m: int  # tile rows (tokens x padded GQA group)
    prefill_block_n: int  # keys per tile
    prefill_warps: int
    decode_block_n: int
    decode_warps: int


# bf16 / fp16: tensor-core dots (the prefill's 128-row tiles on Hopper's warpgroup MMA), no spills on sm_90.
HALF_TILES = Tiles(prefill_block_m=128, prefill_block_n=64, prefill_warps=8, decode_block_n=64, decode_warps=4)
# fp32 multiplies in IEEE fp32 on the FMA units, every operand in registers: with the half-precision prefill tiles
# the kernel spills up to 17 KB a thread on sm_90 (tools/compile_kernels.py); these fit at head_dim 64 and 128 with
# Triton 3.6 and 3.9. The decode tiles fit as they are.
FP32_TILES = replace(HALF_TILES, prefill_block_m=32, prefill_block_n=16, prefill_warps=8)


@dataclass(frozen=True)
class _StepPlan:
    """Device-side view of one step's metadata, built once per step by `prepare` and read by every layer."""

    block_q: int
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    decode_seqs: torch.Tensor  # [Nd] int32 sequences with exactly one new token
    tile_seqs: torch.Tensor  # [Nt] int32 prefill tiles (sequence, first new token)
    tile_starts: torch.Tensor
    max_decode_len: int  # bound on the longest context among decode sequences (split-K sizes)
    max_decode_len_is_bound: bool = False  # a static-buffer step's bound (max_seq_len), not the batch's longest


def build_step_plan(meta: AttentionMetadata, block_q: int, device: torch.device) -> _StepPlan:
    if meta.decode_only and meta.seq_lens_tensor is not None and meta.query_start_loc_tensor is not None:
        # A static-buffer (CUDA graph) step: the buffers' own tensors, a bound instead of the maximum, no host data.
        n = meta.seq_lens_tensor.shape[0]
        empty = torch.empty(0, dtype=torch.int32, device=device)
        decode = torch.arange(n, dtype=torch.int32, device=device)
        bound = meta.max_seq_len or max(meta.seq_lens, default=0)
        return _StepPlan(
            block_q,
            meta.query_start_loc_tensor,
            meta.seq_lens_tensor,
            decode,
            empty,
            empty,
            bound,
            bool(meta.max_seq_len),
        )
    if meta.static_query_len > 1 and meta.seq_lens_tensor is not None and meta.query_start_loc_tensor is not None:
        # A static-buffer verification step (k + 1 tokens per sequence): its tiles follow from the shape alone.
        n, per = meta.seq_lens_tensor.shape[0], -(-meta.static_query_len // block_q)
        empty = torch.empty(0, dtype=torch.int32, device=device)
        tiles = torch.arange(n * per, dtype=torch.int32, device=device)
        return _StepPlan(
            block_q, meta.query_start_loc_tensor, meta.seq_lens_tensor, empty, tiles // per, (tiles % per) * block_q, 0
        )
    qsl, lens = list(meta.query_start_loc), list(meta.seq_lens)
    n_new = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
    decode_rows = [i for i, n in enumerate(n_new) if n == 1]
    prefill = [i for i, n in enumerate(n_new) if n > 1]  # n == 0: nothing to compute
    tile_seqs, tile_starts = prefill_tiles(qsl, lens, block_q, prefill)
    # One host-to-device copy for everything, sliced into views: pinned and asynchronous (a pageable copy would make
    # the host wait for the step in flight at the first attention layer of every eager step).
    cu, sl, dec, ts, tst = packed_on_device([qsl, lens, decode_rows, tile_seqs, tile_starts], device)
    return _StepPlan(block_q, cu, sl, dec, ts, tst, max((lens[i] for i in decode_rows), default=0))


ALIGN_INT32S = 4  # 16 bytes: the alignment Triton specialises a pointer argument on


def packed_on_device(segments: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int32 lists on the device by one copy, as views of one tensor, each starting 16-byte aligned: Triton
    compiles a kernel variant per pointer alignment, so views at batch-dependent offsets would compile new variants
    in the middle of serving (the interpreter never compiles, so CI cannot see it; tests check the offsets)."""
    starts, at = [], 0
    for seg in segments:
        starts.append(at)
        at += -(-len(seg) // ALIGN_INT32S) * ALIGN_INT32S
    flat = np.zeros(at, dtype=np.int32)
    for start, seg in zip(starts, segments):
        flat[start : start + len(seg)] = seg
    on_device = to_device(flat, device)
    return [on_device[start : start + len(seg)] for start, seg in zip(starts, segments)]


class TritonAttentionBackend(AttentionBackend):
    """Paged attention on the GPU. Share one instance across layers: the step plan (device copies of
    the metadata lists and the prefill tile list) is built once per step, in `prepare`."""

    name = "triton"
    graph_safe = True  # decode: static plan tensors, split-K sized for usual contexts under the max_seq_len bound

    def __init__(
        self,
        prefill_block_m: int | None = None,  # prefill tile rows (tokens x padded GQA group); None: the dtype's tiles
        prefill_block_n: int | None = None,
        decode_block_n: int | None = None,
        decode_partition_size: int | None = None,  # None: sized to fill the GPU
        fp8_codes: bool | None = None,  # an FP8 cache as E4M3 codes in uint8; None: where the GPU has no E4M3 type
    ) -> None:
        given = dict(prefill_block_m=prefill_block_m, prefill_block_n=prefill_block_n, decode_block_n=decode_block_n)
        self.tile_overrides = {name: size for name, size in given.items() if size is not None}
        self.decode_partition_size = decode_partition_size
        self.fp8_codes = fp8_codes  # resolved at the first FP8 cache (one backend serves one device)

    def tiles_for(self, dtype: torch.dtype) -> Tiles:
        """The launch shapes for queries of this dtype: the constructor's sizes where given, else the dtype's."""
        base = FP32_TILES if dtype == torch.float32 else HALF_TILES
        return replace(base, **self.tile_overrides)

    @classmethod
    def supports(cls, device: torch.device, cpu_kernels) -> bool:
        return device.type == "cuda"

    def prepare(self, meta: AttentionMetadata) -> dict[int, _StepPlan]:
        # Plans per prefill tile height, built by the first layer of each head layout (one for brisk's models).
        return {}

    def _step_plan(self, meta: AttentionMetadata, block_q: int, device: torch.device) -> _StepPlan:
        plans = meta.plan_for(self)
        plan = plans.get(block_q)
        if plan is None:
            plan = plans[block_q] = build_step_plan(meta, block_q, device)
        return plan

    def forward(
        self,
        layer: Attention,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        meta: AttentionMetadata,
        sinks: torch.Tensor | None,  # [H]
    ) -> torch.Tensor:
        g = layer.kv_group
        if self.fp8_codes is None and layer.k_cache.dtype == FP8_KV_DTYPE:
            self.fp8_codes = fp8_as_codes(layer.k_cache)
        codes = self.fp8_codes
        store_kv_cache(
            k, v, layer.k_cache, layer.v_cache, meta.slot_mappings[g], layer.k_scale, layer.v_scale, fp8_codes=codes
        )
        tiles = self.tiles_for(q.dtype)
        block_q = default_prefill_block_q(layer.num_heads, layer.num_kv_heads, tiles.prefill_block_m)
        plan = self._step_plan(meta, block_q, q.device)
        block_table = meta.block_tables[g]
        out = torch.empty_like(q)
        if plan.decode_seqs.numel():
            paged_decode_attention(
                q,
                layer.k_cache,
                layer.v_cache,
                block_table,
                plan.seq_lens,
                layer.scale,
                seq_ids=plan.decode_seqs,
                cu_seqlens_q=plan.cu_seqlens_q,
                max_seq_len=plan.max_decode_len,
                max_seq_len_is_bound=plan.max_decode_len_is_bound,
                block_n=tiles.decode_block_n,
                partition_size=self.decode_partition_size,
                num_warps=tiles.decode_warps,
                sliding_window=layer.sliding_window,
                sinks=sinks,
                out=out,
                k_scale=layer.k_scale,
                v_scale=layer.v_scale,
                fp8_codes=codes,
            )
        if plan.tile_seqs.numel():
            paged_prefill_attention(
                q,
                layer.k_cache,
                layer.v_cache,
                block_table,
                plan.cu_seqlens_q,
                plan.seq_lens,
                layer.scale,
                tile_seqs=plan.tile_seqs,
                tile_starts=plan.tile_starts,
                block_q=block_q,
                block_n=tiles.prefill_block_n,
                num_warps=tiles.prefill_warps,
                sliding_window=layer.sliding_window,
                sinks=sinks,
                out=out,
                k_scale=layer.k_scale,
                v_scale=layer.v_scale,
                fp8_codes=codes,
            )
        return out
