"""FP8 KV cache: E4M3 storage with static scales per layer, KV head, K and V (kv_cache_config.dtype: fp8).

A value x of the model's dtype is stored as `e4m3(clamp(x / scale, -448, 448))` and read back as `e4m3 * scale`,
accumulated in fp32. The scales never change after loading (the checkpoint's `k_scale` / `v_scale`, per tensor,
else 1.0: gpt-oss, Llama and Qwen3 keys and values stay well inside E4M3's range of +-448, and E4M3's relative
precision is the same at any magnitude down to 2^-6). Static scales keep a block's bytes self-contained: a block can
be copied (prefix caching, a host tier) as raw bytes with no per-block metadata.

Every attention path reads through these: the torch reference (layers/attention.py), the C decode kernel (scales
folded into the score scale and the output) and the Triton kernels (the same, in registers; on GPUs before sm_89,
where Triton has no E4M3 type, from the cache's bytes as codes converted by integer ops).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
# vLLM / ModelOpt / compressed-tensors checkpoints: model.layers.N.self_attn{.k_proj|.attn|}.{k,v}_scale, and the
# deprecated .kv_scale (one scale for both).
_KV_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:[a-z_]+\.)?(k_scale|v_scale|kv_scale)$")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, KVH, D] -> E4M3 of x / scale (scale [KVH] fp32), saturated at +-448 (E4M3 has no infinity)."""
    return (x.float() / scale[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., KVH, D] (any cache dtype) -> fp32; an FP8 cache's values times their KV head's scale."""
    if not is_fp8(x):
        return x.float()
    return x.float() * scale[:, None]


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as uint8 (for the gathers and fills torch does not implement on float8), else itself."""
    return cache.view(torch.uint8) if is_fp8(cache) else cache


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer index, 'k_scale' | 'v_scale' | 'kv_scale') of a checkpoint's KV scale tensor, None for other names."""
    match = _KV_SCALE_NAME.search(name)
    return (int(match.group(1)), match.group(2)) if match else None


def split_kv_scales(
    weights: Iterable[tuple[str, torch.Tensor]], scales: dict[tuple[int, str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the checkpoint's tensors on, keeping its KV scales in `scales` instead ({(layer, kind): tensor})."""
    for name, tensor in weights:
        target = kv_scale_target(name)
        if target is None:
            yield name, tensor
        elif target[1] == "kv_scale":
            scales[(target[0], "k_scale")] = scales[(target[0], "v_scale")] = tensor
        else:
            scales[target] = tensor
