"""The one-launch RMSNorm (brisk/kernels/triton_norm.py) against the torch path of brisk.layers.norm.RMSNorm.

Without CUDA the kernel runs in Triton's CPU interpreter; with CUDA the same tests run on the GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from brisk.kernels.triton_norm import rms_norm
from brisk.layers.norm import RMSNorm
from brisk.model_config import ModelConfig
from brisk.model_runner.binding import Kernels, bind
from brisk.model_runner.loader import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _norm(d: int, dtype: torch.dtype, weight_in_fp32: bool, seed: int) -> RMSNorm:
    norm = RMSNorm(d, eps=1e-5, weight_in_fp32=weight_in_fp32)
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = (1 + 0.3 * torch.randn(d, generator=gen)).to(DEVICE, dtype)
    return norm


@pytest.mark.parametrize("weight_in_fp32", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2880), (5, 96), (3, 4, 64)])  # gpt-oss's width, a masked tail, 3-d heads
def test_fused_norm_matches_the_torch_path(weight_in_fp32, dtype, shape):
    norm = _norm(shape[-1], dtype, weight_in_fp32, seed=len(shape))
    gen = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=gen) * 3).to(DEVICE, dtype)
    ref = norm(x)
    out = rms_norm(x, norm.weight, norm.eps, weight_in_fp32)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    else:  # the same fp32 value up to the sum's order, rounded: at most one bf16 step apart, and rarely
        step = 2.0 ** (torch.floor(torch.log2(ref.float().abs().clamp(min=1e-30))) - 7)
        diff = (out.float() - ref.float()).abs()
        if DEVICE == "cuda":
            assert (diff <= step).all() and (diff > 0).float().mean() < 0.02
        else:  # the interpreter casts fp32 to bf16 by truncation, a step off at each of the two roundings (the
            # first at y's magnitude, times the weight): up to 3 of the result's steps
            assert (diff <= 4 * step).all()


def test_fused_norm_reads_rows_of_a_strided_view_and_keeps_zero_rows_finite():
    norm = _norm(64, torch.float32, True, seed=3)
    base = torch.randn(6, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    x = base[:, 32:96]  # rows 128 apart, features contiguous
    x[2] = 0.0
    out = rms_norm(x, norm.weight, norm.eps, True)
    torch.testing.assert_close(out, norm(x), rtol=2e-6, atol=1e-6)
    assert torch.isfinite(out).all() and (out[2] == 0).all()


def test_a_bound_norm_computes_the_model_as_the_torch_path_does(tmp_path):
    """A bound model (as the runner binds it on a GPU) gives the torch path's logits; a weight of another dtype
    than x (whose torch result would be promoted) stays on torch."""
    from brisk.config import EngineConfig
    from brisk.model_runner.binding import make_kernels
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0)
    model = load_model(ModelConfig.from_pretrained(str(path), dtype="float32"), device=DEVICE)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms
    x = torch.randn(3, norms[0].weight.numel(), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    before = [n(x) for n in norms]
    kernels = make_kernels(EngineConfig(model=str(path), device=DEVICE), torch.device(DEVICE))
    bind(model, Kernels(kernels.attention, kernels.moe, kernels.cpu, rms_norm))
    assert all(n.fused is rms_norm for n in norms)
    for norm, ref in zip(norms, before, strict=True):
        torch.testing.assert_close(norm(x), ref, rtol=2e-6, atol=1e-6)
    mixed = _norm(64, torch.float32, False, seed=6)
    mixed.fused = lambda *a: pytest.fail("a weight of another dtype than x stays on torch")
    assert mixed(torch.randn(2, 64).to(DEVICE, torch.bfloat16)).dtype == torch.float32
