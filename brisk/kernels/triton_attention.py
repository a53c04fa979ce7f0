"""Triton attention over brisk's paged KV cache (layout and semantics: `brisk/layers/attention.py`).

Three entry points:

* `store_kv_cache`: scatter the step's new K/V rows into their cache slots (slot -1 = skip).
* `paged_prefill_attention`: flash-attention style extend/prefill for sequences with several new tokens.
  The new tokens of a sequence sit at the end of its context, so a chunked or prefix-cached prefill
  attends to the cached context plus itself, causally.
* `paged_decode_attention`: one new token per sequence, split-K ("flash decoding"): each program reads
  one partition of the context and a small reduce kernel merges the partial (max, sum, acc) triples.

Shared design:

* GQA packing: one program serves every query head that shares a KV head, so each KV tile is loaded
  once per KV head rather than once per query head. The rows of the score matrix are
  (token, head-in-group) pairs.
* KV is gathered key by key through the block table (`block = table[k // PAGE]`), so the KV tile size
  `BLOCK_N` is independent of the cache's block size. Loads are masked to the keys a query may see,
  so blocks before the sliding window (the null block 0 once released) are never read.
* Softmax in fp32 base 2: the scale is folded with log2(e) and sinks are converted to base 2. A sink is
  one extra logit per head that joins the denominator but has no value row, so it simply seeds the
  running max at `sink` and the running sum at 1.
* FP8 KV cache (E4M3, static scales per KV head, layers/kv_fp8.py): the store kernel writes
  clamp(x / scale) in E4M3 (round to nearest even); the attention kernels convert the tiles to the
  query's dtype in registers (exact: E4M3 is a subset of bf16) and fold the K scale into the score
  scale and the V scale into the output, so accumulation stays fp32 and nothing else changes. Before sm_89
  (A100) Triton has no E4M3 type: the kernels then take the cache's bytes as uint8 codes (FP8_CODES) and
  convert with integer ops, bit for bit the same values.
* fp32 inputs multiply in IEEE fp32 (tf32 would miss the tests' tolerance); bf16/fp16 use tensor cores
  with fp32 accumulation. On the CPU interpreter every dot runs in fp32 because the interpreter's
  bf16 `tl.dot` is wrong (triton 3.9); operands are still rounded to the input dtype first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from brisk.kernels import interpreting
from brisk.layers.kv_fp8 import FP8_KV_DTYPE

LOG2E = 1.4426950408889634
TRITON_FP8_MIN_CAPABILITY = (8, 9)  # Triton's E4M3 type (fp8e4nv) exists from sm_89 (Ada, Hopper, Blackwell) on
# Integer arguments that change with the batch (its longest context, its block tables' width) are marked
# do_not_specialize: Triton would otherwise compile a variant for a value of 1 and for a multiple of 16, so a new
# batch shape in an eager step could stall serving for a compile.


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _use_f32_dot(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 or interpreting()


def _needs_64bit_offsets(cache: torch.Tensor) -> bool:
    return cache.numel() >= 2**31


def fp8_as_codes(cache: torch.Tensor, forced: bool | None = None) -> bool:
    """Whether an FP8 cache goes to the kernels as its E4M3 codes in uint8 (see _e4m3_decode): on a GPU before sm_89,
    where Triton has no E4M3 type, or where `forced` says so (the tests, the CPU interpreter)."""
    if cache.dtype != FP8_KV_DTYPE:
        return False
    if forced is not None:
        return forced
    return cache.is_cuda and torch.cuda.get_device_capability(cache.device) < TRITON_FP8_MIN_CAPABILITY


def _as_stored(cache: torch.Tensor, codes: bool) -> torch.Tensor:
    return cache.view(torch.uint8) if codes else cache


# ---------------------------------------------------------------------------------------------------
# KV store
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KVH_P: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_CODES: tl.constexpr,
):
    # One program per token: its K and V rows for all KV heads.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding or a token whose KV is not kept
        return
    h = tl.arange(0, KVH_P)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < NUM_KV_HEADS
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d, mask=mask)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr + h, mask=mask, other=1.0)
        v_scale = tl.load(v_scale_ptr + h, mask=mask, other=1.0)
        # Correctly rounded division (the GPU's `/` on fp32 is an approximate one): the stored codes are the torch
        # reference's bit for bit, also for a value on a rounding boundary of E4M3's grid.
        k = _round_to_e4m3(tl.math.div_rn(k.to(tl.float32), k_scale))
        v = _round_to_e4m3(tl.math.div_rn(v.to(tl.float32), v_scale))
        if FP8_CODES:
            k = _e4m3_encode(k)
            v = _e4m3_encode(v)
    tl.store(
        k_cache_ptr + slot * stride_kc_slot + h * stride_kc_head + d, k.to(k_cache_ptr.dtype.element_ty), mask=mask
    )
    tl.store(
        v_cache_ptr + slot * stride_vc_slot + h * stride_vc_head + d, v.to(v_cache_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _round_to_e4m3(x):
    """x saturated at +-448 and rounded to nearest even on E4M3's grid, in fp32: the cast that follows is exact. (The
    interpreter's own fp32 -> fp8 cast drops the carry when rounding up crosses a power of two: 1.99 -> 1.) NaN stays
    NaN, as in the torch store (a GPU's min / max drop it unless told): stored as E4M3's NaN, it makes what attends to
    it NaN too, so the non-finite guard fails the request instead of a saturated key deciding its softmax."""
    x = tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # E4M3 keeps 3 mantissa bits down to 2^-6, then subnormal steps of 2^-9.
    ulp = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0  # 1.5 * 2^23 ulps: adding it leaves x's bits below one ulp rounded away (to even)
    return (x + magic) - magic


# Before sm_89 Triton has no E4M3 type (fp8e4nv): an FP8 cache is then read and written as its E4M3 codes in uint8
# (FP8_CODES), converted by integer ops in registers. Same bytes in memory, so nothing else changes.
@triton.jit
def _e4m3_encode(r):
    """The E4M3 code (uint8) of r, an fp32 value already on E4M3's grid (_round_to_e4m3), -0 kept; NaN as torch's
    cast writes it (sign | 0x7F)."""
    bits = r.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exponent = (bits >> 23) & 0xFF  # fp32's biased exponent; E4M3's normals are 2^-6 (121) up
    normal = ((exponent - 120) << 3) | ((bits >> 20) & 0x7)
    subnormal = (tl.abs(r) * 512.0).to(tl.int32)  # k * 2^-9, k in 0..7
    magnitude = tl.where(exponent == 0xFF, 0x7F, tl.where(exponent >= 121, normal, subnormal))
    return (sign | magnitude).to(tl.uint8)


@triton.jit
def _e4m3_decode(code):
    """fp32 of E4M3 codes (uint8): 0x7F and 0xFF are NaN (a NaN stored), the other codes numbers."""
    c = code.to(tl.int32)
    exponent = (c >> 3) & 0xF
    mantissa = c & 0x7
    normal = (((c & 0x80) << 24) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2^-9
    subnormal = tl.where((c & 0x80) != 0, -subnormal, subnormal)
    value = tl.where(exponent == 0, subnormal, normal)
    nan = (c * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where((c & 0x7F) == 0x7F, nan, value)


def store_kv_cache(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [KVH] fp32: an FP8 cache's static scales
    v_scale: torch.Tensor | None = None,
    fp8_codes: bool | None = None,  # an FP8 cache as E4M3 codes (None: where the GPU has no E4M3 type)
) -> None:
    t, kvh, d = k.shape
    if t == 0:
        return
    _check_cache(k_cache, kvh, d)
    _check_cache(v_cache, kvh, d)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert slot_mapping.shape[0] == t
    codes = fp8_as_codes(k_cache, fp8_codes)
    _store_kv_kernel[(t,)](
        k,
        v,
        _as_stored(k_cache, codes),
        _as_stored(v_cache, codes),
        slot_mapping,
        *_scale_args(k_cache, k_scale, v_scale, slot_mapping),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=kvh,
        HEAD_DIM=d,
        KVH_P=_next_pow2(kvh),
        KV_FP8=k_cache.dtype == FP8_KV_DTYPE,
        FP8_CODES=codes,
    )


def _scale_args(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, dummy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 scale pointers a kernel takes (a dummy where the cache is not FP8)."""
    if k_cache.dtype != FP8_KV_DTYPE:
        return dummy, dummy
    assert k_scale is not None and v_scale is not None, "an FP8 KV cache needs its K and V scales"
    assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.numel() == k_cache.shape[2]
    return k_scale, v_scale


def _check_cache(cache: torch.Tensor, kvh: int, d: int) -> None:
    assert cache.dim() == 4 and cache.shape[2] == kvh and cache.shape[3] == d, "cache is [blocks, page, KVH, D]"
    assert cache.stride(3) == 1, "head_dim must be contiguous"
    # Flat slot addressing (slot = block * page + offset) needs blocks laid out back to back.
    assert cache.stride(0) == cache.shape[1] * cache.stride(1), "cache blocks must be dense"
    assert d >= 16 and d & (d - 1) == 0, "head_dim must be a power of two >= 16"


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, kvh: int, d: int) -> None:
    _check_cache(k_cache, kvh, d)
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(), "K and V caches share a layout"
    assert v_cache.dtype == k_cache.dtype


# ---------------------------------------------------------------------------------------------------
# Shared tile step
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    if F32_DOT:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,  # running state [M, D], [M], [M]; q [M, D]; q_pos [M]
    k_cache_ptr,
    v_cache_ptr,
    bt_row_ptr,
    kv_head,
    start,
    kv_lo,
    kv_hi,
    window,
    scale_log2,
    stride_b,
    stride_s,
    stride_h,  # cache strides (block, slot, head), shared by K and V
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    F32_DOT: tl.constexpr,
    OFFS_64: tl.constexpr,
    FP8_CODES: tl.constexpr,
):
    """Fold the keys [start, start + BLOCK_N) into the online softmax state.

    MASKED=False is the fast path for tiles that every row may see entirely: no load masks, no score
    masks. Otherwise keys outside [kv_lo, kv_hi) are not loaded and causal/window masks apply.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        in_range = (offs_n >= kv_lo) & (offs_n < kv_hi)
        block = tl.load(bt_row_ptr + offs_n // PAGE, mask=in_range, other=0)
    else:
        block = tl.load(bt_row_ptr + offs_n // PAGE)
    if OFFS_64:
        block = block.to(tl.int64)
    # K and V share one [N, D] offset tensor: the per-key gather's pointers are what fill the
    # registers, and 32-bit offsets (when the cache allows) halve them again.
    offs = (block * stride_b + (offs_n % PAGE) * stride_s + kv_head * stride_h)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_cache_ptr + offs, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + offs)
    if FP8_CODES:
        k = _e4m3_decode(k)
    k = k.to(q.dtype)

    s = _dot(q, tl.trans(k), F32_DOT) * scale_log2  # [M, N] logits in base 2
    if MASKED:
        allowed = in_range[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row may have seen nothing yet (max -inf); subtracting 0 instead keeps exp2 at 0 and NaN-free.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    if MASKED:
        v = tl.load(v_cache_ptr + offs, mask=in_range[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + offs)
    if FP8_CODES:
        v = _e4m3_decode(v)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_DOT)
    return acc, m_new, l_i


@triton.jit
def _init_state(sinks_ptr, head, row_valid, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr):
    if HAS_SINKS:
        # The sink is a logit with no value: seed the max with it and the sum with exp(sink - max) = 1.
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    return m_i, l_i


# ---------------------------------------------------------------------------------------------------
# Prefill / extend
# ---------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    sinks_ptr,
    block_table_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_b,
    stride_s,
    stride_h,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    F32_DOT: tl.constexpr,
    OFFS_64: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_CODES: tl.constexpr,
):
    # Program = (query tile, KV head). A tile is BLOCK_Q consecutive new tokens of one sequence; the
    # host lists the tiles (heaviest first), so no program is launched just to exit.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    tile_start = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(cu_q_ptr + seq)
    n_q = tl.load(cu_q_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - n_q  # new token i sits at position context_len + i
    if KV_FP8:  # the K scale joins the score scale (the V scale the output, below)
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)

    offs_m = tl.arange(0, BLOCK_M)
    tok = tile_start + offs_m // GROUP_P
    g = offs_m % GROUP_P
    head = kv_head * GROUP + g
    row_valid = (tok < n_q) & (g < GROUP)
    q_pos = context_len + tok
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = (q_begin + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )

    # Key range of the tile: causal bound from its last query, window bound from its first.
    pos_first = context_len + tile_start
    pos_last = context_len + tl.minimum(tile_start + BLOCK_Q, n_q) - 1
    kv_hi = pos_last + 1
    if HAS_WINDOW:
        kv_lo = tl.maximum(pos_first - window + 1, 0)
        # Tiles from full_lo on lie inside every row's window.
        full_lo = tl.minimum(tl.cdiv(tl.maximum(pos_last - window + 1, 0), BLOCK_N) * BLOCK_N, kv_hi)
    else:
        kv_lo = pos_first * 0
        full_lo = kv_lo
    kv_start = (kv_lo // BLOCK_N) * BLOCK_N
    # Tiles ending at or before pos_first + 1 are causally visible to every row.
    full_hi = tl.maximum((pos_first + 1) // BLOCK_N * BLOCK_N, full_lo)

    m_i, l_i = _init_state(sinks_ptr, head, row_valid, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt

    # Leading edge (window), unmasked middle, trailing edge (causal diagonal).
    for start in range(kv_start, full_lo, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            kv_head,
            start,
            kv_lo,
            kv_hi,
            window,
            scale_log2,
            stride_b,
            stride_s,
            stride_h,
            PAGE,
            BLOCK_N,
            HEAD_DIM,
            True,
            HAS_WINDOW,
            F32_DOT,
            OFFS_64,
            FP8_CODES,
        )
    for start in range(full_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            kv_head,
            start,
            kv_lo,
            kv_hi,
            window,
            scale_log2,
            stride_b,
            stride_s,
            stride_h,
            PAGE,
            BLOCK_N,
            HEAD_DIM,
            False,
            HAS_WINDOW,
            F32_DOT,
            OFFS_64,
            FP8_CODES,
        )
    for start in range(full_hi, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            kv_head,
            start,
            kv_lo,
            kv_hi,
            window,
            scale_log2,
            stride_b,
            stride_s,
            stride_h,
            PAGE,
            BLOCK_N,
            HEAD_DIM,
            True,
            HAS_WINDOW,
            F32_DOT,
            OFFS_64,
            FP8_CODES,
        )

    # Padding rows may have l == 0; they are not stored, the guard only keeps them NaN-free.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr + kv_head)
    tl.store(
        out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def default_prefill_block_q(num_heads: int, num_kv_heads: int, block_m: int = 128) -> int:
    """Tokens per prefill tile so that tile rows (tokens x padded group) come to about block_m (>= 16)."""
    group_p = _next_pow2(num_heads // num_kv_heads)
    return max(1, block_m // group_p, _cdiv(16, group_p))


def prefill_tiles(
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    block_q: int,
    seqs: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Host-side tile list (sequence, first new token) for `paged_prefill_attention`.

    Tiles are ordered by decreasing key count, so the longest programs start first and short ones
    fill in the tail of the launch.
    """
    if seqs is None:
        seqs = range(len(seq_lens))
    tiles: list[tuple[int, int, int]] = []
    for i in seqs:
        n_q = query_start_loc[i + 1] - query_start_loc[i]
        context = seq_lens[i] - n_q
        tiles.extend((context + min(s + block_q, n_q), i, s) for s in range(0, n_q, block_q))
    tiles.sort(key=lambda t: -t[0])
    return [t[1] for t in tiles], [t[2] for t in tiles]


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D] new tokens of all sequences, back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32 offsets of each sequence's new tokens in q
    seq_lens: torch.Tensor,  # [B] int32 context length including the new tokens
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [H]
    out: torch.Tensor | None = None,
    tile_seqs: torch.Tensor | None = None,  # [num_tiles] int32, from `prefill_tiles` (built here if None)
    tile_starts: torch.Tensor | None = None,  # [num_tiles] int32
    block_q: int | None = None,  # tokens per tile; must match the tiles passed in
    block_n: int = 64,
    num_warps: int = 8,  # 128x64 tiles at head_dim 64: ~150 registers, no spills on sm_90
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,  # [KVH] fp32: an FP8 cache's static scales
    v_scale: torch.Tensor | None = None,
    fp8_codes: bool | None = None,  # an FP8 cache as E4M3 codes (None: where the GPU has no E4M3 type)
) -> torch.Tensor:
    """Causal attention of every listed tile's new tokens over the paged context. Rows of `out`
    belonging to sequences without tiles are left untouched."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    _check_caches(k_cache, v_cache, kvh, d)
    assert h % kvh == 0 and q.stride(-1) == 1
    assert block_table.stride(1) == 1
    group = h // kvh
    if block_q is None:
        block_q = default_prefill_block_q(h, kvh)
    if out is None:
        out = torch.empty_like(q)
    if tile_seqs is None or tile_starts is None:
        seqs, starts = prefill_tiles(cu_seqlens_q.tolist(), seq_lens.tolist(), block_q)
        tile_seqs = torch.tensor(seqs, dtype=torch.int32, device=q.device)
        tile_starts = torch.tensor(starts, dtype=torch.int32, device=q.device)
    num_tiles = tile_seqs.shape[0]
    if num_tiles == 0 or t == 0:
        return out
    group_p = _next_pow2(group)
    assert block_q * group_p >= 16 and block_n >= 16, "tl.dot needs tiles of at least 16"
    window = sliding_window if sliding_window is not None else 0
    codes = fp8_as_codes(k_cache, fp8_codes)
    _prefill_kernel[(num_tiles, kvh)](
        q,
        _as_stored(k_cache, codes),
        _as_stored(v_cache, codes),
        out,
        sinks if sinks is not None else q,
        block_table,
        cu_seqlens_q,
        seq_lens,
        tile_seqs,
        tile_starts,
        *_scale_args(k_cache, k_scale, v_scale, seq_lens),
        scale * LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=d,
        PAGE=k_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_M=block_q * group_p,
        BLOCK_N=block_n,
        HAS_SINKS=sinks is not None,
        HAS_WINDOW=sliding_window is not None,
        F32_DOT=_use_f32_dot(q),
        OFFS_64=_needs_64bit_offsets(k_cache),
        KV_FP8=k_cache.dtype == FP8_KV_DTYPE,
        FP8_CODES=codes,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------------
# Decode (split-K)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _decode_range(seq_len, window, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """First visible key and the tile-aligned base the partitions are counted from."""
    if HAS_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    else:
        kv_lo = seq_len * 0
    return kv_lo, (kv_lo // BLOCK_N) * BLOCK_N


@triton.jit(do_not_specialize=["partition_size", "max_parts", "stride_bt"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    sinks_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    block_table_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    decode_seq_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    window,
    partition_size,
    max_parts,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_b,
    stride_s,
    stride_h,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    F32_DOT: tl.constexpr,
    OFFS_64: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_CODES: tl.constexpr,
):
    # Program = (decode sequence, KV head, partition). Rows are the GROUP query heads of the KV head.
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq = tl.load(decode_seq_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo, kv_base = _decode_range(seq_len, window, BLOCK_N, HAS_WINDOW)
    p_lo = kv_base + part * partition_size
    if p_lo >= seq_len:  # the grid is sized for the longest sequence
        return
    p_hi = tl.minimum(p_lo + partition_size, seq_len)
    if KV_FP8:  # the K scale joins the score scale, the V scale the (partial) output: the reduce is linear in it
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)

    g = tl.arange(0, GROUP_P)
    head = kv_head * GROUP + g
    row_valid = g < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q_row = tl.load(cu_q_ptr + seq).to(tl.int64)
    q = tl.load(
        q_ptr + q_row * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_valid[:, None], other=0.0
    )
    q_pos = tl.full([GROUP_P], 0, tl.int32) + (seq_len - 1)

    if SPLIT:
        # Sinks join once, in the reduce; a partition only sees its keys.
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
    else:
        m_i, l_i = _init_state(sinks_ptr, head, row_valid, GROUP_P, HAS_SINKS)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt

    # Decode is bandwidth-bound: every tile takes the masked path (masks are per key, so loads stay
    # vectorized along head_dim) and the loop stays small.
    for start in range(p_lo, p_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            kv_head,
            start,
            kv_lo,
            p_hi,
            window,
            scale_log2,
            stride_b,
            stride_s,
            stride_h,
            PAGE,
            BLOCK_N,
            HEAD_DIM,
            True,
            HAS_WINDOW,
            F32_DOT,
            OFFS_64,
            FP8_CODES,
        )

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    if SPLIT:
        # Partial state: m (base 2), l, and the unnormalised acc, indexed [i, head, part].
        idx = (i * NUM_HEADS + head).to(tl.int64) * max_parts + part
        tl.store(part_m_ptr + idx, m_i, mask=row_valid)
        tl.store(part_l_ptr + idx, l_i, mask=row_valid)
        tl.store(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + q_row * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )


@triton.jit(do_not_specialize=["partition_size", "max_parts"])
def _decode_reduce_kernel(
    out_ptr,
    sinks_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    decode_seq_ptr,
    window,
    partition_size,
    max_parts,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PART_CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    # Program = (decode sequence, query head): log-sum-exp merge of the partitions, plus the sink.
    i = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(decode_seq_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo, kv_base = _decode_range(seq_len, window, BLOCK_N, HAS_WINDOW)
    # At most the partitions launched: a sequence longer than the host's bound must never read past its own
    # [max_parts] slice (another head's or sequence's partials).
    num_parts = tl.minimum(tl.cdiv(seq_len - kv_base, partition_size), max_parts)

    if HAS_SINKS:
        m = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_sum = tl.full([], 1.0, tl.float32)
    else:
        m = tl.full([], float("-inf"), tl.float32)
        l_sum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    base = (i * NUM_HEADS + head).to(tl.int64) * max_parts
    offs_d = tl.arange(0, HEAD_DIM)
    # Every launched partition holds at least one visible key, so its m is finite and so is the max.
    for c in range(0, num_parts, PART_CHUNK):
        offs_p = c + tl.arange(0, PART_CHUNK)
        valid = offs_p < num_parts
        m_p = tl.load(part_m_ptr + base + offs_p, mask=valid, other=float("-inf"))
        l_p = tl.load(part_l_ptr + base + offs_p, mask=valid, other=0.0)
        acc_p = tl.load(
            part_acc_ptr + (base + offs_p)[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0
        )
        m_new = tl.maximum(m, tl.max(m_p, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(m_p - m_new)
        l_sum = l_sum * alpha + tl.sum(l_p * w, 0)
        acc = acc * alpha + tl.sum(acc_p * w[:, None], 0)
        m = m_new
    q_row = tl.load(cu_q_ptr + seq).to(tl.int64)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d, (acc / l_sum).to(out_ptr.dtype.element_ty))


def default_partition_size(
    num_seqs: int, num_kv_heads: int, max_kv: int, block_n: int, device: torch.device, min_size: int = 256
) -> int:
    """Split long contexts until the launch has about two programs per SM.

    Sizes are block_n times a power of two so they change rarely as contexts grow. Returns a size
    >= max_kv (one partition, no reduce) when the batch alone fills the GPU.
    """
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want_parts = max(1, _cdiv(2 * sms, max(1, num_seqs * num_kv_heads)))
    size = max(_cdiv(max_kv, want_parts), min_size, block_n)
    return block_n * _next_pow2(_cdiv(size, block_n))


# A CUDA graph's decode attention knows its contexts only by a bound (max_seq_len, often 131,072): its split-K is
# sized as for contexts of this many keys, so that usual contexts still spread over the GPU (sized from the bound, a
# batch of 8 at an 8k context would run 64 programs on 132 SMs, one at 1k 8), longer ones taking more partitions; the
# partial results of the bound's partitions stay under PARTIAL_BYTES_CAP (the partition size doubles until they do).
BOUNDED_SIZING_KEYS = 8192
PARTIAL_BYTES_CAP = 64 << 20


def bounded_partition_size(
    num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_kv: int, block_n: int, device: torch.device
) -> int:
    """Keys per split-K program for a launch whose contexts are bounded by `max_kv` but usually far shorter."""
    size = default_partition_size(num_seqs, num_kv_heads, min(max_kv, BOUNDED_SIZING_KEYS), block_n, device)
    while size < max_kv and num_seqs * num_heads * _cdiv(max_kv, size) * (head_dim + 2) * 4 > PARTIAL_BYTES_CAP:
        size *= 2
    return size


def paged_decode_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32 context length including the new token
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [H]
    out: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,  # [N] int32 sequences to decode (default: all B)
    cu_seqlens_q: torch.Tensor | None = None,  # [B+1] int32; token of sequence s is cu_seqlens_q[s] (default s)
    max_seq_len: int | None = None,  # host bound on seq_lens[seq_ids]; read from the GPU if None
    max_seq_len_is_bound: bool = False,  # max_seq_len is a bound (CUDA graphs), not the batch's longest context
    block_n: int = 64,
    partition_size: int | None = None,  # keys per split-K program, a multiple of block_n
    num_warps: int = 4,
    num_stages: int = 3,
    k_scale: torch.Tensor | None = None,  # [KVH] fp32: an FP8 cache's static scales
    v_scale: torch.Tensor | None = None,
    fp8_codes: bool | None = None,  # an FP8 cache as E4M3 codes (None: where the GPU has no E4M3 type)
) -> torch.Tensor:
    """Attention for sequences with exactly one new token (the last position of their context)."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    _check_caches(k_cache, v_cache, kvh, d)
    assert h % kvh == 0 and q.stride(-1) == 1
    assert block_table.stride(1) == 1 and block_n >= 16
    if out is None:
        out = torch.empty_like(q)
    b = seq_lens.shape[0]
    if seq_ids is None:
        seq_ids = torch.arange(b, dtype=torch.int32, device=q.device)
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    n = seq_ids.shape[0]
    if n == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens[seq_ids.long()].max())
    max_kv = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_n)
    if partition_size is None and max_seq_len_is_bound:
        partition_size = bounded_partition_size(n, h, kvh, d, max_kv, block_n, q.device)
    elif partition_size is None:
        partition_size = default_partition_size(n, kvh, max_kv, block_n, q.device)
    assert partition_size % block_n == 0, "partition_size must be a multiple of block_n"
    # A sequence visits at most max_kv keys: partitions start at the tile holding the window's first key.
    max_parts = _cdiv(max_kv, partition_size)
    split = max_parts > 1
    group = h // kvh
    window = sliding_window if sliding_window is not None else 0
    f32 = torch.float32
    part_m = torch.empty((n, h, max_parts), dtype=f32, device=q.device) if split else out
    part_l = torch.empty((n, h, max_parts), dtype=f32, device=q.device) if split else out
    part_acc = torch.empty((n, h, max_parts, d), dtype=f32, device=q.device) if split else out
    sinks_arg = sinks if sinks is not None else q
    codes = fp8_as_codes(k_cache, fp8_codes)
    _decode_kernel[(n, kvh, max_parts)](
        q,
        _as_stored(k_cache, codes),
        _as_stored(v_cache, codes),
        out,
        sinks_arg,
        part_m,
        part_l,
        part_acc,
        block_table,
        cu_seqlens_q,
        seq_lens,
        seq_ids,
        *_scale_args(k_cache, k_scale, v_scale, seq_lens),
        scale * LOG2E,
        window,
        partition_size,
        max_parts,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=h,
        GROUP=group,
        GROUP_P=max(16, _next_pow2(group)),
        HEAD_DIM=d,
        PAGE=k_cache.shape[1],
        BLOCK_N=block_n,
        HAS_SINKS=sinks is not None,
        HAS_WINDOW=sliding_window is not None,
        SPLIT=split,
        F32_DOT=_use_f32_dot(q),
        OFFS_64=_needs_64bit_offsets(k_cache),
        KV_FP8=k_cache.dtype == FP8_KV_DTYPE,
        FP8_CODES=codes,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _decode_reduce_kernel[(n, h)](
            out,
            sinks_arg,
            part_m,
            part_l,
            part_acc,
            cu_seqlens_q,
            seq_lens,
            seq_ids,
            window,
            partition_size,
            max_parts,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=h,
            HEAD_DIM=d,
            BLOCK_N=block_n,
            PART_CHUNK=16,  # one variant whatever the partition count (masked lanes cost nothing here)
            HAS_SINKS=sinks is not None,
            HAS_WINDOW=sliding_window is not None,
            num_warps=1 if d <= 64 else 2,
        )
    return out
