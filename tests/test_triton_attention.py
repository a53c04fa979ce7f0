"""Triton paged attention vs the reference `TorchAttentionBackend`.

Without CUDA the kernels run in the Triton interpreter on tiny shapes; with CUDA the same tests run
compiled, plus the `real` shapes (gpt-oss: head_dim 64, 64 q heads / 8 KV heads, block 32, up to 8k).
Every cache starts as NaN, so a read of the null block, of a released block or of an unwritten slot
poisons the output and fails the comparison.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first @triton.jit

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from brisk.kernels.triton_attention import (  # noqa: E402
    PARTIAL_BYTES_CAP,
    bounded_partition_size,
    default_partition_size,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv_cache,
)
from brisk.layers.attention import Attention, AttentionMetadata, TorchAttentionBackend, store_kv  # noqa: E402
from brisk.layers.attention_triton import FP32_TILES, HALF_TILES, TritonAttentionBackend  # noqa: E402
from tests import paged_cases  # noqa: E402
from tests.paged_cases import REAL, TINY, Case, Shape, assert_close  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="real shapes need a CUDA GPU")


def make_case(*args, **kwargs) -> Case:
    return paged_cases.make_case(*args, **kwargs, device=DEVICE)


def stored_layer(case: Case) -> Attention:
    """A layer whose cache already holds this step's new K/V (for calling the kernels directly)."""
    layer = case.layer(None)
    store_kv_cache(case.k, case.v, layer.k_cache, layer.v_cache, case.meta.slot_mappings[0])
    return layer


def device_lists(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.tensor(case.meta.query_start_loc, dtype=torch.int32, device=DEVICE)
    return cu, torch.tensor(case.meta.seq_lens, dtype=torch.int32, device=DEVICE)


def backend_for(shape: Shape, partition: int | None = None) -> TritonAttentionBackend:
    return TritonAttentionBackend(
        prefill_block_n=shape.block_n, decode_block_n=shape.block_n, decode_partition_size=partition
    )


def _with_group(shape: Shape, group: int) -> Shape:
    return Shape(shape.heads, shape.heads // group, shape.head_dim, shape.page, shape.block_n)


# Tiny mixed batch: decodes (1 token), a fresh prompt, chunked prefills over cached prefixes, a
# single-token prompt, and a sequence with nothing scheduled. Window 6 is not a multiple of page 4;
# contexts run shorter than, equal to and longer than the windows.
TINY_SPECS = [(1, 9), (5, 19), (7, 7), (1, 1), (0, 5), (9, 30), (1, 6), (1, 41), (3, 8)]
REAL_SPECS = [(1, 8192), (1, 1000), (300, 300), (77, 4173), (1, 129), (513, 2048), (1, 128)]


# ---------------------------------------------------------------------------------------------------
# store_kv_cache
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_cache_matches_reference(cache_dtype: torch.dtype) -> None:
    s = Shape(heads=4, kv_heads=3, head_dim=16, page=4, block_n=16)  # 3 heads: padded head lanes
    g = torch.Generator().manual_seed(1)
    t = 11
    qkv = torch.randn(t, 10, s.head_dim, generator=g).to(DEVICE)
    k, v = qkv[:, 4:7], qkv[:, 7:10]  # strided views, as after a fused qkv projection
    slots = torch.randperm(8 * s.page, generator=g)[:t]
    slots[[2, 5]] = -1
    slots = slots.to(DEVICE)
    caches = [torch.zeros(8, s.page, s.kv_heads, s.head_dim, dtype=cache_dtype, device=DEVICE) for _ in range(4)]
    store_kv_cache(k, v, caches[0], caches[1], slots)
    layer = Attention(s.heads, s.kv_heads, s.head_dim, 1.0, 0)
    layer.k_cache, layer.v_cache = caches[2], caches[3]
    store_kv(layer, k, v, slots)
    # fp32 -> bf16: the GPU rounds to nearest even, the CPU interpreter truncates; allow one ulp there.
    exact = CUDA or cache_dtype == torch.float32
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(ours, ref, atol=0, rtol=0 if exact else 2**-7)


# ---------------------------------------------------------------------------------------------------
# Backend: mixed batches through both kernels
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 6, 8])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_backend_mixed_batch(group: int, window: int | None, use_sinks: bool) -> None:
    case = make_case(_with_group(TINY, group), TINY_SPECS, window, seed=group)
    backend = backend_for(case.shape, partition=16)  # decode contexts up to 41: several partitions
    out, layer = case.run(backend, use_sinks)
    ref_out, ref_layer = case.run(TorchAttentionBackend(), use_sinks)
    assert_close(out, ref_out)
    assert torch.equal(layer.k_cache.nan_to_num(), ref_layer.k_cache.nan_to_num())
    assert torch.equal(layer.v_cache.nan_to_num(), ref_layer.v_cache.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backend_half_precision(dtype: torch.dtype) -> None:
    case = make_case(TINY, TINY_SPECS, window=6, dtype=dtype, seed=3)
    assert_close(case.run(backend_for(TINY, 16), True)[0], case.reference(True))


@pytest.mark.parametrize("window", [None, 6])
def test_backend_odd_group_wide_head_small_tile(window: int | None) -> None:
    # GQA group 3 (padded to 4 rows per KV head), head_dim 32, KV tiles of 16 inside 32-slot blocks.
    shape = Shape(heads=6, kv_heads=2, head_dim=32, page=32, block_n=16)
    case = make_case(shape, TINY_SPECS, window, seed=8)
    assert_close(case.run(backend_for(shape, 16), True)[0], case.reference(True))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("query_len", [4, 9])
def test_backend_static_verify_step(window: int | None, query_len: int) -> None:
    # A speculative verify step on the CUDA-graph buffers: k + 1 new tokens per sequence, device tensors only, the
    # tiles built from the static shape (no host lists); 8-token tiles, so 9 tokens take two. Contexts shorter and
    # longer than a tile and the window.
    specs = [(query_len, query_len + extra) for extra in (0, 5, 26, 9)]
    case = make_case(TINY, specs, window, seed=9)
    reference = case.reference(True)
    cu, lens = device_lists(case)
    case.meta.query_start_loc_tensor, case.meta.seq_lens_tensor, case.meta.static_query_len = cu, lens, query_len
    case.meta.seq_lens, case.meta.query_start_loc = [], []  # the graph path never reads the host lists
    backend = TritonAttentionBackend(prefill_block_m=16, prefill_block_n=TINY.block_n, decode_block_n=TINY.block_n)
    assert_close(case.run(backend, True)[0], reference)


def test_backend_reuses_plan_per_step_and_rebuilds_on_change() -> None:
    backend = backend_for(TINY, 16)
    a = make_case(TINY, TINY_SPECS, seed=4)
    assert_close(a.run(backend, False)[0], a.reference(False))
    plans = a.meta.plan_for(backend)  # the step's plans (per block_q), kept on its metadata
    (plan,) = plans.values()
    assert_close(a.run(backend, True)[0], a.reference(True))  # next layer, same step
    assert a.meta.plan_for(backend) is plans and next(iter(plans.values())) is plan
    b = make_case(TINY, [(2, 12), (1, 20)], seed=5)
    assert_close(b.run(backend, True)[0], b.reference(True))
    assert next(iter(b.meta.plan_for(backend).values())) is not plan


def test_backend_64bit_cache_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    # Caches of 2**31+ elements switch the gather to int64 offsets; force that path at a tiny shape.
    import brisk.kernels.triton_attention as kernels

    monkeypatch.setattr(kernels, "_needs_64bit_offsets", lambda cache: True)
    case = make_case(TINY, TINY_SPECS, window=6, seed=6)
    assert_close(case.run(backend_for(TINY, 16), True)[0], case.reference(True))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    specs=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 40)), min_size=1, max_size=5),
    window=st.sampled_from([None, 1, 3, 5, 16, 23]),
    group=st.sampled_from([1, 2, 4]),
    use_sinks=st.booleans(),
)
def test_backend_random_batches(specs, window, group, use_sinks) -> None:
    # (new tokens, cached prefix) -> (new tokens, context length)
    case = make_case(_with_group(TINY, group), [(n, n + c) for n, c in specs], window, seed=len(specs))
    assert_close(case.run(backend_for(case.shape, 16), use_sinks)[0], case.reference(use_sinks))


# ---------------------------------------------------------------------------------------------------
# Kernels called directly
# ---------------------------------------------------------------------------------------------------
DECODE_SPECS_TINY = [(1, 1), (1, 7), (1, 8), (1, 9), (1, 16), (1, 17), (1, 50), (1, 93)]


@pytest.mark.parametrize("partition", [16, None])
@pytest.mark.parametrize("window", [None, 7, 8, 33])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_decode_split_k(partition: int | None, window: int | None, use_sinks: bool) -> None:
    # Partition 16 splits the 93-token context 6 ways; None lets the heuristic pick (one partition on CPU).
    case = make_case(TINY, DECODE_SPECS_TINY, window, seed=7)
    layer = stored_layer(case)
    _, seq_lens = device_lists(case)
    out = paged_decode_attention(
        case.q,
        layer.k_cache,
        layer.v_cache,
        case.meta.block_tables[0],
        seq_lens,
        layer.scale,
        sliding_window=window,
        sinks=case.sinks if use_sinks else None,
        block_n=TINY.block_n,
        partition_size=partition,
    )
    assert_close(out, case.reference(use_sinks))


@pytest.mark.parametrize("block_q,block_n", [(8, 16), (16, 32), (32, 16)])
@pytest.mark.parametrize("window", [None, 3, 6, 13])
def test_prefill_tiles_and_windows(block_q: int, block_n: int, window: int | None) -> None:
    # block_n 32 spans 8 pages per tile; window 3 is narrower than a tile, so no tile is mask-free.
    specs = [(13, 13), (10, 37), (2, 2), (17, 25), (1, 11)]
    case = make_case(TINY, specs, window, seed=11)
    layer = stored_layer(case)
    cu, seq_lens = device_lists(case)
    out = paged_prefill_attention(
        case.q,
        layer.k_cache,
        layer.v_cache,
        case.meta.block_tables[0],
        cu,
        seq_lens,
        layer.scale,
        sliding_window=window,
        sinks=case.sinks,
        block_q=block_q,
        block_n=block_n,
    )
    assert_close(out, case.reference(True))


def test_prefill_kernel_handles_decode_rows() -> None:
    # Any sequence may take the prefill path (one-token sequences included); the backend just doesn't.
    case = make_case(TINY, [(1, 30), (4, 9), (1, 1)], window=6, seed=12)
    layer = stored_layer(case)
    cu, seq_lens = device_lists(case)
    out = paged_prefill_attention(
        case.q,
        layer.k_cache,
        layer.v_cache,
        case.meta.block_tables[0],
        cu,
        seq_lens,
        layer.scale,
        sliding_window=6,
        sinks=case.sinks,
        block_n=TINY.block_n,
    )
    assert_close(out, case.reference(True))


# ---------------------------------------------------------------------------------------------------
# Real shapes (CUDA only)
# ---------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_real_backend_mixed_batch(dtype: torch.dtype, window: int | None, use_sinks: bool) -> None:
    case = make_case(REAL, REAL_SPECS, window, dtype=dtype, seed=21)
    assert_close(case.run(backend_for(REAL), use_sinks)[0], case.reference(use_sinks))


@needs_cuda
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("partition", [256, 1024, None])
@pytest.mark.parametrize("window", [None, 128, 100])
def test_real_decode(group: int, partition: int | None, window: int | None) -> None:
    shape = _with_group(REAL, group)
    specs = [(1, n) for n in (1, 31, 100, 128, 129, 1000, 4097, 8192)]
    case = make_case(shape, specs, window, dtype=torch.bfloat16, seed=group)
    assert_close(case.run(backend_for(shape, partition), True)[0], case.reference(True))


@needs_cuda
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("window", [None, 128])
def test_real_chunked_prefill(group: int, window: int | None) -> None:
    shape = _with_group(REAL, group)
    case = make_case(shape, [(2048, 8192), (1000, 1000), (129, 700)], window, dtype=torch.bfloat16, seed=31)
    assert_close(case.run(backend_for(shape), True)[0], case.reference(True))


@pytest.mark.parametrize("window", [None, 6, 8])
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("chunk_elements", [TorchAttentionBackend.decode_chunk_elements, 1, 10000])
def test_torch_backend_batched_decode_matches_per_sequence(
    window: int | None, use_sinks: bool, chunk_elements: int
) -> None:
    # The reference computes a pure-decode batch at once over padded contexts, in chunks of sequences (one
    # chunk, one sequence per chunk, three per chunk with a shorter last one); NaN-filled unwritten and
    # released blocks must not leak into it, and it must equal the sequence-by-sequence computation.
    case = make_case(TINY, DECODE_SPECS_TINY, window, seed=11)
    chunked = TorchAttentionBackend()
    chunked.decode_chunk_elements = chunk_elements
    batched = case.run(chunked, use_sinks)[0]
    per_sequence = TorchAttentionBackend()
    per_sequence.max_batched_decode_elements = 0
    assert not batched.isnan().any()
    torch.testing.assert_close(batched, case.run(per_sequence, use_sinks)[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("score_elements", [1, 150])
def test_torch_backend_prompt_chunks_match_one_piece(window: int | None, use_sinks: bool, score_elements: int) -> None:
    # A prompt's queries in chunks of bounded scores (one query a chunk; a few, with a shorter last chunk) give what
    # one piece gives: each chunk gathers only the keys its window reaches.
    case = make_case(TINY, [(9, 30), (7, 7), (1, 9), (23, 41)], window, seed=13)
    whole = TorchAttentionBackend()
    whole.prefill_score_elements = 1 << 40
    chunked = TorchAttentionBackend()
    chunked.prefill_score_elements = score_elements
    assert score_elements // (TINY.heads * 41) < 23  # the longest prompt is split
    expected = case.run(whole, use_sinks)[0]
    assert not expected.isnan().any()
    torch.testing.assert_close(case.run(chunked, use_sinks)[0], expected, atol=1e-6, rtol=1e-6)


def test_tiles_follow_the_query_dtype_unless_given() -> None:
    backend = TritonAttentionBackend()
    assert backend.tiles_for(torch.bfloat16) == backend.tiles_for(torch.float16) == HALF_TILES
    assert backend.tiles_for(torch.float32) == FP32_TILES != HALF_TILES
    overridden = TritonAttentionBackend(prefill_block_n=16).tiles_for(torch.float32)
    assert overridden == replace(FP32_TILES, prefill_block_n=16)


def test_split_k_sized_from_a_bound_still_splits_usual_contexts():
    """A CUDA graph knows its contexts only by max_seq_len: its split-K is sized for 8k-key contexts, never coarser
    than sizing from the bound, with the bound's partial results under PARTIAL_BYTES_CAP."""
    cpu = torch.device("cpu")  # default_partition_size's stand-in for a GPU of 8 SMs
    heads, kv_heads, dim, bound = 64, 8, 64, 131072
    for n in (1, 8, 64, 256, 1024, 4096):
        size = bounded_partition_size(n, heads, kv_heads, dim, bound, 64, cpu)
        assert size % 64 == 0 and size <= default_partition_size(n, kv_heads, bound, 64, cpu)
        parts = -(-bound // size)
        assert n * heads * parts * (dim + 2) * 4 <= PARTIAL_BYTES_CAP or parts == 1
    assert bounded_partition_size(1, heads, kv_heads, dim, bound, 64, cpu) == default_partition_size(
        1, kv_heads, 8192, 64, cpu
    )
    assert bounded_partition_size(1, heads, kv_heads, dim, bound, 64, cpu) < default_partition_size(
        1, kv_heads, bound, 64, cpu
    )


@pytest.mark.parametrize(
    "num_decodes, prompt_lens",
    [(d, p) for d in (0, 1, 3, 4, 7, 8) for p in ((), (5,), (17, 40), (3, 9, 130)) if d or p],
)
def test_step_plan_views_start_16_byte_aligned(num_decodes: int, prompt_lens: tuple[int, ...]) -> None:
    # Triton specialises a pointer argument on 16-byte alignment: plan tensors at offsets that follow the batch
    # would compile kernel variants of their own in the middle of serving (the interpreter never shows it).
    from brisk.layers.attention_triton import build_step_plan

    new_tokens = [1] * num_decodes + list(prompt_lens)
    qsl = [0, *np.cumsum(new_tokens).tolist()]
    lens = [n + 10 for n in new_tokens]
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=lens, block_tables=[], slot_mappings=[])
    plan = build_step_plan(meta, block_q=16, device=torch.device("cpu"))
    views = {
        "cu_seqlens_q": plan.cu_seqlens_q,
        "seq_lens": plan.seq_lens,
        "decode_seqs": plan.decode_seqs,
        "tile_seqs": plan.tile_seqs,
        "tile_starts": plan.tile_starts,
    }
    assert plan.cu_seqlens_q.tolist() == qsl and plan.seq_lens.tolist() == lens
    assert plan.decode_seqs.tolist() == list(range(num_decodes))
    for name, view in views.items():
        assert view.dtype == torch.int32 and view.storage_offset() * 4 % 16 == 0, (name, view.storage_offset())
