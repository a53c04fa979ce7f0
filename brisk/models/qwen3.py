"""Qwen3 (dense): Llama with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from brisk.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
