"""MXFP4 (OCP microscaling FP4) as stored in gpt-oss checkpoints.

A block of 32 values along the input dim shares one E8M0 scale byte (value = 2^(byte - 127)); each value
is an E2M1 nibble, two per byte, the LOW nibble holding the even element. Layouts:
    blocks uint8 [..., out, in / 32, 16], scales uint8 [..., out, in / 32].
"""

from __future__ import annotations

import torch

MXFP4_BLOCK_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., out, G, 16] + scales [..., out, G] -> weights [..., out, G * 32] in `dtype`.

    Computed in fp32, where every E2M1 value times a power of two is exact, then cast once.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK_SIZE // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., out, G, 32], low nibble first
    scale = torch.exp2(scales.to(torch.float32) - E8M0_BIAS).unsqueeze(-1)
    return (values * scale).flatten(-2).to(dtype)
