"""gpt-oss: Llama-family decoder with biased attention + learned sinks, alternating sliding/full attention
(from `config.layer_types`), YaRN RoPE, and a top-k routed MoE whose experts may be MXFP4-packed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from brisk.layers.attention import AttentionMetadata
from brisk.layers.linear import ReplicatedLinear
from brisk.layers.moe import FusedMoE
from brisk.layers.rotary import RotaryEmbedding
from brisk.model_config import ModelConfig, ParallelConfig
from brisk.models.llama import CausalLM, DecoderAttention, DecoderLayer, text_config


def expert_quantization(hf_config: Any) -> str | None:
    """'mxfp4' when the checkpoint stores experts MXFP4-packed, None for bf16/fp32 experts."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    get = qc.get if isinstance(qc, dict) else lambda key, default=None: getattr(qc, key, default)
    method = get("quant_method")
    if method != "mxfp4":
        raise ValueError(f"unsupported quantization_config.quant_method '{method}' for gpt-oss (supported: mxfp4)")
    return None if get("dequantize", False) else "mxfp4"


class GptOssMLP(nn.Module):
    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        cfg = text_config(model_config)
        self.router = ReplicatedLinear(model_config.hidden_size, cfg.num_local_experts, bias=True, parallel=parallel)
        self.experts = FusedMoE(
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            model_config.hidden_size,
            cfg.intermediate_size,
            swiglu_alpha=getattr(cfg, "swiglu_alpha", 1.702),
            swiglu_limit=getattr(cfg, "swiglu_limit", 7.0),
            quantization=expert_quantization(model_config.hf_config),
            parallel=parallel,
        )

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.experts(x, self.router(x), meta.dp_num_tokens)


class GptOssForCausalLM(CausalLM):
    # Only q/k/v are fused; expert tensors keep their checkpoint names (FusedMoE converts the layout).
    stacked_params_mapping = CausalLM.stacked_params_mapping[:3]
    norm_weight_in_fp32 = True  # HF gpt-oss multiplies by the norm weight before casting back

    def make_layer(self, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        mc, cfg = self.model_config, text_config(self.model_config)
        attn = DecoderAttention(
            mc, layer_idx, rotary, self.parallel, bias=getattr(cfg, "attention_bias", True), sinks=True
        )
        mlp = GptOssMLP(mc, self.parallel)
        return DecoderLayer(attn, mlp, mc.hidden_size, cfg.rms_norm_eps, norm_weight_in_fp32=True)
