"""The option groups of `EngineConfig` that are models of their own (`cuda_graph_config`, `moe_config`,
`structured_outputs_config`), and the peers' backend names brisk maps onto its own implementations.

Declared as `brisk.config` declares every option (`brisk.options.option`); the option table reaches them through
`EngineConfig`'s fields. `KvCacheConfig` and `SpeculativeConfig` live beside what they configure (`brisk/kv_cache/`,
`brisk/spec_decode/`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationInfo, field_validator

from brisk.options import OptionModel, only_values, option
from brisk.peer_options import STATIC_EXPERTS

# trtllm's MoE backends (moe_config.backend) and what brisk runs for each: its Triton MXFP4 grouped GEMM where
# trtllm would run a fused GPU kernel (auto picks it on a GPU, the CPU path on a CPU), its torch reference where
# trtllm would run its unfused reference (VANILLA).
TRTLLM_MOE_BACKENDS = {
    "cutlass": "auto",
    "trtllm": "auto",
    "cutedsl": "auto",
    "deepgemm": "auto",
    "wideep": "auto",
    "densegemm": "auto",
    "vanilla": "torch",
}
# trtllm's attention backends likewise: its fused GPU kernels -> brisk's auto choice, VANILLA -> the torch reference
TRTLLM_ATTENTION_BACKENDS = {
    "trtllm": "auto",
    "flashinfer": "auto",
    "flashinfer_star_attention": "auto",
    "vanilla": "torch",
}
# vLLM's attention backends (--attention-backend) likewise: its fused GPU kernels -> auto, its Triton kernels ->
# brisk's, its CPU and SDPA paths -> brisk's CPU kernels and torch reference
VLLM_ATTENTION_BACKENDS = {
    "flash_attn": "auto",
    "flashinfer": "auto",
    "flex_attention": "auto",
    "triton_attn": "triton",
    "cpu_attn": "cpu",
    "torch_sdpa": "torch",
}
# vLLM's compilation_config.cudagraph_mode values that capture decode steps (brisk captures whole decode steps)
VLLM_GRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE")
# Options naming a peer's implementation where brisk has one of its own: the value that means it, and the refusal.
BRISKS_OWN_ONLY = {
    "reasoning_parser_plugin": (("",), "brisk loads no reasoning-parser plugins (given {value!r})"),
    "enable_in_reasoning": (
        (False,),
        "brisk leaves gpt-oss's reasoning unconstrained and constrains its final answer (and strict tools' "
        "arguments); constraining the reasoning too is not available",
    ),
    "backend": (
        ("pytorch",),
        "brisk has no {value} engine; its own PyTorch engine serves the model (--backend pytorch, or leave --backend "
        "out)",
    ),
    "kv_offloading_backend": (
        ("native",),
        "brisk has no {value} KV offloading; its own host KV tier serves --kv-offloading-size (give "
        "--kv-offloading-backend native, or leave it out)",
    ),
}


class CudaGraphConfig(OptionModel):
    """cuda_graph_config"""

    max_batch_size: int = option(
        256,
        "decode batches up to this size run as captured CUDA graphs (padded to a captured size)",
        ge=0,
        trtllm=("cuda_graph_config.max_batch_size", "cuda_graph_max_batch_size"),
        vllm="max_cudagraph_capture_size",
    )
    enable_padding: bool = option(
        True,
        "pad a decode batch to the next captured size (else only exact sizes replay)",
        # trtllm 1.0.0rc2-rc3: padding_enabled; <= 1.0.0rc1: cuda_graph_padding_enabled (top level)
        trtllm=("cuda_graph_config.enable_padding", "cuda_graph_config.padding_enabled", "cuda_graph_padding_enabled"),
    )
    batch_sizes: list[int] | None = option(
        None,
        "the batch sizes to capture (default: from max_batch_size)",
        trtllm=("cuda_graph_config.batch_sizes", "cuda_graph_batch_sizes"),
        vllm="cudagraph_capture_sizes",
        nargs="+",
        parse=int,
    )


class MoeConfig(OptionModel):
    """moe_config"""

    backend: Literal["auto", "torch", "triton"] = option(
        "auto",
        "MoE kernels: triton (fused MXFP4 grouped GEMM, GPU), torch (reference), auto (triton on a GPU, the CPU "
        "path on a CPU); trtllm's names run brisk's equivalent: CUTLASS, TRTLLM, CUTEDSL, DEEPGEMM, WIDEEP, "
        "DENSEGEMM -> auto, VANILLA -> torch, TRITON -> triton",
        trtllm=("moe_config.backend", "moe_backend"),
    )
    max_num_tokens: int | None = option(
        None,
        "trtllm's cap on tokens per fused-MoE call (larger steps run in chunks to bound its workspace): brisk's MoE "
        "runs a step's tokens (at most max_num_tokens) in one call",
        trtllm=("moe_config.max_num_tokens", "moe_max_num_tokens"),
        ge=1,
        no_effect=True,
    )
    load_balancer: dict[str, Any] | str | None = option(
        None,
        "trtllm's expert load balancer (a config or its file): brisk places experts statically, so only null",
        trtllm=("moe_config.load_balancer", "moe_load_balancer"),
    )
    disable_finalize_fusion: bool = option(
        False,
        "trtllm's switch for its CUTLASS MoE's fused finalize: brisk's MoE sums the experts' outputs in a fixed "
        "order either way",
        trtllm="moe_config.disable_finalize_fusion",
        no_effect=True,
    )
    use_low_precision_moe_combine: bool = option(
        False,
        "trtllm's low-precision all-to-all combine for attention-DP MoE: brisk combines the experts' outputs in the "
        "model's dtype",
        trtllm="moe_config.use_low_precision_moe_combine",
        no_effect=True,
    )

    @field_validator("backend", mode="before")
    @classmethod
    def _brisk_backend(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        return TRTLLM_MOE_BACKENDS.get(value.lower(), value.lower())  # TensorRT-LLM's YAMLs write TRITON

    @field_validator("load_balancer")
    @classmethod
    def _static_experts(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(f"{STATIC_EXPERTS}: give null")
        return value


class StructuredOutputsConfig(OptionModel):
    """structured_outputs_config"""

    disable_any_whitespace: bool = option(
        True,
        "constrained JSON is compact (no whitespace outside strings, as OpenAI's structured outputs); false: any "
        "whitespace between JSON tokens, up to grammar_max_json_whitespace a run (a request's "
        "structured_outputs.disable_any_whitespace overrides it)",
        vllm="guided_decoding_disable_any_whitespace",  # vLLM <= 0.11's flag
    )
    backend: Literal["auto", "xgrammar"] = option(
        "auto", "the grammar engine: brisk's structured outputs run on xgrammar"
    )
    disable_fallback: bool = option(
        False,
        "vLLM's: brisk runs every grammar on xgrammar, with no other engine to fall back to (a grammar xgrammar cannot "
        "compile is a 400)",
        vllm="guided_decoding_disable_fallback",  # vLLM <= 0.11's flag
        no_effect=True,
    )
    disable_additional_properties: bool = option(
        False,
        "a setting of vLLM's guidance backend; brisk's structured outputs run on xgrammar",
        vllm="guided_decoding_disable_additional_properties",  # vLLM <= 0.11's flag
        no_effect=True,
    )
    reasoning_parser: str = option(
        "",
        "vLLM's place for --reasoning-parser (which sets it there): given here, brisk serve takes it as "
        "--reasoning-parser",
    )
    reasoning_parser_plugin: str = option("", "vLLM's reasoning-parser plugin file: brisk loads no plugins (only '')")
    enable_in_reasoning: bool = option(
        False,
        "constrain the reasoning too: brisk leaves gpt-oss's reasoning free and constrains its answer (only false)",
    )

    @field_validator("backend", mode="before")
    @classmethod
    def _only_xgrammar(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ("auto", "xgrammar"):
            raise ValueError(f"brisk's structured outputs run on xgrammar; backend {value!r} is not available")
        return value

    @field_validator("reasoning_parser_plugin", "enable_in_reasoning")
    @classmethod
    def _brisks_behaviour_only(cls, value: Any, info: ValidationInfo) -> Any:
        return only_values(value, str(info.field_name), BRISKS_OWN_ONLY)
