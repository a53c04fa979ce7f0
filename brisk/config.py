"""Engine configuration: trtllm-serve option names, from CLI-style keyword args plus a YAML file.

`EngineConfig.build(model, yaml_path=..., **options)` is the one way in. Options are validated by
pydantic (unknown keys and wrong types fail, naming the key); defaults that depend on the model are
filled in from its `config.json` / `generation_config.json` through `ModelConfig`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from brisk.errors import ConfigError
from brisk.host import check_cpu_kernels_choice, cpu_has_native_bf16
from brisk.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("brisk.config")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True)


class KvCacheConfig(_Strict):
    enable_block_reuse: bool = True
    tokens_per_block: int = Field(default=32, ge=1, le=1024)
    free_gpu_memory_fraction: float | None = Field(default=None, gt=0.0, le=1.0)
    # CPU / explicit sizing: a fixed number of blocks overrides the memory fraction.
    max_blocks: int | None = Field(default=None, ge=2)


class CudaGraphConfig(_Strict):
    max_batch_size: int = Field(default=256, ge=0)
    enable_padding: bool = True
    batch_sizes: list[int] | None = None


class MoeConfig(_Strict):
    backend: Literal["auto", "torch", "triton"] = "auto"

    @field_validator("backend", mode="before")
    @classmethod
    def _lower_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value  # TensorRT-LLM's YAMLs write TRITON


class EngineConfig(_Strict):
    """Everything the engine core needs. Field names follow trtllm-serve's LLM API options."""

    model: str
    tokenizer: str | None = None
    revision: str | None = None
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    seed: int = 0
    trust_remote_code: bool = False

    max_batch_size: int = Field(default=256, ge=1)
    max_num_tokens: int = Field(default=8192, ge=1)
    max_seq_len: int | None = Field(default=None, ge=1)
    max_num_waiting: int = Field(default=4096, ge=0)
    enable_chunked_prefill: bool = True
    kv_cache_free_gpu_memory_fraction: float = Field(default=0.9, gt=0.0, le=1.0)
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    tokens_per_block: int | None = Field(default=None, ge=1, le=1024)
    cuda_graph_config: CudaGraphConfig | None = Field(default_factory=CudaGraphConfig)
    # Overlap scheduling: schedule and prepare step N+1 while step N runs (trtllm's key). None: on for GPUs; off
    # on CPUs, where the device work is not asynchronous and overlap only adds a wasted token per finish.
    disable_overlap_scheduler: bool | None = None
    moe_config: MoeConfig = Field(default_factory=MoeConfig)
    attn_backend: Literal["auto", "torch", "triton", "cpu"] = "auto"
    # Verify KV block accounting (free + used = total, one reference per table entry) after every step:
    # for soak tests and debugging, it walks every block.
    check_kv_invariants: bool = False
    stream_interval: int = Field(default=1, ge=1)
    # Structured outputs: a grammar (JSON schema, regex...) not compiled within this many seconds is a 400.
    grammar_compile_timeout_s: float = Field(default=10.0, gt=0.0)
    # The longest whitespace run constrained JSON may hold (indentation included): bounded so that a model cannot
    # loop on whitespace until max_tokens (a known failure of unbounded JSON grammars).
    grammar_max_json_whitespace: int = Field(default=32, ge=1)
    # CPU serving: torch intra-op threads of the engine process and of each worker rank. None: the host's
    # cores but one (left to the API server) shared among the ranks (measured best, docs/performance.md).
    num_cpu_threads: int | None = Field(default=None, ge=1)
    # CPU serving of bf16 weights: reorder them once into oneDNN's blocked layout (faster matmuls, one more
    # copy of the weights in memory): bf16 experts, and dense layers where brisk's CPU kernels are not bound (see
    # layers/linear.py:prepack_cpu_weight); off: plain torch matmuls on the loaded tensors.
    cpu_weight_prepack: bool = True
    # CPU serving: brisk's C kernels (brisk/kernels/cpu_kernels.c: decode attention, RMSNorm, gpt-oss's activation
    # and experts, decode-sized matmuls, random sampling), built with the system C compiler at first use for one
    # instruction set. auto (or true): the best this CPU runs, AVX-512 then AVX2 + FMA, PyTorch ops where neither
    # (or no compiler); avx512 / avx2: that build, an error if the CPU lacks it (avx2 on an AVX-512 machine runs
    # what AVX2-only CPUs run); torch (or false): PyTorch ops only, the reference paths.
    cpu_kernels: Literal["auto", "avx512", "avx2", "torch"] = "auto"
    enable_attention_dp: bool = False
    # Speculative decoding (brisk/spec_decode): trtllm's keys, or vLLM's speculative config (a dict with "method").
    speculative_config: SpeculativeConfig | None = None
    tp_size: int = Field(default=1, ge=1)
    ep_size: int = Field(default=1, ge=1)

    @field_validator("cpu_kernels", mode="before")
    @classmethod
    def _cpu_kernels_from_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # the field's first form: true = the kernels where they build, false = torch
            return "auto" if value else "torch"
        return value

    @field_validator("cpu_kernels")
    @classmethod
    def _cpu_kernels_supported(cls, value: str) -> str:
        check_cpu_kernels_choice(value)
        return value

    @property
    def block_size(self) -> int:
        return self.tokens_per_block or self.kv_cache_config.tokens_per_block

    @property
    def enable_prefix_caching(self) -> bool:
        return self.kv_cache_config.enable_block_reuse

    @property
    def memory_fraction(self) -> float:
        return self.kv_cache_config.free_gpu_memory_fraction or self.kv_cache_free_gpu_memory_fraction

    @classmethod
    def build(cls, model: str, yaml_path: str | os.PathLike | None = None, **options: Any) -> EngineConfig:
        """Merge YAML (lower precedence) and keyword options (higher); validate; name the bad key on error."""
        merged: dict[str, Any] = {}
        if yaml_path is not None:
            merged.update(load_yaml_options(yaml_path))
        merged.update({k.replace("-", "_"): v for k, v in options.items() if v is not None})
        merged["model"] = model
        try:
            cfg = cls(**merged)
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None
        if cfg.tp_size % cfg.ep_size != 0:
            raise ConfigError(
                f"ep_size ({cfg.ep_size}) must divide tp_size ({cfg.tp_size}): the MoE runs on the tp_size ranks, "
                f"split ep_size ways by expert and tp_size / ep_size ways by intermediate size"
            )
        if not cfg.enable_chunked_prefill and cfg.max_seq_len is not None and cfg.max_seq_len > cfg.max_num_tokens:
            raise ConfigError(
                f"max_seq_len ({cfg.max_seq_len}) > max_num_tokens ({cfg.max_num_tokens}) needs enable_chunked_prefill"
            )
        if _device_type(cfg.device) == "cpu":
            cfg, notes = cfg.without_gpu_only_options()
            for note in notes:
                logger.info("%s", note)
        return cfg

    def without_gpu_only_options(self) -> tuple[EngineConfig, list[str]]:
        """For a CPU: the options given that only a CUDA GPU acts on, as log lines (one YAML serves both, so they
        are accepted, not rejected), and the config with the Triton backends back to auto."""
        given, notes = self.model_fields_set, []
        changes: dict[str, Any] = {}
        if "cuda_graph_config" in given and self.cuda_graph_config is not None:
            notes.append(
                "cuda_graph_config on a CPU: decode steps run on the padded static buffers, uncaptured (no CUDA graphs)"
            )
        if self.moe_config.backend == "triton":
            notes.append("moe_config.backend 'triton' means nothing on a CPU: the CPU MoE path runs")
            changes["moe_config"] = MoeConfig(backend="auto")
        if self.attn_backend == "triton":
            notes.append("attn_backend 'triton' means nothing on a CPU: the CPU attention path runs")
            changes["attn_backend"] = "auto"
        if "kv_cache_free_gpu_memory_fraction" in given or self.kv_cache_config.free_gpu_memory_fraction is not None:
            notes.append(
                "kv_cache_free_gpu_memory_fraction is a share of GPU memory; on a CPU the KV cache takes that share "
                "of the available RAM, at most 2 GiB (kv_cache_config.max_blocks sets it exactly)"
            )
        return (self.model_copy(update=changes) if changes else self), notes


def _device_type(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(device).type
    except RuntimeError:
        return device  # not a device name: the runner reports it when it builds the model


def load_yaml_options(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read options file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"options file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"options file {path} must hold a mapping of option names to values")
    return data


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown option '{key}'")
        else:
            parts.append(f"option '{key}': {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


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
        gen = _read_generation_config(path)
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
            generation_defaults={
                k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in gen
            },
        )


def hf_text_config(hf: Any) -> Any:
    """The text model's part of a Hugging Face config (a multimodal config nests it; a text-only one is it)."""
    get_text_config = getattr(hf, "get_text_config", None)
    return get_text_config() if get_text_config is not None else hf


def _read_generation_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


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


def load_model_config(
    config: EngineConfig, device: Any, model_config: ModelConfig | None = None
) -> tuple[ModelConfig, int]:
    """The model's config (dtype resolved for the device, unless given) and the max_seq_len in effect: every
    rank's view."""
    model_config = model_config or ModelConfig.from_pretrained(config.model, config.dtype, device.type)
    return model_config, config.max_seq_len or model_config.max_position_embeddings
