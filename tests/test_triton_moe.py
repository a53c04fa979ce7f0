"""Fused MoE Triton kernels (brisk/kernels/triton_moe.py) against the torch reference.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported) at
tiny shapes; these tests are never skipped. With CUDA the same tests run on the GPU, plus real gpt-oss shapes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from brisk.kernels.triton_moe import (
    MoEConfig,
    default_config,
    fused_experts,
    fused_moe_down,
    fused_moe_gate_up,
    moe_align_block_size,
    mxfp4_dequantize,
    route_topk,
)
from brisk.layers.backends import make_moe_backend
from brisk.layers.moe import FusedMoE, TorchMoEBackend, clamped_swiglu, select_experts
from brisk.layers.moe_triton import TritonMoEBackend
from brisk.layers.mxfp4 import dequantize_mxfp4
from brisk.model_config import ParallelConfig

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# Large activations overflow exp() inside sigmoid in the interpreter (numpy warns; the result is the right 0).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def fill_layer(
    layer: FusedMoE, gen: torch.Generator, dtype: torch.dtype, scale_range: tuple[int, int] = (121, 125)
) -> FusedMoE:
    """Random weights: MXFP4 bytes over the whole range with E8M0 scales in scale_range, or plain weights. Drawn on
    the generator's device (a CUDA generator fills gpt-oss-120b's 1.7 GB layer in place of a minute of CPU draws)."""
    dev = gen.device
    for name, param in layer.named_parameters():
        if name.endswith("_blocks"):
            value = torch.randint(0, 256, param.shape, generator=gen, dtype=torch.uint8, device=dev)
        elif name.endswith("_scales"):
            lo, hi = scale_range[0], scale_range[1] + 1
            value = torch.randint(lo, hi, param.shape, generator=gen, dtype=torch.uint8, device=dev)
        else:
            std = 0.5 if name.endswith("_bias") else 0.1
            value = (torch.randn(param.shape, generator=gen, device=dev) * std).to(dtype)
        param.data = value.to(DEVICE)
    return layer


def make_layer(
    e: int,
    k: int,
    h: int,
    i: int,
    *,
    mxfp4: bool,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    parallel: ParallelConfig = ParallelConfig(),
    scale_range: tuple[int, int] = (121, 125),
    **kwargs,
) -> FusedMoE:
    layer = FusedMoE(e, k, h, i, quantization="mxfp4" if mxfp4 else None, parallel=parallel, **kwargs)
    # On CUDA drawn on the GPU (other values than the CPU's, from the same seed); on the CPU the same as ever.
    return fill_layer(layer, torch.Generator(device=DEVICE).manual_seed(seed), dtype, scale_range)


def routing(t: int, e: int, k: int, seed: int, dtype: torch.dtype = torch.float32):
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    return select_experts(logits, k)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    else:  # bf16: the reference rounds after every op, the kernels once per GEMM
        err = (out.float() - ref.float()).norm() / ref.float().norm()
        assert err < 1e-2, f"relative error {err:.2e}"
        torch.testing.assert_close(out.float(), ref.float(), rtol=0.05, atol=0.05 * ref.float().abs().max().item())


# ---------------------------------------------------------------- MXFP4 decoding in registers


def test_mxfp4_dequantize_is_exact_over_all_bytes_and_scales():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 40, 3, 16), generator=gen, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(0, 256, 16, dtype=torch.uint8) + torch.arange(16, dtype=torch.uint8)  # all nibbles
    scales = torch.randint(0, 256, (2, 40, 3), generator=gen, dtype=torch.uint8)
    scales[0, :3, 0] = torch.tensor([0, 1, 255], dtype=torch.uint8)  # subnormal 2^-127, 2^-126, inf
    out = mxfp4_dequantize(blocks.to(DEVICE), scales.to(DEVICE), torch.float32).cpu()
    torch.testing.assert_close(out, dequantize_mxfp4(blocks, scales, torch.float32), rtol=0, atol=0, equal_nan=True)
    # bf16 without subnormal results (scale >= 2): the interpreter's fp32 -> bf16 cast flushes those to zero.
    scales = scales.clamp(min=2)
    out = mxfp4_dequantize(blocks.to(DEVICE), scales.to(DEVICE), torch.bfloat16).cpu()
    torch.testing.assert_close(out, dequantize_mxfp4(blocks, scales, torch.bfloat16), rtol=0, atol=0, equal_nan=True)


def test_mxfp4_nibble_order_low_first():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2F  # low nibble 0xF = -6 is element 0, high nibble 0x2 = 1.0 is element 1
    scales = torch.tensor([[129]], dtype=torch.uint8)  # 2^2
    out = mxfp4_dequantize(blocks.to(DEVICE), scales.to(DEVICE), torch.float32).cpu()
    assert out[0, :2].tolist() == [-24.0, 4.0] and out[0, 2:].abs().sum() == 0


# ---------------------------------------------------------------- alignment


def check_alignment(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, one_program_max_slots: int | None = 1024
) -> None:
    align = moe_align_block_size(topk_ids.to(DEVICE), block_m, num_experts, one_program_max_slots)
    flat = topk_ids.reshape(-1).cpu()
    num_slots = flat.numel()
    sorted_ids = align.sorted_token_ids.cpu()
    expert_ids = align.expert_ids.cpu()
    counts = torch.bincount(flat, minlength=num_experts)
    blocks_per_expert = (counts + block_m - 1) // block_m
    used = int(blocks_per_expert.sum())
    assert int(align.num_tokens_post_padded) == used * block_m
    assert len(expert_ids) >= used and (expert_ids[used:] == -1).all()
    # Blocks in expert order, each expert exactly ceil(count / block_m) blocks, none for an idle expert.
    assert torch.equal(expert_ids[:used], torch.repeat_interleave(torch.arange(num_experts), blocks_per_expert).int())
    slots = sorted_ids[: used * block_m].view(used, block_m)
    for b in range(used):
        real = slots[b][slots[b] < num_slots].long()
        assert (flat[real] == expert_ids[b]).all()
        assert (slots[b][slots[b] >= num_slots] == num_slots).all()
    real = sorted_ids[: used * block_m]
    real = real[real < num_slots].long()
    # Every slot exactly once, stable (increasing) within an expert, which here means sorted by (expert, slot).
    assert torch.equal(real, torch.sort(flat * num_slots + torch.arange(num_slots)).values % num_slots)


@pytest.mark.parametrize(
    "t,k,e,block_m", [(1, 4, 8, 16), (3, 2, 4, 16), (17, 4, 8, 16), (17, 1, 4, 4), (40, 2, 130, 16), (5, 3, 6, 2)]
)
@pytest.mark.parametrize("one_program_max_slots", [1024, 0])  # 0: over programs (count, runs, scatter)
def test_moe_align_block_size(t, k, e, block_m, one_program_max_slots):
    ids, _ = routing(t, e, k, seed=t * e + k)
    check_alignment(ids, block_m, e, one_program_max_slots)


@pytest.mark.parametrize("t,e,over_programs", [(32, 128, False), (33, 128, True), (128, 32, False), (129, 32, True)])
def test_alignment_takes_one_program_up_to_two_chunks(monkeypatch, t, e, over_programs):
    """One launch up to two chunks of slots (E = 128: 64 slots a chunk; E = 32: 256), three past them: a captured
    decode batch of 256 rows would otherwise walk 16 chunks twice in one program."""
    import brisk.kernels.triton_moe as triton_moe

    launched: list[str] = []

    class Spy:
        def __init__(self, name: str) -> None:
            self.name, self.kernel = name, getattr(triton_moe, name)

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("_moe_align_kernel", "_moe_count_kernel"):
        monkeypatch.setattr(triton_moe, name, Spy(name))
    ids, _ = routing(t, e, 4, seed=t)
    check_alignment(ids, 16, e, one_program_max_slots=None)
    assert launched == (["_moe_count_kernel"] if over_programs else ["_moe_align_kernel"])


@pytest.mark.parametrize("t,k,e,block_m", [(700, 4, 8, 16), (300, 4, 128, 64), (50, 3, 6, 2)])
def test_moe_align_over_programs_equals_one_program(t, k, e, block_m):
    # Several chunks (E = 8: 1024 slots a chunk; E = 128: 64), a partial last one and EP's -1 ids: every output
    # buffer, padding included, is the one program's.
    ids, _ = routing(t, e, k, seed=t)
    ids[::7, 0] = -1  # slots of another EP rank's experts
    one = moe_align_block_size(ids.to(DEVICE), block_m, e, one_program_max_slots=1 << 20)
    many = moe_align_block_size(ids.to(DEVICE), block_m, e, one_program_max_slots=0)
    for a, b in zip(
        (one.sorted_token_ids, one.expert_ids, one.num_tokens_post_padded),
        (many.sorted_token_ids, many.expert_ids, many.num_tokens_post_padded),
    ):
        assert torch.equal(a.cpu(), b.cpu())


def test_moe_align_all_tokens_to_one_expert_and_idle_experts():
    ids = torch.full((33, 1), 5)
    check_alignment(ids, 16, 8)  # 3 blocks of expert 5, none for the 7 idle experts
    check_alignment(torch.tensor([[7, 0], [0, 7], [7, 0]]), 4, 8)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.sampled_from([1, 2, 4, 16]), st.data())
def test_moe_align_property(t, e, block_m, data):
    k = data.draw(st.integers(1, e))
    rows = [data.draw(st.permutations(range(e)))[:k] for _ in range(t)]
    check_alignment(torch.tensor(rows), block_m, e, data.draw(st.sampled_from([1024, 0])))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,k", [(7, 8, 3), (5, 128, 4), (3, 32, 4), (2, 6, 1)])
def test_route_topk_matches_select_experts(dtype, t, e, k):
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(e)).to(DEVICE, dtype)
    ids, weights = route_topk(logits, k)
    want_ids, want_weights = select_experts(logits, k)
    assert ids.dtype == want_ids.dtype and weights.dtype == want_weights.dtype == dtype
    assert torch.equal(ids, want_ids)  # descending, as torch.topk
    torch.testing.assert_close(weights, want_weights, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-7)


def test_route_topk_makes_ids_local_under_ep_and_keeps_nan_rows_nan():
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits[4] = float("nan")
    logits[5, 2] = float("nan")  # a NaN beside numbers: picked first, its row's weights NaN
    layer = make_layer(8, 2, 32, 32, mxfp4=True, parallel=ParallelConfig.for_rank(1, 2, ep_size=2))
    ids, weights = TritonMoEBackend().route(layer, logits)
    want_ids, want_weights = TorchMoEBackend().route(layer, logits)
    assert ((ids >= -1) & (ids < 4)).all() and (ids[:4] == -1).any() and (ids[:4] >= 0).any()
    torch.testing.assert_close(weights[:4], want_weights[:4], rtol=1e-6, atol=1e-7)
    assert torch.equal(ids[:4], want_ids[:4])
    assert (weights[ids == -1] == 0).all()
    ids, weights = route_topk(logits, 2)  # all experts here: the NaN rows' weights NaN for the guard, ids in range
    assert weights[4:].isnan().all() and ((ids >= 0) & (ids < 8)).all() and ids[5, 0] == 2


# ---------------------------------------------------------------- the two GEMMs on their own


def layer_weights(layer: FusedMoE) -> dict[str, torch.Tensor | None]:
    q = layer.quantization == "mxfp4"
    return dict(
        gate_up=layer.gate_up_proj_blocks if q else layer.gate_up_proj,
        gate_up_scales=layer.gate_up_proj_scales if q else None,
        down=layer.down_proj_blocks if q else layer.down_proj,
        down_scales=layer.down_proj_scales if q else None,
    )


@pytest.mark.parametrize("mxfp4", [True, False])
@pytest.mark.parametrize("cfg", [MoEConfig(16, 32, 32), MoEConfig(16, 64, 64, group_m=2)])
def test_fused_moe_gate_up_kernel(mxfp4, cfg):
    e, k, h, i, t = 6, 2, 96, 64, 17  # K = 96: two K steps at 64 (masked tail), three at 32
    layer = make_layer(e, k, h, i, mxfp4=mxfp4, seed=3, swiglu_limit=2.0)
    hidden = torch.randn(t, h, generator=torch.Generator().manual_seed(4)).to(DEVICE) * 4  # clamp active
    ids, _ = routing(t, e, k, seed=5)
    w = layer_weights(layer)
    act = fused_moe_gate_up(
        hidden,
        w["gate_up"],
        w["gate_up_scales"],
        layer.gate_up_proj_bias,
        moe_align_block_size(ids, cfg.block_m, e),
        k,
        layer.swiglu_alpha,
        layer.swiglu_limit,
        cfg,
    )
    gate_up = torch.stack(
        [
            F.linear(
                hidden[s // k],
                layer.expert_weights(int(ids.view(-1)[s]), torch.float32)[0],
                layer.gate_up_proj_bias[ids.view(-1)[s]],
            )
            for s in range(t * k)
        ]
    )
    assert (gate_up[:, ::2] > layer.swiglu_limit).any() and (gate_up[:, 1::2].abs() > layer.swiglu_limit).any()
    assert_matches(act, clamped_swiglu(gate_up, layer.swiglu_alpha, layer.swiglu_limit), torch.float32)


@pytest.mark.parametrize("mxfp4", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_moe_down_kernel(mxfp4, with_bias):
    e, k, h, i, t = 5, 3, 96, 64, 9  # N = 96 with block_n 64: a masked N tail
    layer = make_layer(e, k, h, i, mxfp4=mxfp4, seed=6)
    ids, weights = routing(t, e, k, seed=7)
    act = torch.randn(t * k, i, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    cfg = MoEConfig(16, 64, 32)
    w = layer_weights(layer)
    bias = layer.down_proj_bias if with_bias else None
    out = fused_moe_down(act, w["down"], w["down_scales"], bias, moe_align_block_size(ids, 16, e), weights, cfg)
    ref = torch.zeros(t, h, device=DEVICE)
    for s in range(t * k):
        expert = int(ids.view(-1)[s])
        y = F.linear(act[s], layer.expert_weights(expert, torch.float32)[1], bias[expert] if with_bias else None)
        ref[s // k] += weights.view(-1)[s] * y
    assert_matches(out, ref, torch.float32)


# ---------------------------------------------------------------- the backend against TorchMoEBackend


def compare_backends(
    layer: FusedMoE,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    **kwargs,
) -> None:
    ref = TorchMoEBackend().forward(layer, hidden, topk_ids, topk_weights)
    if kwargs:
        w = layer_weights(layer)
        out = fused_experts(
            hidden,
            topk_ids,
            topk_weights,
            **w,
            gate_up_bias=layer.gate_up_proj_bias,
            down_bias=layer.down_proj_bias,
            swiglu_alpha=layer.swiglu_alpha,
            swiglu_limit=layer.swiglu_limit,
            **kwargs,
        )
    else:
        out = TritonMoEBackend().forward(layer, hidden, topk_ids, topk_weights)
    assert_matches(out, ref, dtype)


@pytest.mark.parametrize("mxfp4", [True, False])
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_backend_matches_torch(mxfp4, t, k):
    e, h, i = 8, 64, 96
    layer = make_layer(e, k, h, i, mxfp4=mxfp4, seed=t * 10 + k)
    hidden = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    compare_backends(layer, hidden, *routing(t, e, k, seed=k))


@pytest.mark.parametrize("mxfp4", [True, False])
def test_backend_bf16(mxfp4):
    e, k, h, i, t = 8, 4, 64, 96, 17
    layer = make_layer(e, k, h, i, mxfp4=mxfp4, dtype=torch.bfloat16, seed=11)
    hidden = torch.randn(t, h, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.bfloat16)
    ids, weights = routing(t, e, k, seed=13, dtype=torch.bfloat16)
    compare_backends(layer, hidden, ids, weights, dtype=torch.bfloat16)


def test_backend_clamp_active_and_extreme_scales():
    e, k, h, i, t = 4, 2, 64, 64, 17
    layer = make_layer(e, k, h, i, mxfp4=True, seed=21, swiglu_limit=1.5)
    gen = torch.Generator().manual_seed(22)
    for scales in (layer.gate_up_proj_scales, layer.down_proj_scales):  # 2^-127 .. 2^-122 and 2^-27 .. 2^33
        extreme = torch.cat([torch.randint(0, 6, (scales.numel() // 4,)), torch.randint(100, 161, (scales.numel(),))])
        scales.data = extreme[torch.randperm(extreme.numel(), generator=gen)[: scales.numel()]].view(scales.shape)
        scales.data = scales.data.to(torch.uint8).to(DEVICE)
    hidden = torch.randn(t, h, generator=gen).to(DEVICE) * 30
    compare_backends(layer, hidden, *routing(t, e, k, seed=23))


@pytest.mark.parametrize("mxfp4", [True, False])
def test_backend_keeps_a_nan_row_nan(mxfp4):
    """A token whose hidden state is NaN comes out NaN, as from the torch reference, and only that token: the clamp of
    the SwiGLU epilogue propagates it (a GPU's min / max would turn it into the limit and hide it from the
    non-finite guard; the interpreter's numpy propagates either way, so this test bites on a GPU)."""
    e, k, h, i, t = 8, 2, 64, 96, 5
    layer = make_layer(e, k, h, i, mxfp4=mxfp4, seed=41, swiglu_limit=7.0)
    hidden = torch.randn(t, h, generator=torch.Generator().manual_seed(42))
    hidden[2] = float("nan")
    ids, weights = routing(t, e, k, seed=43)
    out = TritonMoEBackend().forward(layer, hidden.to(DEVICE), ids, weights).cpu()
    ref = TorchMoEBackend().forward(layer, hidden.to(DEVICE), ids, weights).cpu()
    assert out[2].isnan().all() and ref[2].isnan().all()
    rows = [0, 1, 3, 4]
    assert torch.isfinite(out[rows]).all()
    torch.testing.assert_close(out[rows], ref[rows], rtol=1e-4, atol=1e-4)


def test_backend_idle_experts_and_one_hot_expert():
    e, k, h, i = 8, 2, 64, 64
    layer = make_layer(e, k, h, i, mxfp4=True, seed=31)
    t = 17  # > block_m: the busy experts each need two blocks; six experts get nothing
    hidden = torch.randn(t, h, generator=torch.Generator().manual_seed(32)).to(DEVICE)
    ids = torch.tensor([[3, 6]] * t, device=DEVICE)
    weights = torch.softmax(torch.randn(t, k, generator=torch.Generator().manual_seed(33)), -1).to(DEVICE)
    compare_backends(layer, hidden, ids, weights)
    compare_backends(layer, hidden, ids[:, :1], torch.ones(t, 1, device=DEVICE))  # k = 1: all to expert 3


@pytest.mark.parametrize(
    "configs",
    [
        (MoEConfig(16, 32, 32), MoEConfig(16, 32, 32)),
        (MoEConfig(32, 64, 64, group_m=4), MoEConfig(32, 64, 32, group_m=2)),
        *([] if CUDA else [(MoEConfig(4, 32, 32), MoEConfig(4, 32, 64))]),  # tl.dot needs M >= 16 on a GPU
    ],
)
def test_backend_tile_shapes(configs):
    e, k, h, i, t = 6, 2, 96, 96, 17  # H = I = 96: masked K tails (block_k 64) and N tails (block_n 64)
    layer = make_layer(e, k, h, i, mxfp4=True, seed=41)
    hidden = torch.randn(t, h, generator=torch.Generator().manual_seed(42)).to(DEVICE)
    compare_backends(layer, hidden, *routing(t, e, k, seed=43), configs=configs)


GEMV = (MoEConfig(1, 32, 64, gemv=True), MoEConfig(1, 64, 32, gemv=True))  # H = I = 96: K and N tails


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k", [(1, 4), (3, 2), (17, 2)])
def test_gemv_matches_torch(monkeypatch, dtype, t, k):
    """The decode GEMV (one slot a program, no alignment): masked K tails (96 inputs, 64 a step), N tails (96
    outputs, 64 a tile), biases, the SwiGLU pairs and the routing weight, slots sharing an expert (t = 17)."""
    import brisk.kernels.triton_moe as triton_moe

    monkeypatch.setattr(triton_moe, "moe_align_block_size", lambda *a, **kw: pytest.fail("GEMV needs no alignment"))
    e, h, i = 6, 96, 96
    layer = make_layer(e, k, h, i, mxfp4=True, dtype=dtype, seed=70 + t)
    hidden = torch.randn(t, h, generator=torch.Generator().manual_seed(71)).to(DEVICE, dtype)
    ids, weights = routing(t, e, k, seed=72, dtype=dtype)
    compare_backends(layer, hidden, ids, weights, dtype=dtype, configs=GEMV)


def test_gemv_keeps_nan_and_skips_other_ranks_experts():
    layer = make_layer(8, 2, 96, 96, mxfp4=True, seed=73, swiglu_limit=7.0)
    hidden = torch.randn(5, 96, generator=torch.Generator().manual_seed(74)).to(DEVICE)
    hidden[2] = float("nan")
    ids, weights = routing(5, 8, 2, seed=75)
    local = torch.where(ids >= 4, ids - 4, -1)  # as an EP rank of two sees them: -1 adds nothing
    local[0] = torch.tensor([0, 1])  # one token wholly local
    local[2, 0] = 2  # the NaN token has a local expert
    assert (local < 0).any()
    weights = weights * (local >= 0)
    w = layer_weights(layer)
    kw = dict(swiglu_alpha=layer.swiglu_alpha, swiglu_limit=layer.swiglu_limit, unrouted_slots=True, configs=GEMV)
    out = fused_experts(
        hidden, local, weights, **w, gate_up_bias=layer.gate_up_proj_bias, down_bias=layer.down_proj_bias, **kw
    )
    ref = TorchMoEBackend().forward(layer, hidden, local.clamp(min=0), weights)
    rows = [r for r in range(5) if r != 2]
    assert out[2].isnan().all() and torch.isfinite(out[rows]).all()
    assert_matches(out[rows], ref[rows], torch.float32)


def test_backend_tp_rank_without_down_bias():
    layer = make_layer(4, 2, 64, 128, mxfp4=True, seed=51, parallel=ParallelConfig.for_rank(1, 2))
    assert layer.intermediate_size == 64 and layer.moe_tp_rank == 1
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(52)).to(DEVICE)
    compare_backends(layer, hidden, *routing(3, 4, 2, seed=53))


@pytest.mark.parametrize("mxfp4", [True, False])
def test_backend_ep_rank_skips_other_ranks_experts(mxfp4):
    # ep_size 2: this rank holds experts 4..7 of 8; slots routed to experts 0..3 arrive as -1 and add nothing.
    layer = make_layer(8, 2, 64, 64, mxfp4=mxfp4, seed=54, parallel=ParallelConfig.for_rank(1, 2, ep_size=2))
    assert layer.num_local_experts == 4 and layer.first_expert == 4
    ids, weights = routing(9, 8, 2, seed=55)
    local = torch.where(ids >= 4, ids - 4, -1)
    assert (local < 0).any() and (local >= 0).any()
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(56)).to(DEVICE)
    ref = TorchMoEBackend().forward(layer, hidden, local, weights * (local >= 0))
    only_local = TorchMoEBackend().forward(layer, hidden, local.clamp(min=0), weights * (local >= 0))
    torch.testing.assert_close(ref, only_local)  # the reference itself ignores the -1 slots
    out = TritonMoEBackend().forward(layer, hidden, local, weights * (local >= 0))
    assert_matches(out, ref, torch.float32)


def test_backend_sizes_tiles_by_all_ranks_experts_under_ep(monkeypatch):
    """Under EP a rank's experts get 1 / ep_size of the slots: the tiles are sized by the slots an expert can expect
    (tokens x top_k over all experts), as the start-up warm-up's tiers are."""
    import brisk.kernels.triton_moe as triton_moe

    layer = make_layer(8, 2, 64, 64, mxfp4=True, seed=54, parallel=ParallelConfig.for_rank(1, 2, ep_size=2))
    sized: list[int] = []
    config = triton_moe.default_config
    monkeypatch.setattr(
        triton_moe, "default_config", lambda t, k, e, *a, **kw: (sized.append(e), config(t, k, e, *a, **kw))[1]
    )
    ids, weights = routing(9, 8, 2, seed=55)
    local = torch.where(ids >= 4, ids - 4, -1)
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(56)).to(DEVICE)
    TritonMoEBackend().forward(layer, hidden, local, weights * (local >= 0))
    assert sized == [8, 8]  # gate_up and down: all 8 experts, not this rank's 4
    assert TritonMoEBackend().variant_token_counts(layer) == triton_moe.tier_token_counts(2, 8)


def test_fused_moe_layer_with_triton_backend():
    layer = make_layer(8, 4, 64, 64, mxfp4=True, seed=61)
    triton_layer = FusedMoE(8, 4, 64, 64, quantization="mxfp4")
    triton_layer.backend = make_moe_backend("triton")  # as the runner binds it
    triton_layer.load_state_dict(layer.state_dict())
    assert isinstance(triton_layer.backend, TritonMoEBackend) and triton_layer.backend.name == "triton"
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(62)).to(DEVICE)
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(63)).to(DEVICE)
    assert_matches(triton_layer.to(DEVICE)(hidden, logits), layer(hidden, logits), torch.float32)
    assert triton_layer(hidden[:0], logits[:0]).shape == (0, 64)


def test_backend_choice(monkeypatch):
    assert make_moe_backend("torch").name == "torch"
    assert isinstance(make_moe_backend("triton"), TritonMoEBackend)
    assert make_moe_backend("auto").name == ("triton" if CUDA else "torch")
    with pytest.raises(ValueError, match="auto, torch, triton"):
        make_moe_backend("cuda-magic")
    # Outside the interpreter, CPU tensors are an error for 'triton' and fall back to torch for 'auto'.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layer = make_layer(4, 2, 32, 32, mxfp4=True).cpu()
    hidden = torch.randn(2, 32)
    ids, weights = select_experts(torch.randn(2, 4), 2)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        TritonMoEBackend().forward(layer, hidden, ids, weights)
    torch.testing.assert_close(
        TritonMoEBackend(torch_fallback=True).forward(layer, hidden, ids, weights),
        TorchMoEBackend().forward(layer, hidden, ids, weights),
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layer = make_layer(4, 2, 32, 32, mxfp4=False).to(DEVICE)
    layer.gate_up_halves = True  # as the CPU kernels' prepack leaves a bf16 layer: the kernels would misread it
    with pytest.raises(RuntimeError, match="prepacked for the CPU kernels"):
        TritonMoEBackend().forward(layer, hidden.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE))


def test_default_config_block_m_follows_slots_per_expert():
    # MXFP4 decode up to a slot per expert: the GEMV (120b: 32 tokens; 20b: 8); bf16 weights never take it
    assert default_config(1, 4, 128, 5760, 2880, mxfp4=True).gemv
    assert default_config(32, 4, 128, 5760, 2880, mxfp4=True).gemv
    assert not default_config(33, 4, 128, 5760, 2880, mxfp4=True).gemv
    assert not default_config(1, 4, 128, 5760, 2880, mxfp4=False).gemv
    assert default_config(1, 4, 128, 5760, 2880, mxfp4=False).block_m == 16
    assert default_config(64, 4, 128, 5760, 2880, mxfp4=True).block_m == 16
    assert default_config(8192, 4, 128, 5760, 2880, mxfp4=True).block_m == 128
    # Decode: block_m covers each expert's slots, so every touched expert is one block (weights read once).
    for t in (48, 64):
        ids, _ = routing(t, 128, 4, seed=t)
        align = moe_align_block_size(ids, default_config(t, 4, 128, 5760, 2880, mxfp4=True).block_m, 128)
        touched = int(ids.unique().numel())
        assert int((align.expert_ids >= 0).sum()) == touched
    tiny = default_config(1, 4, 8, 64, 96, mxfp4=False)
    assert tiny.block_n == 64 and tiny.block_k == 128  # clamped to the matrix


# ---------------------------------------------------------------- real gpt-oss shapes (GPU only)


@needs_cuda
@pytest.mark.parametrize("t", [1, 8, 64, 512, 640])
@pytest.mark.parametrize("mxfp4", [True, False])
def test_gpt_oss_120b_shapes_on_gpu(t, mxfp4):
    e, k, h = (128, 4, 2880) if mxfp4 else (32, 4, 2880)  # bf16 experts at E=32 (gpt-oss-20b) to save memory
    layer = make_layer(e, k, h, h, mxfp4=mxfp4, dtype=torch.bfloat16, seed=t, scale_range=(118, 122))
    hidden = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(DEVICE, torch.bfloat16)
    ids, weights = routing(t, e, k, seed=t, dtype=torch.bfloat16)
    compare_backends(layer, hidden, ids, weights, dtype=torch.bfloat16)


@needs_cuda
def test_alignment_at_prefill_size_on_gpu():
    ids, _ = routing(4096, 128, 4, seed=0)
    check_alignment(ids, 64, 128)  # over programs
    check_alignment(ids, 64, 128, one_program_max_slots=1 << 20)  # one program
