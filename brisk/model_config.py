"""What brisk knows of a model and of a rank's place: `ModelConfig`, read from the model's HF `config.json` and
`generation_config.json` (the compute dtype resolved for the device), and `ParallelConfig`, the rank's share of the
tensor / expert / attention-DP layout. The model side reads these two and nothing of the option table
(`brisk/config.py`), so layers and models import no serving options.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from brisk.errors import ConfigError
from brisk.host import cpu_has_native_bf16


@dataclass
class ModelConfig:
    """What the engine needs to know about a model, read from its HF `config.json`."""

    path: str
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str
    dtype: Any  # torch.dtype
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    layer_types: list[str]  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None
    eos_token_ids: list[int]
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def text_config(self) -> Any:
        return hf_text_config(self.hf_config)

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "auto", device_type: str = "cpu") -> ModelConfig:
        import torch
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path)
        archs = getattr(hf, "architectures", None) or []
        if not archs:
            raise ConfigError(f"{path}/config.json names no 'architectures'")
        text = hf_text_config(hf)
        n_layers = text.num_hidden_layers
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        window = getattr(text, "sliding_window", None)
        layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * n_layers)
        if window is None:
            layer_types = ["full_attention"] * n_layers
        gen = read_generation_config(path)
        eos = gen.get("eos_token_id", getattr(text, "eos_token_id", None))
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(
            path=path,
            hf_config=hf,
            architecture=archs[0],
            dtype=_resolve_dtype(dtype, hf, device_type, torch),
            num_layers=n_layers,
            hidden_size=text.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=text.vocab_size,
            max_position_embeddings=getattr(text, "max_position_embeddings", 2048),
            layer_types=layer_types,
            sliding_window=window if "sliding_attention" in layer_types else None,
            eos_token_ids=eos_ids,
            generation_defaults=sampling_defaults(gen),
        )


def hf_text_config(hf: Any) -> Any:
    """The text model's part of a Hugging Face config (a multimodal config nests it; a text-only one is it)."""
    get_text_config = getattr(hf, "get_text_config", None)
    return get_text_config() if get_text_config is not None else hf


def read_generation_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


# A generation config's keys that are default sampling parameters (vLLM's list, but skip_special_tokens: brisk's
# is always true); max_new_tokens is Hugging Face's max_tokens.
SAMPLING_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def sampling_defaults(gen: dict[str, Any], max_new_tokens: bool = False) -> dict[str, Any]:
    """The default sampling parameters a generation config gives; max_new_tokens: its max_new_tokens too, as
    max_tokens (a request's default and its cap, as vLLM takes it from --generation-config DIR or
    --override-generation-config)."""
    out = {k: gen[k] for k in SAMPLING_DEFAULT_KEYS if gen.get(k) is not None}
    if max_new_tokens and gen.get("max_new_tokens") is not None:
        out["max_tokens"] = gen["max_new_tokens"]
    return out


CPU_BF16_MIN_HIDDEN_SIZE = 128


def _resolve_dtype(dtype: str, hf: Any, device_type: str, torch: Any) -> Any:
    if dtype != "auto":
        return getattr(torch, dtype)
    declared = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    if device_type == "cpu":
        # As on GPUs (and in vLLM), an fp32 or bf16 checkpoint computes in bf16, where the CPU multiplies bf16
        # natively and the matrices are big enough for it to pay: half the weight and KV bytes per token (with
        # brisk's CPU kernels, the demo model at hidden size 128: level at batch 1 and 8, 1.18x at 32;
        # docs/performance.md). Otherwise fp32, the reference path; `dtype: float32` keeps it everywhere.
        text = hf_text_config(hf)
        big_enough = getattr(text, "hidden_size", 0) >= CPU_BF16_MIN_HIDDEN_SIZE
        low_precision = declared in (torch.float32, torch.bfloat16, None) and big_enough and cpu_has_native_bf16()
        return torch.bfloat16 if low_precision else torch.float32
    return declared if declared in (torch.float16, torch.bfloat16) else torch.bfloat16


@dataclass(frozen=True)
class ParallelConfig:
    """This process's place in the parallel layout; layers shard their weights by it.

    A job is one world of tp_size ranks (trtllm-serve's meaning of --tp_size). Attention and dense layers
    are split tp_size ways, or, with attention data parallel, replicated on every rank (tp_size 1 here)
    while each rank (dp_rank) runs its own batch. MoE experts are split ep_size ways by expert (ep_rank)
    and moe_tp_size ways by intermediate size (moe_tp_rank), ep_size * moe_tp_size being the world, so
    every MoE layer ends with one reduction over the whole world.
    """

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    moe_tp_rank: int = 0
    moe_tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @classmethod
    def for_rank(cls, rank: int, world_size: int, ep_size: int = 1, attention_dp: bool = False) -> ParallelConfig:
        moe_tp_size = world_size // ep_size
        return cls(
            tp_rank=0 if attention_dp else rank,
            tp_size=1 if attention_dp else world_size,
            ep_rank=rank // moe_tp_size,
            ep_size=ep_size,
            moe_tp_rank=rank % moe_tp_size,
            moe_tp_size=moe_tp_size,
            dp_rank=rank if attention_dp else 0,
            dp_size=world_size if attention_dp else 1,
        )
