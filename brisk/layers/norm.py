"""RMSNorm with Hugging Face numerics: the normalisation runs in fp32 whatever the model dtype."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from brisk.kernels.cpu_kernels import CpuKernels
from brisk.layers.linear import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    """`weight_in_fp32` picks where the cast back to the model dtype happens, which differs by model in HF:
    Llama/Qwen3 cast before multiplying by the weight, gpt-oss multiplies in fp32 then casts."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)
        self.cpu_kernels: CpuKernels | None = None  # bound by the CPU model runner (cpu_kernels: true)
        # (x, weight, eps, weight_in_fp32) -> y in one launch: brisk.kernels.triton_norm, bound on a GPU
        self.fused: Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None and self.cpu_kernels.rms_norm_accepts(x, self.weight):
            # One C call instead of ~6 torch ops; same fp32 math, summed in another order (~1e-7 relative).
            return self.cpu_kernels.rms_norm(x, self.weight, self.eps, self.weight_in_fp32)
        # the kernel writes x's dtype: a weight of another dtype after the cast (promoting) stays on torch
        if self.fused is not None and x.stride(-1) == 1 and (self.weight_in_fp32 or self.weight.dtype == x.dtype):
            return self.fused(x, self.weight, self.eps, self.weight_in_fp32)
        input_dtype = x.dtype
        # F.rms_norm is HF's x * rsqrt(mean(x^2) + eps) in one op (bit-identical: tests/test_layers.py).
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.weight_in_fp32:
            return (self.weight * x32).to(input_dtype)
        return self.weight * x32.to(input_dtype)
