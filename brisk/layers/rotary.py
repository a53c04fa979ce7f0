"""Rotary position embedding, computed exactly as Hugging Face does it.

Inverse frequencies (and the YaRN attention scaling) come from `transformers.modeling_rope_utils`, so
every static RoPE variant HF supports (default, linear, llama3, yarn, ...) is the same numbers here.
Rotation is neox style: the head dim is split in two halves (HF's `rotate_half`). cos/sin are computed
per call from the positions, the same ops in the same order as HF, so the result is bit-identical.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# These depend on the current sequence length, not just on the position, so a per-token cos/sin is not enough.
_SEQ_LEN_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_inv_freq(hf_text_config: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32 on CPU, attention_scaling) for an HF text config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_text_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in _SEQ_LEN_DEPENDENT_ROPE:
        raise ValueError(f"rope_type '{rope_type}' is not supported (it depends on the sequence length)")
    with torch.device("cpu"):  # the model may be built under a meta/cuda default device
        if rope_type == "default":
            return _default_inv_freq(hf_text_config, params), 1.0
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unknown rope_type '{rope_type}'; known: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_text_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def _default_inv_freq(config: Any, params: dict) -> torch.Tensor:
    # Same formula as HF's `compute_default_rope_parameters` (a static method of each model's rotary class).
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flat q [T, H*D] and k [T, KVH*D] at the given positions [T]."""

    inv_freq: torch.Tensor  # a buffer (register_buffer), so nn.Module's __getattr__ would type it loosely

    def __init__(self, hf_text_config: Any, head_dim: int) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(hf_text_config)
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.numel()
        if self.rotary_dim > head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} > head_dim {head_dim}")
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # see set_step_positions

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, rotary_dim / 2], scaled by the YaRN attention factor, cast to the activation dtype."""
        freqs = positions[:, None].float() * self.inv_freq.float()
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)

    def set_step_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        """cos/sin for a forward step's positions, computed once for all layers (the model calls this first)."""
        self._step = (positions, *self.cos_sin(positions, dtype))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads * head_dim] (any number of heads: q and k together cost one pass) at the positions."""
        if self._step is not None and self._step[0] is positions and self._step[1].dtype == x.dtype:
            cos, sin = self._step[1], self._step[2]
        else:
            cos, sin = self.cos_sin(positions, x.dtype)
        return self._rotate(x, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, x.shape[-1] // self.head_dim, self.head_dim)
        cos, sin = cos[:, None, :], sin[:, None, :]
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half : self.rotary_dim]
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rotary_dim < self.head_dim:
            parts.append(x[..., self.rotary_dim :])
        return torch.cat(parts, dim=-1).reshape(t, x.shape[1] * self.head_dim)
