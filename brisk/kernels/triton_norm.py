"""RMSNorm in one Triton kernel for CUDA tensors (brisk.layers.norm.RMSNorm binds it on a GPU).

The torch path is four launches a norm (the cast to fp32, F.rms_norm, the weight's multiply, the cast back): the
first H100 profile of gpt-oss-120b at batch 1 had ~950 us of a 7.7 ms step in such small elementwise kernels, two
norms a layer among them. One program a row reads it once, sums the squares in fp32 and writes the model dtype.

The math is the torch path's: x * rsqrt(mean(x^2) + eps) in fp32, then either the weight multiplied in fp32 and one
rounding (gpt-oss, weight_in_fp32) or a rounding to the model dtype, then the weight's multiply and a second
rounding (Llama, Qwen3), as HF does. Only the order of the sum of squares differs (~1e-7 relative in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_out,
    D,
    eps,
    WEIGHT_IN_FP32: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    y = x * inv
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_IN_FP32:
        out = w * y
    else:  # rounded to the model dtype before the weight, as HF's Llama / Qwen3 norms
        out = w * y.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """x [..., D] with contiguous features -> x's shape and dtype (the caller keeps other cases on torch)."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)  # a view for rows of one stride (every activation here); else a copy
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        weight,
        out,
        rows.stride(0),
        out.stride(0),
        d,
        eps,
        WEIGHT_IN_FP32=weight_in_fp32,
        BLOCK=block,
        num_warps=max(1, min(8, block // 512)),  # 2880 wide (gpt-oss): 4096 lanes over 8 warps
    )
    return out.view(x.shape)
