"""Fused MoE Triton kernels for gpt-oss experts: MXFP4 (W4A16) or bf16 weights, bf16 activations.

Pipeline for hidden [T, H] and a routing topk_ids / topk_weights [T, k] ("slot" s = t * k + j names one pick):
    route_topk            one Triton program a token: top-k of the router logits, softmax over those k, and under
                          EP the ids made local (-1, weight 0: another rank's expert). torch.topk + softmax were
                          three launches a layer, 312 us of a 7.7 ms batch-1 step of 120b on the first H100 run.
    moe_align_block_size  one Triton program: slots grouped by expert, each expert's run padded to BLOCK_M,
                          the expert of every BLOCK_M block. Experts nobody picked get no blocks. Sized by an
                          upper bound, so there is no host sync and the pipeline can be captured in a CUDA graph.
    decode (MXFP4, up to a slot per expert): no alignment; _moe_gemv_kernel runs gate_up, then down, a slot a
                          program, on the CUDA cores (see its docstring for why), epilogues as below.
    fused_moe_gate_up     grouped GEMM per block: hidden rows @ gate_up[e]^T + bias, clamped SwiGLU in the
                          epilogue -> act [T*k, I] (bf16, one row per slot).
    fused_moe_down        grouped GEMM: act @ down[e]^T + bias, times the routing weight -> [T*k, H], then a
                          sum over k -> [T, H].

Combining in fused_moe_down writes [T, k, H] and sums with torch rather than atomically adding into [T, H]:
the result is deterministic (atomics make the rounding order, and so the logits, vary run to run), needs no
zero-filled fp32 buffer or final cast, and the extra traffic (T*k*H*2 bytes written and read once) is small
next to the weights at decode and next to the FLOPs at prefill.

MXFP4 weights are read packed (half a byte per weight plus one scale byte per 32) and dequantized in
registers: each nibble is moved into an fp16 bit pattern (no lookup table), scaled by 2^(s-127) built from
the scale byte's bits, cast to the activation dtype and fed to tl.dot with fp32 accumulation. Because the
slots are grouped by expert, each program reads one expert's weight tile once for up to BLOCK_M slots; at
decode every touched expert's weights are read exactly once when BLOCK_M covers its slots (default_config
picks BLOCK_M = 16 for small batches, and the GEMV below a slot per expert with MXFP4 weights).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from brisk.kernels import interpreting

MXFP4_GROUP = 32  # values sharing one E8M0 scale; also the K granularity of the MXFP4 kernels
_GROUP: tl.constexpr = tl.constexpr(MXFP4_GROUP)  # the same, readable from inside @triton.jit code
# The token counts (num_slots, num_m_blocks, max_blocks, num_chunks) change with every batch: marked
# do_not_specialize, so a count of 1 or a multiple of 16 does not compile a variant of its own in the middle of
# serving.


# ---------------------------------------------------------------- routing


@triton.jit
def _route_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    stride_l,
    E,
    first_expert,
    num_local,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    # NaN counts as the largest (as torch.topk has it): its weights come out NaN for the non-finite guard, and the
    # picked ids stay in range
    x = tl.where(x != x, float("inf"), x)
    ks = tl.arange(0, K_P2)
    values = tl.full([K_P2], float("-inf"), tl.float32)
    ids = tl.zeros([K_P2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):  # k rounds of max, descending as torch.topk; ties: the lowest id
        best = tl.max(x, axis=0)
        pick = tl.min(tl.where(x == best, offs, BLOCK_E), axis=0)
        values = tl.where(ks == j, best, values)
        ids = tl.where(ks == j, pick, ids)
        x = tl.where(offs == pick, float("-inf"), x)
    # softmax over the k in fp32, rounded once to the logits' dtype (torch.softmax(..., dtype=logits.dtype))
    e = tl.where(ks < TOP_K, tl.exp(values - tl.max(values, axis=0)), 0.0)
    weights = e / tl.sum(e, axis=0)
    local = ids - first_expert
    here = (local >= 0) & (local < num_local)
    weights = tl.where(here, weights, 0.0)
    k_mask = ks < TOP_K
    tl.store(ids_ptr + row * TOP_K + ks, tl.where(here, local, -1).to(ids_ptr.dtype.element_ty), mask=k_mask)
    tl.store(weights_ptr + row * TOP_K + ks, weights.to(weights_ptr.dtype.element_ty), mask=k_mask)


def route_topk(
    router_logits: torch.Tensor, top_k: int, first_expert: int = 0, num_local: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing (brisk.layers.moe.select_experts' math) in one launch: ids [T, k] (int64; this rank's
    local ids, -1 for experts outside first_expert .. first_expert + num_local), weights [T, k] in the logits'
    dtype (0 for -1 slots)."""
    t, e = router_logits.shape
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=logits.dtype, device=logits.device)
    if t:
        _route_kernel[(t,)](
            logits, ids, weights, logits.stride(0), e, first_expert, e if num_local is None else num_local,
            TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(e), num_warps=1,
        )  # fmt: skip
    return ids, weights


# ---------------------------------------------------------------- alignment


@dataclass(frozen=True)
class MoEAlignment:
    """Slots grouped by expert for the grouped GEMMs.

    sorted_token_ids int32 [max_blocks * block_m]: slot ids (t * k + j), each expert's run padded to block_m
        with `num_slots` (an invalid slot the GEMMs mask out). Entries past num_tokens_post_padded are padding.
    expert_ids int32 [max_blocks]: expert of each block_m block; -1 past the last used block.
    num_tokens_post_padded int32 [1]: used length of sorted_token_ids.
    """

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    block_m: int
    num_slots: int


# At most this many chunks of slots (tokens x top_k) are aligned by one program (one launch: batch 1 and small
# batches); more are split over programs of a chunk each (three launches), since one program walks its chunks in
# turn, twice (count, scatter): at E = 128 a chunk is 64 slots, and a decode batch of 256 rows (1024 slots) would be
# 16 + 16 serial iterations with block-wide reductions each, estimated 40-70 us a layer from the sm_90 code (the
# three launches: ~10-15 us); a long prefill (32k slots) a millisecond or more.
ONE_PROGRAM_MAX_CHUNKS = 2
ALIGN_CHUNK_ELEMS = 8192  # slots x experts of one one-hot tile: keeps registers in check at E = 128 (64 slots)


@triton.jit
def _expert_onehot(topk_ids_ptr, offs, num_slots, num_experts, E_P2: tl.constexpr):
    """[len(offs), E_P2] one-hot of the slots' experts; -1 (another EP rank's expert) and out-of-range ids and
    slots past the end match no expert. Also the ids, -1 where none."""
    ids = tl.load(topk_ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32)
    ids = tl.where(ids < num_experts, ids, -1)
    return (ids[:, None] == tl.arange(0, E_P2)[None, :]).to(tl.int32), ids


@triton.jit
def _write_runs(
    counts,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_slots,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    """From the slots per expert: each expert owns a run of sorted_token_ids padded to a multiple of BLOCK_M (an
    empty expert's run is empty, so it gets no blocks); writes the used length, each block's expert and padding
    everywhere in sorted_token_ids. Returns the runs' starts."""
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_post_padded_ptr, tl.sum(padded, axis=0))
    # The expert of block b is the one whose run contains b * BLOCK_M, i.e. the number of runs that end at or
    # before it (empty runs before it are counted too, which keeps the index right). Past the end: all runs.
    for b0 in range(0, max_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        owner = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(expert_ids_ptr + blocks, owner, mask=blocks < max_blocks)
    # Every slot of the buffer starts as padding; the scatter then overwrites the real ones.
    total_len = max_blocks * BLOCK_M
    for p0 in range(0, total_len, FILL):
        offs = p0 + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + offs, tl.zeros([FILL], dtype=tl.int32) + num_slots, mask=offs < total_len)
    return ends - padded


@triton.jit
def _scatter_chunk(topk_ids_ptr, sorted_ids_ptr, offs, first, num_slots, num_experts, E_P2: tl.constexpr):
    """Slot s of the chunk goes to `first` of its expert + the number of the chunk's earlier slots with the same
    expert (stable order). Returns the chunk's slots per expert."""
    onehot, ids = _expert_onehot(topk_ids_ptr, offs, num_slots, num_experts, E_P2)
    before = tl.cumsum(onehot, axis=0) - onehot + first[None, :]
    dest = tl.sum(onehot * before, axis=1)
    tl.store(sorted_ids_ptr + dest, offs, mask=(offs < num_slots) & (ids >= 0))
    return tl.sum(onehot, axis=0)


@triton.jit(do_not_specialize=["num_slots", "max_blocks"])
def _moe_align_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_slots,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    # A single program (up to ONE_PROGRAM_MAX_SLOTS): at decode the whole job is a few hundred integer ops, and
    # one launch beats a count/offsets/scatter chain. One-hot rows summed over each chunk: deterministic, no atomics.
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        onehot, _ = _expert_onehot(topk_ids_ptr, start + tl.arange(0, CHUNK), num_slots, num_experts, E_P2)
        counts += tl.sum(onehot, axis=0)
    starts = _write_runs(
        counts, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, num_slots, num_experts, max_blocks,
        BLOCK_M, CHUNK, FILL,
    )  # fmt: skip
    tl.debug_barrier()  # the scatter rewrites some of the padding's addresses from other threads of this program
    seen = tl.zeros([E_P2], dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        seen += _scatter_chunk(topk_ids_ptr, sorted_ids_ptr, offs, starts + seen, num_slots, num_experts, E_P2)


@triton.jit(do_not_specialize=["num_slots"])
def _moe_count_kernel(topk_ids_ptr, chunk_counts_ptr, num_slots, num_experts, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    # Program c: the slots per expert of chunk c, a row of chunk_counts [num_chunks, E_P2].
    c = tl.program_id(0)
    onehot, _ = _expert_onehot(topk_ids_ptr, c * CHUNK + tl.arange(0, CHUNK), num_slots, num_experts, E_P2)
    tl.store(chunk_counts_ptr + c * E_P2 + tl.arange(0, E_P2), tl.sum(onehot, axis=0))


@triton.jit(do_not_specialize=["num_slots", "max_blocks", "num_chunks"])
def _moe_runs_kernel(
    chunk_counts_ptr,
    chunk_first_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_slots,
    num_experts,
    max_blocks,
    num_chunks,
    BLOCK_M: tl.constexpr,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    FILL: tl.constexpr,
):
    # One program: the experts' runs from the chunks' counts, and chunk_first [num_chunks, E_P2], where each
    # chunk's slots of each expert begin (the run's start + the earlier chunks' slots of that expert).
    experts = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        tile = tl.load(
            chunk_counts_ptr + rows[:, None] * E_P2 + experts[None, :], mask=rows[:, None] < num_chunks, other=0
        )
        counts += tl.sum(tile, axis=0)
    running = _write_runs(
        counts, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, num_slots, num_experts, max_blocks,
        BLOCK_M, CHUNK, FILL,
    )  # fmt: skip
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        at = rows[:, None] * E_P2 + experts[None, :]
        tile = tl.load(chunk_counts_ptr + at, mask=rows[:, None] < num_chunks, other=0)
        tl.store(
            chunk_first_ptr + at, tl.cumsum(tile, axis=0) - tile + running[None, :], mask=rows[:, None] < num_chunks
        )
        running += tl.sum(tile, axis=0)


@triton.jit(do_not_specialize=["num_slots"])
def _moe_scatter_kernel(
    topk_ids_ptr, chunk_first_ptr, sorted_ids_ptr, num_slots, num_experts, E_P2: tl.constexpr, CHUNK: tl.constexpr
):
    # Program c: chunk c's slots to their places (after _moe_runs_kernel wrote the padding: stream order).
    c = tl.program_id(0)
    first = tl.load(chunk_first_ptr + c * E_P2 + tl.arange(0, E_P2))
    _scatter_chunk(topk_ids_ptr, sorted_ids_ptr, c * CHUNK + tl.arange(0, CHUNK), first, num_slots, num_experts, E_P2)


def max_num_blocks(num_slots: int, block_m: int, num_experts: int) -> int:
    """Upper bound on sum_e ceil(count_e / block_m): every expert with slots adds at most one partial block."""
    return triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, one_program_max_slots: int | None = None
) -> MoEAlignment:
    """Group the slots of topk_ids [T, k] by expert, padded per expert to block_m (see MoEAlignment).
    Up to one_program_max_slots slots (default ONE_PROGRAM_MAX_CHUNKS chunks) in one launch, more over programs of a
    chunk each (three launches)."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_slots = ids.numel()
    max_blocks = max_num_blocks(num_slots, block_m, num_experts)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    e_p2 = triton.next_power_of_2(num_experts)
    # One chunk size per expert count whatever the batch (a batch-dependent constexpr would compile per batch).
    chunk = max(16, ALIGN_CHUNK_ELEMS // e_p2)
    runs = (sorted_ids, expert_ids, num_post_padded)
    if one_program_max_slots is None:
        one_program_max_slots = ONE_PROGRAM_MAX_CHUNKS * chunk
    if num_slots <= one_program_max_slots:
        _moe_align_kernel[(1,)](
            ids, *runs, num_slots, num_experts, max_blocks, BLOCK_M=block_m, E_P2=e_p2, CHUNK=chunk, FILL=1024,
            num_warps=4,
        )  # fmt: skip
    else:
        num_chunks = triton.cdiv(num_slots, chunk)
        chunk_counts = torch.empty(num_chunks, e_p2, dtype=torch.int32, device=ids.device)
        chunk_first = torch.empty_like(chunk_counts)
        _moe_count_kernel[(num_chunks,)](ids, chunk_counts, num_slots, num_experts, E_P2=e_p2, CHUNK=chunk)
        _moe_runs_kernel[(1,)](
            chunk_counts, chunk_first, *runs, num_slots, num_experts, max_blocks, num_chunks, BLOCK_M=block_m,
            E_P2=e_p2, CHUNK=chunk, ROWS=max(1, ALIGN_CHUNK_ELEMS // e_p2 // 4), FILL=1024, num_warps=4,
        )  # fmt: skip
        _moe_scatter_kernel[(num_chunks,)](ids, chunk_first, sorted_ids, num_slots, num_experts, E_P2=e_p2, CHUNK=chunk)
    return MoEAlignment(sorted_ids, expert_ids, num_post_padded, block_m, num_slots)


# ---------------------------------------------------------------- MXFP4 in registers


@triton.jit
def _e2m1_raw(nibble):
    # E2M1 nibble = sign | exponent (2 bits, bias 1) | mantissa (1 bit). Put the sign at fp16 bit 15 and the other
    # three bits at fp16 bits 11..9 (exponent field's low bits + mantissa's top bit): the fp16 number is exactly
    # value * 2^-14 (0.5 becomes an fp16 subnormal, which the conversion to fp32 handles exactly). Shifts, an or
    # and a conversion: no table lookup.
    bits = ((nibble & 0x8).to(tl.uint16) << 12) | ((nibble & 0x7).to(tl.uint16) << 9)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_to_f32(nibble):
    # The value itself: an exact multiply. (Folding the 2^14 into the scale would save it but overflow scales
    # above 240; the GEMV folds it into the activations instead.)
    return _e2m1_raw(nibble) * 16384.0


@triton.jit
def _e8m0_to_f32(scale):
    # 2^(s - 127) is s in the fp32 exponent field; s = 0 (2^-127) is the one subnormal: mantissa bit 22.
    # s = 255 gives inf, as the torch reference (exp2(128) in fp32) does.
    s = scale.to(tl.uint32)
    return tl.where(s == 0, s + 0x400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_mxfp4_tile(
    w_ptr,
    s_ptr,
    offs_n,
    n_mask,
    k0,
    K,
    stride_wn,
    stride_sn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Weights [BLOCK_N, BLOCK_K] (fp32) of rows offs_n, inputs k0 .. k0 + BLOCK_K, from one expert's packed rows.

    A row of blocks [K/32, 16] is K/2 contiguous bytes (byte i holds inputs 2i, 2i+1), so the tile is a plain
    [BLOCK_N, BLOCK_K/2] byte load: 16-byte vectors along K, no gather. Its scales are [BLOCK_N, BLOCK_K/32].
    """
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs_g = k0 // _GROUP + tl.arange(0, BLOCK_K // _GROUP)
    b_mask = n_mask[:, None]
    g_mask = n_mask[:, None]
    if not EVEN_K:  # K is a multiple of 32, so the tail is whole groups: mask whole bytes and scales
        b_mask = b_mask & (offs_b < K // 2)[None, :]
        g_mask = g_mask & (offs_g < K // _GROUP)[None, :]
    packed = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=b_mask, other=0)
    scales = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :], mask=g_mask, other=127)
    # Low nibble first: interleave puts lo[i], hi[i] at columns 2i, 2i+1.
    values = tl.interleave(_e2m1_to_f32(packed & 0xF), _e2m1_to_f32(packed >> 4))
    values = tl.reshape(values, [BLOCK_N, BLOCK_K // _GROUP, _GROUP]) * _e8m0_to_f32(scales)[:, :, None]
    return tl.reshape(values, [BLOCK_N, BLOCK_K])


@triton.jit
def _mxfp4_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Exposes the GEMMs' in-register dequantization for exact testing against dequantize_mxfp4.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w = _load_mxfp4_tile(w_ptr, s_ptr, offs_n, n_mask, k0, K, K // 2, K // _GROUP, BLOCK_N, BLOCK_K, False)
    mask = n_mask[:, None] & (offs_k < K)[None, :]
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Triton twin of brisk.layers.mxfp4.dequantize_mxfp4: [..., out, G, 16] + [..., out, G] -> [..., out, G*32]."""
    *lead, groups, half = blocks.shape
    if half != MXFP4_GROUP // 2 or tuple(scales.shape) != (*lead, groups):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    k = groups * MXFP4_GROUP
    n = blocks.numel() // (groups * half)
    out = torch.empty((*lead, k), dtype=dtype, device=blocks.device)
    grid = (triton.cdiv(n, 32), triton.cdiv(k, 64))
    _mxfp4_dequant_kernel[grid](blocks.contiguous(), scales.contiguous(), out, n, k, BLOCK_N=32, BLOCK_K=64)
    return out


# ---------------------------------------------------------------- grouped GEMM


@triton.jit
def _swiglu_columns(acc, pid_n, N, alpha, limit, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Both MoE kernels' gate_up epilogue: acc [ROWS, BLOCK_N] (fp32, bias added) has columns alternating gate, up;
    each pair gives one activation. The activations [ROWS, BLOCK_N / 2], their output columns and mask."""
    gate, up = tl.split(tl.reshape(acc, [ROWS, BLOCK_N // 2, 2]))
    # gpt-oss's clamped SwiGLU. NaN stays NaN, as in torch's clamp (a GPU's min / max would give the limit): the
    # non-finite guard sees it.
    gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    up = tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL)
    up = tl.minimum(up, limit, propagate_nan=tl.PropagateNan.ALL)
    offs_out = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    return (up + 1.0) * (gate * tl.sigmoid(gate * alpha)), offs_out, offs_out < N // 2


@triton.jit(do_not_specialize=["num_slots", "num_m_blocks"])
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    routing_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_slots,
    num_m_blocks,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    swiglu_alpha,
    swiglu_limit,
    A_ROW_DIV: tl.constexpr,  # slot -> row of A: top_k for gate_up (A = hidden), 1 for down (A = act)
    MXFP4: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTING: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[slot, n-tile] for BLOCK_M slots of one expert x BLOCK_N weight rows.

    With SWIGLU the BLOCK_N weight rows are BLOCK_N/2 interleaved (gate, up) pairs and the program writes
    BLOCK_N/2 activation columns; otherwise it writes BLOCK_N output columns.
    """
    # Grouped ordering: GROUP_M consecutive M blocks (mostly one expert) sweep the N tiles together, so a
    # weight tile fetched from DRAM is reused from L2 by the expert's other M blocks (prefill).
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # block past the used part of the (upper-bound sized) grid
        return

    slot = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = slot < num_slots  # padding slots hold num_slots
    a_rows = (slot // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_expert = w_ptr + expert * stride_we
    s_expert = s_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=m_mask[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        if MXFP4:
            w = _load_mxfp4_tile(
                w_expert, s_expert, offs_n, n_mask, k0, K, stride_wn, stride_sn, BLOCK_N, BLOCK_K, EVEN_K
            )
        else:
            w_ptrs = w_expert + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :] * stride_wk
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        w = tl.trans(w.to(a.dtype))  # [BLOCK_K, BLOCK_N]: MXFP4 values times 2^k are exact in bf16
        if FP32_DOT:
            # fp32 activations: full-precision products, not tf32. Also taken for bf16 under the CPU interpreter,
            # whose tl.dot multiplies bf16's raw uint16 storage; bf16 x bf16 products are exact in fp32, so
            # this matches the tensor cores up to summation order.
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K

    # Epilogue in fp32: bias, activation, routing weight, then one rounding to the output dtype.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if SWIGLU:
        out, offs_out, out_mask = _swiglu_columns(acc, pid_n, N, swiglu_alpha, swiglu_limit, BLOCK_M, BLOCK_N)
    else:
        out = acc
        offs_out = offs_n
        out_mask = n_mask
    if MUL_ROUTING:
        route = tl.load(routing_ptr + slot, mask=m_mask, other=0.0).to(tl.float32)
        out = out * route[:, None]
    out_ptrs = out_ptr + slot.to(tl.int64)[:, None] * stride_om + offs_out[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & out_mask[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _moe_gemv_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    routing_ptr,
    topk_ids_ptr,
    num_slots,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    swiglu_alpha,
    swiglu_limit,
    A_ROW_DIV: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTING: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """out[slot, n-tile] for one slot x BLOCK_N MXFP4 weight rows, without tensor cores (decode).

    The first H100 run had the tl.dot kernel at ~15% of the bandwidth at batch 1: 15 of its 16 MMA rows are
    padding, and each K step shuffles the dequantized tile into the MMA's operand layout. Here each thread takes
    whole 16-byte groups (32 weights, one scale) and multiplies them by the slot's activations in place: the
    nibbles' low / high halves meet the even / odd activations, products add up in fp32 per element, and the
    tile is summed once after the K loop. The expert comes from topk_ids directly (no alignment launch); the
    programs of one N tile are consecutive over the slots, so slots that share an expert read its tile from L2.
    """
    pid = tl.program_id(0)
    slot = pid % num_slots
    pid_n = pid // num_slots
    expert = tl.load(topk_ids_ptr + slot).to(tl.int64)
    if expert < 0:  # another EP rank's expert: the output row stays as the caller zeroed it
        return
    GROUPS: tl.constexpr = BLOCK_K // _GROUP
    HALF: tl.constexpr = _GROUP // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_g = tl.arange(0, GROUPS)
    offs_j = tl.arange(0, HALF)
    a_row = a_ptr + (slot // A_ROW_DIV).to(tl.int64) * stride_am
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None, None] * stride_wn
    s_rows = s_ptr + expert * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_N, GROUPS, HALF], dtype=tl.float32)
    # the loop's own stages: the sm_90 compile pipelines these loads (cp.async, 4.5 KB of shared memory) only so
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        groups = k0 // _GROUP + offs_g  # [GROUPS]
        g_mask = n_mask[:, None]
        if not EVEN_K:  # K is a multiple of 32: the tail is whole groups
            g_mask = g_mask & (groups < K // _GROUP)[None, :]
        packed = tl.load(
            w_rows + (groups[:, None] * HALF + offs_j[None, :])[None, :, :], mask=g_mask[:, :, None], other=0
        )
        scale = _e8m0_to_f32(tl.load(s_rows + groups[None, :], mask=g_mask, other=127))
        a_offs = groups[:, None] * _GROUP + 2 * offs_j[None, :]  # [GROUPS, HALF]: byte j holds inputs 2j, 2j+1
        a_mask = (groups < K // _GROUP)[:, None]
        # 2^14 undoes _e2m1_to_f32's fp16 offset exactly (a power of two), on the few activations, not the weights
        a_even = tl.load(a_row + a_offs, mask=a_mask, other=0.0).to(tl.float32) * 16384.0
        a_odd = tl.load(a_row + a_offs + 1, mask=a_mask, other=0.0).to(tl.float32) * 16384.0
        lo = _e2m1_raw(packed & 0xF)
        hi = _e2m1_raw(packed >> 4)
        acc += (lo * a_even[None, :, :] + hi * a_odd[None, :, :]) * scale[:, :, None]
    row = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]  # [1, BLOCK_N]: the GEMM's epilogue shape, one row

    if HAS_BIAS:
        row += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        out, offs_out, out_mask = _swiglu_columns(row, pid_n, N, swiglu_alpha, swiglu_limit, 1, BLOCK_N)
    else:
        out = row
        offs_out = offs_n
        out_mask = n_mask
    if MUL_ROUTING:
        out = out * tl.load(routing_ptr + slot).to(tl.float32)
    out_ptrs = out_ptr + slot.to(tl.int64) * stride_om + offs_out[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask[None, :])


@dataclass(frozen=True)
class MoEConfig:
    """Tile shape and launch parameters of one grouped GEMM. block_m must match the alignment's.
    gemv: one slot a program, no tensor cores and no alignment (_moe_gemv_kernel; MXFP4 weights, block_m 1)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False


# default_config's tiers: the expected slots per expert up to which each tile set is used (the last one: beyond).
# The first is the GEMV's (MXFP4): 120b's decode up to 32 tokens, 20b's up to 8.
SLOTS_PER_EXPERT_TIERS = (1, 8, 24, 96)


def tier_token_counts(top_k: int, num_experts: int) -> list[int]:
    """The largest token count of each tile tier but the last (default_config): a batch of each compiles that
    tier's GEMM variants (gpt-oss-120b: 32, 256, 768, 3072 tokens; 20b: 8, 64, 192, 768)."""
    return [bound * num_experts // top_k for bound in SLOTS_PER_EXPERT_TIERS]


def default_config(
    num_tokens: int, top_k: int, num_experts: int, n: int, k: int, *, mxfp4: bool, gemv_up_to: float | None = None
) -> MoEConfig:
    """Heuristic Hopper tiles for one GEMM with n weight rows and k inputs (untuned first guesses).

    block_m follows the expected slots per expert so that, at decode, every touched expert is one M block and
    its weights are read once; small block_m also means few wasted MMA rows (tl.dot needs M >= 16). Small
    batches are bandwidth-bound: narrow N tiles give more programs to keep every SM loading, 4 stages keep
    bytes in flight. The dequantized tile is BLOCK_N x BLOCK_K fp32 in registers before its bf16 cast, so
    BLOCK_N * BLOCK_K / (32 * num_warps) is kept at <= 64 registers a thread. Large batches use 64/128-row
    tiles (wgmma) with GROUP_M ordering for L2 reuse of weight tiles. MXFP4 decode up to gemv_up_to slots per
    expert (default the first tier's 1; benchmarks/bench_moe.py --kernels sets it to compare) takes the GEMV.
    """
    per_expert = num_tokens * top_k / max(num_experts, 1)
    # Small batches: a K step reads whole 128-byte lines per weight row (256 MXFP4 values; 128 bf16 values).
    small_n, small_k = (32, 256) if mxfp4 else (64, 128)
    gemv, smallest, small, medium = SLOTS_PER_EXPERT_TIERS
    if mxfp4 and per_expert <= (gemv if gemv_up_to is None else gemv_up_to):
        # a slot a program: 16 rows x 8 groups of 16 bytes, one group a thread (2 KB a K step over 128 threads)
        cfg = MoEConfig(1, 16, 256, num_warps=4, num_stages=3, gemv=True)
    elif per_expert <= smallest:
        cfg = MoEConfig(16, small_n, small_k, group_m=1, num_warps=4, num_stages=4)
    elif per_expert <= small:
        cfg = MoEConfig(32, small_n, small_k, group_m=4, num_warps=4, num_stages=4)
    elif per_expert <= medium:
        cfg = MoEConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4)
    else:
        cfg = MoEConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3)
    # Tiny layers (tests): do not tile far past the matrix.
    block_n = min(cfg.block_n, max(32, triton.next_power_of_2(n)))
    block_k = min(cfg.block_k, max(32, triton.next_power_of_2(k)))
    return replace(cfg, block_n=block_n, block_k=block_k)


def _check_weights(weight: torch.Tensor, scales: torch.Tensor | None, k: int, what: str) -> None:
    if scales is None:
        if weight.dim() != 3 or weight.shape[2] != k:
            raise ValueError(f"{what}: expected weights [E, N, {k}], got {tuple(weight.shape)}")
        return
    e, n = weight.shape[:2]
    if weight.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what}: MXFP4 blocks/scales must be uint8, got {weight.dtype}/{scales.dtype}")
    groups = k // MXFP4_GROUP
    if tuple(weight.shape) != (e, n, groups, MXFP4_GROUP // 2) or tuple(scales.shape) != (e, n, groups):
        raise ValueError(
            f"{what}: MXFP4 blocks {tuple(weight.shape)} / scales {tuple(scales.shape)} do not fit {k} inputs"
        )
    # The kernel walks a row's packed bytes (and scales) as one contiguous run.
    if weight.stride(3) != 1 or weight.stride(2) != MXFP4_GROUP // 2 or scales.stride(2) != 1:
        raise ValueError(f"{what}: MXFP4 blocks/scales must be contiguous within a row")


def _launch_gemm(
    a: torch.Tensor,
    a_row_div: int,
    weight: torch.Tensor,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    routing: torch.Tensor | None,
    align: MoEAlignment | None,
    swiglu: tuple[float, float] | None,
    config: MoEConfig,
    topk_ids: torch.Tensor | None = None,
) -> None:
    mxfp4 = scales is not None
    k = a.shape[1]
    n = weight.shape[1]
    if mxfp4 and config.block_k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs block_k divisible by {MXFP4_GROUP}, got {config.block_k}")
    if swiglu is not None and config.block_n % 2:
        raise ValueError("the SwiGLU epilogue needs an even block_n (whole gate/up pairs)")
    if a.stride(1) != 1:
        raise ValueError("activations must be contiguous along features")
    if config.gemv:
        if scales is None or topk_ids is None:
            raise ValueError("the GEMV kernel takes MXFP4 weights and the slots' topk_ids")
        if config.block_n % 2:  # as it was written first: the GEMV's tiles are whole pairs in down too
            raise ValueError("the GEMV needs an even block_n")
        _launch_gemv(a, a_row_div, weight, scales, bias, out, routing, topk_ids, swiglu, config)
        return
    if align is None:
        raise ValueError("the grouped GEMM needs the slots' alignment")
    if config.block_m != align.block_m:
        raise ValueError(f"config block_m {config.block_m} != alignment block_m {align.block_m}")
    num_m_blocks = align.expert_ids.numel()
    grid = (num_m_blocks * triton.cdiv(n, config.block_n),)
    alpha, limit = swiglu if swiglu is not None else (0.0, 0.0)
    stride_wk = 1 if mxfp4 else weight.stride(2)
    s = scales if scales is not None else weight  # unused pointer when not MXFP4
    _moe_gemm_kernel[grid](
        a,
        weight,
        s,
        bias if bias is not None else weight,
        out,
        routing if routing is not None else a,
        align.sorted_token_ids,
        align.expert_ids,
        align.num_slots,
        num_m_blocks,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        stride_wk,
        s.stride(0),
        s.stride(1),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        alpha,
        limit,
        A_ROW_DIV=a_row_div,
        MXFP4=mxfp4,
        SWIGLU=swiglu is not None,
        HAS_BIAS=bias is not None,
        MUL_ROUTING=routing is not None,
        EVEN_K=k % config.block_k == 0,
        FP32_DOT=a.dtype == torch.float32 or interpreting(),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _launch_gemv(
    a: torch.Tensor,
    a_row_div: int,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    routing: torch.Tensor | None,
    topk_ids: torch.Tensor,
    swiglu: tuple[float, float] | None,
    config: MoEConfig,
) -> None:
    """_launch_gemm's GEMV branch, its checks made there."""
    k = a.shape[1]
    n = weight.shape[1]
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_slots = ids.numel()
    alpha, limit = swiglu if swiglu is not None else (0.0, 0.0)
    _moe_gemv_kernel[(num_slots * triton.cdiv(n, config.block_n),)](
        a,
        weight,
        scales,
        bias if bias is not None else weight,
        out,
        routing if routing is not None else a,
        ids,
        num_slots,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        scales.stride(0),
        scales.stride(1),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        alpha,
        limit,
        A_ROW_DIV=a_row_div,
        SWIGLU=swiglu is not None,
        HAS_BIAS=bias is not None,
        MUL_ROUTING=routing is not None,
        EVEN_K=k % config.block_k == 0,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        STAGES=config.num_stages,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_moe_gate_up(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
    align: MoEAlignment | None,
    top_k: int,
    swiglu_alpha: float,
    swiglu_limit: float,
    config: MoEConfig,
    topk_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """act [T*k, I]: row t*k+j = clamped_swiglu(hidden[t] @ gate_up[e]^T + bias[e]), e = topk_ids[t, j].

    weight: MXFP4 blocks [E, 2I, H/32, 16] with scales [E, 2I, H/32], or plain [E, 2I, H] with scales None.
    """
    num_tokens, h = hidden.shape
    _check_weights(weight, scales, h, "gate_up")
    if align is not None and align.num_slots != num_tokens * top_k:
        raise ValueError(f"alignment has {align.num_slots} slots, expected {num_tokens} x {top_k}")
    act = hidden.new_empty((num_tokens * top_k, weight.shape[1] // 2))
    swiglu = (swiglu_alpha, swiglu_limit)
    _launch_gemm(hidden, top_k, weight, scales, bias, act, None, align, swiglu, config, topk_ids)
    return act


def fused_moe_down(
    act: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
    align: MoEAlignment | None,
    topk_weights: torch.Tensor,
    config: MoEConfig,
    unrouted_slots: bool = False,
    topk_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, H] = sum_j topk_weights[t, j] * (act[t*k+j] @ down[e]^T + bias[e]); bias None skips it (TP rank > 0).
    unrouted_slots: some expert ids are -1 (experts of other EP ranks); their slots must read as zero.

    weight: MXFP4 blocks [E, H, I/32, 16] with scales [E, H, I/32], or plain [E, H, I] with scales None.
    """
    num_tokens, top_k = topk_weights.shape
    _check_weights(weight, scales, act.shape[1], "down")
    routing = topk_weights.reshape(-1)
    if not routing.is_contiguous():
        routing = routing.contiguous()
    # Written per slot, then summed (see the module docstring for why not atomics).
    y = (act.new_zeros if unrouted_slots else act.new_empty)((num_tokens, top_k, weight.shape[1]))
    _launch_gemm(act, 1, weight, scales, bias, y.view(num_tokens * top_k, -1), routing, align, None, config, topk_ids)
    return y.view(num_tokens, -1) if top_k == 1 else y.sum(dim=1)


def fused_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up: torch.Tensor,
    gate_up_scales: torch.Tensor | None,
    gate_up_bias: torch.Tensor | None,
    down: torch.Tensor,
    down_scales: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    swiglu_alpha: float,
    swiglu_limit: float,
    configs: tuple[MoEConfig, MoEConfig] | None = None,
    unrouted_slots: bool = False,
    num_routed_experts: int | None = None,
) -> torch.Tensor:
    """The MoE layer: hidden [T, H] routed by topk_ids / topk_weights [T, k] -> [T, H] in hidden's dtype.
    With unrouted_slots, topk_ids may hold -1 (an expert on another EP rank): such a slot adds nothing.
    num_routed_experts: the experts the slots are spread over (all EP ranks'; default this rank's), which sizes
    the tiles by the slots an expert can expect.

    Weights are MXFP4 (blocks + scales) or plain (scales None), per projection. configs overrides the
    (gate_up, down) tiles; both must share block_m.
    """
    num_tokens, h = hidden.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return hidden.new_zeros((0, h))
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    num_experts, two_i = gate_up.shape[:2]
    if configs is None:
        spread = num_routed_experts or num_experts
        configs = (
            default_config(num_tokens, top_k, spread, two_i, h, mxfp4=gate_up_scales is not None),
            default_config(num_tokens, top_k, spread, h, two_i // 2, mxfp4=down_scales is not None),
        )
    up_cfg, down_cfg = configs
    if up_cfg.block_m != down_cfg.block_m:
        raise ValueError("gate_up and down configs must share block_m (they share one alignment)")
    # the GEMV reads each slot's expert from topk_ids: an alignment only where a grouped GEMM runs
    aligned = not (up_cfg.gemv and down_cfg.gemv)
    align = moe_align_block_size(topk_ids, up_cfg.block_m, num_experts) if aligned else None
    act = fused_moe_gate_up(
        hidden, gate_up, gate_up_scales, gate_up_bias, align, top_k, swiglu_alpha, swiglu_limit, up_cfg, topk_ids
    )
    return fused_moe_down(act, down, down_scales, down_bias, align, topk_weights, down_cfg, unrouted_slots, topk_ids)
