"""Engine and server configuration: the option table's models, from flags, YAML files and keyword arguments.

Every option is declared once, as a field of `EngineConfig` (the engine: `LLM(...)` and `brisk serve`; its
groups that are models of their own in `brisk/option_groups.py`), `ServerConfig` (`brisk serve` only;
`brisk/server_config.py`) or `OptionFiles` (the YAML files), with `brisk.options.option`: its type,
default, range, help and trtllm / vLLM spellings. `OPTIONS` (an `OptionTable`) derives the flags, the key
resolution and docs/options.md from them. `EngineConfig.build(model, yaml_path=..., **options)` (the offline API)
and `build_serve_configs(model, given)` (`brisk serve`) are the ways in: unknown keys and bad values fail naming
the key; options that run something else on this machine are logged once at start-up. Defaults that depend on the
model are filled in from its `config.json` / `generation_config.json` through `ModelConfig`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Literal

import yaml
from pydantic import BaseModel, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator

from brisk.errors import ConfigError
from brisk.host import check_cpu_kernels_choice
from brisk.hub import resolve_model
from brisk.kv_cache.config import DEFAULT_RETENTION_PRIORITY, KvCacheConfig
from brisk.model_config import SAMPLING_DEFAULT_KEYS, ModelConfig, read_generation_config, sampling_defaults
from brisk.option_groups import (
    BRISKS_OWN_ONLY,
    TRTLLM_ATTENTION_BACKENDS,
    TRTLLM_MOE_BACKENDS,
    VLLM_ATTENTION_BACKENDS,
    VLLM_GRAPH_MODES,
    CudaGraphConfig,
    MoeConfig,
    StructuredOutputsConfig,
)
from brisk.options import Alias, OptionError, OptionModel, OptionTable, human_int, only_values, option, parse_human_int
from brisk.peer_options import PEER_CONTAINERS, PEER_OPTIONS
from brisk.server_config import ServerConfig
from brisk.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("brisk.config")


class EngineConfig(OptionModel):
    """Engine options (`LLM(...)` and `brisk serve`)"""

    model: str
    tokenizer: str | None = option(
        None, "tokenizer folder or Hub id (default: the model's)", vllm="tokenizer", trtllm="tokenizer"
    )
    revision: str | None = option(
        None, "the Hub revision (branch, tag or commit) of a model id", trtllm="revision", vllm="revision"
    )
    tokenizer_revision: str | None = option(
        None, "the Hub revision of --tokenizer when it is a Hub id", vllm="tokenizer_revision"
    )
    download_dir: str | None = option(
        None,
        "where a Hub model (and tokenizer) is downloaded and looked for (default: the Hugging Face cache, HF_HOME)",
        vllm="download_dir",
    )
    hf_token: SecretStr | None = option(
        None,
        "the Hugging Face token for gated or private models (never logged); without it, or given without a value, "
        "huggingface_hub's own: HF_TOKEN or the stored login",
        vllm="hf_token",
        parse=SecretStr,
        nargs="?",
        metavar="TOKEN",
    )
    load_format: Literal["auto", "safetensors", "dummy"] = option(
        "auto",
        "dummy: random weights of the checkpoint's shapes (no weights read)",
        trtllm="load_format",
        vllm="load_format",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto",
        "compute dtype; auto: the checkpoint's on a GPU, bf16 or fp32 on a CPU (README)",
        trtllm="dtype",
        vllm="dtype",
    )
    device: str = option("auto", "auto (CUDA where torch sees a GPU, else the CPU), cpu, cuda, cuda:N")
    seed: int = option(
        0, "seeds the engine's random generator at start-up: requests without a seed draw from it", vllm="seed"
    )
    trust_remote_code: bool = option(
        False,
        "accepted for compatibility: brisk runs no code from checkpoints (no effect)",
        vllm="trust_remote_code",
        trtllm="trust_remote_code",
    )
    backend: Literal["pytorch", "tensorrt", "_autodeploy"] = option(
        "pytorch",
        "trtllm's engine choice: pytorch is brisk's engine; tensorrt and _autodeploy are not available",
        trtllm="backend",
    )

    max_batch_size: int = option(
        256,
        "requests running at once at most (with attention DP: per rank)",
        vllm="max_num_seqs",
        ge=1,
        trtllm="max_batch_size",
    )
    max_num_tokens: int = option(
        8192,
        "tokens one step computes at most (prefill chunks and decodes together)",
        vllm="max_num_batched_tokens",
        ge=1,
        trtllm="max_num_tokens",
    )
    max_seq_len: int | None = option(
        None,
        "prompt + output tokens of a request at most (default: the model's max_position_embeddings); 32k works",
        vllm="max_model_len",
        parse=parse_human_int,
        ge=1,
        trtllm="max_seq_len",
    )
    max_num_waiting: int = option(4096, "requests queued beyond max_batch_size before new ones get 429", ge=0)
    enable_chunked_prefill: bool = option(
        True,
        "split long prompts into max_num_tokens chunks across steps",
        trtllm="enable_chunked_prefill",
        vllm="enable_chunked_prefill",
    )
    long_prefill_token_threshold: int = option(
        0,
        "a prompt computes at most this many tokens a step (0: as many as the step's budget leaves), so that several "
        "prompts share a step instead of the first taking all of it",
        vllm="long_prefill_token_threshold",
        ge=0,
    )
    kv_cache_config: KvCacheConfig = option(
        default_factory=KvCacheConfig, help="KV cache options", trtllm="kv_cache_config"
    )
    gpu_memory_utilization: float | None = option(
        None,
        "vLLM's sizing: weights, activations and KV cache within this share of the whole GPU (the KV cache gets what "
        "the measured weights and profiled step leave of it, instead of kv_cache_config.free_gpu_memory_fraction); "
        "on a CPU the share of RAM the KV cache takes",
        vllm=("gpu_memory_utilization", "device_memory_utilization"),
        gt=0.0,
        le=1.0,
    )
    kv_offloading_size: float | None = option(
        None,
        "vLLM's host KV tier size in GiB, summed over the ranks; converted to kv_cache_config.host_cache_size (each "
        "rank's share, in bytes) at start-up",
        vllm="kv_offloading_size",
        ge=0.0,
    )
    kv_offloading_backend: Literal["native", "lmcache"] = option(
        "native",
        "vLLM's host KV tier implementation: native is brisk's own; lmcache is not available",
        vllm="kv_offloading_backend",
    )
    cuda_graph_config: CudaGraphConfig | None = option(
        default_factory=CudaGraphConfig,
        help="CUDA graphs of decode steps (null: none); on a CPU, given explicitly, the same padded static buffers "
        "run uncaptured",
        vllm=Alias("enforce_eager", sets=None),
        # trtllm <= 1.0rc1: use_cuda_graph (false: none)
        trtllm=("cuda_graph_config", Alias("use_cuda_graph", sets=None, when=False)),
    )
    compilation_config: dict[str, Any] | int | None = option(
        None,
        "vLLM's compilation config (JSON): its cudagraph_mode NONE runs no CUDA graphs (the others: brisk's graphs of "
        "whole decode steps), cudagraph_capture_sizes and max_cudagraph_capture_size set cuda_graph_config's "
        "batch_sizes and max_batch_size; brisk compiles nothing with torch.compile, so its other keys (and a level "
        "given as a number) have no effect (logged)",
        short=("-cc",),
    )
    cuda_graph_sizes: list[int] | None = option(
        None,
        "vLLM's earlier --cuda-graph-sizes: one value N captures decode batches up to N "
        "(cuda_graph_config.max_batch_size), several are the batch sizes (cuda_graph_config.batch_sizes)",
        nargs="+",
        parse=int,
    )
    optimization_level: str = option(
        "2",
        "vLLM's torch.compile level (-O0 to -O3): brisk compiles nothing with torch.compile; its Triton kernels and "
        "CUDA graphs run at every level",
        short=("-O",),
        no_effect=True,
    )
    performance_mode: Literal["balanced", "interactivity", "throughput"] = option(
        "balanced",
        "vLLM's operating point: interactivity captures a CUDA graph for every decode batch size up to 32 (no padding "
        "at low concurrency, where cuda_graph_config.batch_sizes is not given); throughput doubles max_batch_size "
        "and max_num_tokens where they are not given",
        vllm="performance_mode",
    )
    disable_overlap_scheduler: bool | None = option(
        None,
        "no overlap scheduling (step N+1 prepared while step N runs); default: overlap on GPUs, off on CPUs",
        vllm=Alias("async_scheduling", invert=True),
        trtllm="disable_overlap_scheduler",
    )
    moe_config: MoeConfig = option(default_factory=MoeConfig, help="MoE options", trtllm="moe_config")
    attn_backend: Literal["auto", "torch", "triton", "cpu"] = option(
        "auto",
        "attention kernels: triton (GPU), cpu (brisk's C kernels), torch (reference), auto; trtllm's TRTLLM and "
        "FLASHINFER run auto, VANILLA torch; vLLM's FLASH_ATTN, FLASHINFER and FLEX_ATTENTION run auto, TRITON_ATTN "
        "triton, CPU_ATTN cpu, TORCH_SDPA torch",
        trtllm="attn_backend",
        vllm="attention_backend",
    )
    check_kv_invariants: bool = option(
        False, "check KV block accounting after every step (soak tests and debugging; walks every block)"
    )
    stream_interval: int = option(
        1,
        "a streamed chunk every this many tokens (the first one included)",
        vllm="stream_interval",
        ge=1,
        trtllm="stream_interval",
    )
    grammar_compile_timeout_s: float = option(
        10.0, "structured outputs: a grammar not compiled within this many seconds is a 400", gt=0.0
    )
    grammar_max_json_whitespace: int = option(
        32, "with whitespace allowed in constrained JSON, the longest whitespace run it may hold", ge=1
    )
    structured_outputs_config: StructuredOutputsConfig = option(
        default_factory=StructuredOutputsConfig, help="structured outputs options"
    )
    num_cpu_threads: int | None = option(
        None, "CPU: torch threads of each rank (default: the cores but one, shared among the ranks)", ge=1
    )
    cpu_weight_prepack: bool = option(
        True,
        "CPU: reorder bf16 weights once into oneDNN's blocked layout (faster matmuls, one more weight copy): "
        "bf16 experts, and dense layers whose decode steps do not take brisk's C kernels",
    )
    cpu_kernels: Literal["auto", "avx512", "avx2", "torch"] = option(
        "auto", "CPU: which build of brisk's C kernels runs (auto: the best this CPU runs; torch: none)"
    )
    enable_attention_dp: bool = option(
        False,
        "attention data parallel: each of the tp_size ranks runs its own batch; the MoE stays split",
        trtllm="enable_attention_dp",
    )
    speculative_config: SpeculativeConfig | None = option(
        None,
        "speculative decoding: trtllm's keys ({decoding_type: NGram, max_draft_len: 4}) or vLLM's JSON "
        '({"method": "ngram", "num_speculative_tokens": 4}); an EAGLE3 head is split over the ranks as the target '
        "is, so vLLM's draft_tensor_parallel_size has no effect; trtllm's earlier keys too (decoding_type Eagle is "
        "Eagle3, max_concurrency N drafts while at most N requests run; its NGram pool switches is_keep_all, "
        "is_use_oldest, is_public_pool have no effect)",
        vllm="speculative_config",
        trtllm="speculative_config",
        short=("-sc",),
    )
    tp_size: int = option(
        1,
        "ranks (GPUs) the model runs on (trtllm's meaning: attention split tp_size ways, or data parallel with "
        "enable_attention_dp)",
        trtllm=("tp_size", "tensor_parallel_size"),
        vllm="tensor_parallel_size",
        short=("-tp",),
        ge=1,
    )
    ep_size: int = option(
        1,
        "MoE experts split this many ways (must divide tp_size; the rest splits each expert)",
        trtllm=("ep_size", "moe_expert_parallel_size"),
        ge=1,
    )
    pp_size: int = option(
        1,
        "pipeline parallel stages: brisk has none (1 only)",
        vllm="pipeline_parallel_size",
        short=("-pp",),
        ge=1,
        le=1,
    )
    data_parallel_size: int = option(
        1,
        "vLLM's data parallel: N ranks, each with its own batch and attention (brisk's tp_size N with "
        "enable_attention_dp); with tensor_parallel_size > 1 too is not available",
        vllm="data_parallel_size",
        short=("-dp",),
        ge=1,
    )
    enable_expert_parallel: bool = option(
        False,
        "vLLM's expert parallel: experts split over all ranks (ep_size = the number of ranks)",
        vllm="enable_expert_parallel",
        short=("-ep",),
    )
    attention_dp_config: dict[str, Any] | None = option(
        None,
        "trtllm's balancing of attention-DP ranks (enable_balance, batching_wait_iters, timeout_iters): a scheduling "
        "knob; brisk's attention DP gives each rank the requests routed to it",
        trtllm="attention_dp_config",
        no_effect=True,
    )
    env_overrides: dict[str, str | int | float | bool] | None = option(
        None,
        "trtllm's environment switches (TRTLLM_*, e.g. TRTLLM_ENABLE_PDL) are TensorRT-LLM kernel knobs; brisk "
        "reads none, and refuses any other variable (set it in the environment)",
        trtllm="env_overrides",
        no_effect=True,
    )
    enable_mixed_sampler: bool = option(
        False,
        "trtllm's per-request sampling switch: brisk always samples each request with its own parameters, so true "
        "and false both do that (no effect)",
        trtllm=("enable_mixed_sampler", "mixed_sampler", "mixed_decoder"),  # the earlier names (trtllm <= 1.0rc)
    )
    print_iter_log: bool = option(
        False,
        "log one line per engine step: requests running and waiting, tokens, KV use",
        trtllm="print_iter_log",
        vllm="enable_logging_iteration_details",
    )
    disable_log_stats: bool = option(
        False,
        "vLLM's switch for its periodic statistics lines: brisk logs none (GET /metrics has the statistics, "
        "print_iter_log a line per step)",
        vllm="disable_log_stats",
        no_effect=True,
    )
    max_logprobs: int = option(
        20,
        "the most logprobs (and prompt_logprobs) a request may ask for; brisk returns at most 20",
        vllm="max_logprobs",
        ge=0,
        le=20,
    )
    generation_config: str = option(
        "auto",
        "default sampling parameters: auto (the model's generation_config.json), vllm (none: brisk's defaults), or a "
        "folder holding a generation_config.json",
        vllm="generation_config",
    )
    override_generation_config: dict[str, Any] | None = option(
        None,
        "default sampling parameters over --generation-config's (JSON): temperature, top_p, top_k, min_p, "
        "repetition_penalty, presence_penalty, frequency_penalty, and max_new_tokens (every request's max_tokens at "
        "most, and its default), as vLLM takes them",
        vllm="override_generation_config",
    )
    chat_template: str | None = option(
        None,
        "a Jinja chat template (a file, or the template itself) instead of the tokenizer's",
        vllm="chat_template",
    )

    @model_validator(mode="before")
    @classmethod
    def _vllm_parallel_layout(cls, data: Any) -> Any:
        """vLLM's data_parallel_size and enable_expert_parallel as brisk's tp_size / enable_attention_dp / ep_size."""
        if not isinstance(data, dict):
            return data
        dp = data.get("data_parallel_size", 1)
        if isinstance(dp, int) and dp > 1:
            converted = data.get("tp_size") == dp and data.get("enable_attention_dp") is True  # validated before
            if not converted and (data.get("tp_size", 1) != 1 or data.get("enable_attention_dp") is False):
                raise ValueError(
                    f"data_parallel_size {dp} with tensor_parallel_size {data.get('tp_size')}: brisk runs attention "
                    "either data parallel over all ranks or tensor parallel over all ranks, not both; give "
                    f"--data-parallel-size {dp} alone, or trtllm's --tp_size N --enable_attention_dp"
                )
            data = {**data, "tp_size": dp, "enable_attention_dp": True}
        if data.get("enable_expert_parallel"):
            world = data.get("tp_size", 1)
            if data.get("ep_size", world) != world:
                raise ValueError(
                    f"enable_expert_parallel splits the experts over all {world} ranks, but ep_size is "
                    f"{data['ep_size']}: give one of them"
                )
            data = {**data, "ep_size": world}
        return data

    @model_validator(mode="before")
    @classmethod
    def _vllm_throughput_mode(cls, data: Any) -> Any:
        """vLLM's performance_mode throughput: twice the default batch and step budget (as vLLM doubles its own)."""
        if not isinstance(data, dict) or data.get("performance_mode") != "throughput":
            return data
        doubled = {k: 2 * cls.model_fields[k].default for k in ("max_batch_size", "max_num_tokens") if k not in data}
        return {**data, **doubled}

    @model_validator(mode="before")
    @classmethod
    def _vllm_graph_options(cls, data: Any) -> Any:
        """vLLM's compilation_config (its graph mode and capture sizes) and cuda_graph_sizes as cuda_graph_config."""
        if not isinstance(data, dict):
            return data
        level = data.get("optimization_level")
        if isinstance(level, str) and level.lstrip().startswith("{"):  # vLLM <= 0.11: -O was compilation_config's
            if data.get("compilation_config") is not None:
                raise ValueError("-O (vLLM <= 0.11: the compilation config) and compilation_config given: give one")
            data = {k: v for k, v in data.items() if k != "optimization_level"} | {"compilation_config": level}
        compilation = data.get("compilation_config")
        if isinstance(compilation, str):
            try:
                compilation = json.loads(compilation)  # vLLM's YAML files give it as a JSON string
            except json.JSONDecodeError as exc:
                raise ValueError(f"compilation_config is not valid JSON: {exc}") from None
            data = {**data, "compilation_config": compilation}
        graph: dict[str, Any] = {}
        if isinstance(compilation, dict):
            mode = compilation.get("cudagraph_mode")
            if mode is not None and str(mode).upper() == "NONE":
                return {**data, "cuda_graph_config": None}
            if mode is not None and str(mode).upper() not in VLLM_GRAPH_MODES:
                raise ValueError(
                    f"compilation_config.cudagraph_mode {mode!r}: give one of NONE, {', '.join(VLLM_GRAPH_MODES)}"
                )
            if "cudagraph_capture_sizes" in compilation:
                graph["batch_sizes"] = compilation["cudagraph_capture_sizes"]
            if "max_cudagraph_capture_size" in compilation:
                graph["max_batch_size"] = compilation["max_cudagraph_capture_size"]
        sizes = cls._one_size_as_a_list(data.get("cuda_graph_sizes"))
        if isinstance(sizes, list) and len(sizes) == 1:
            graph["max_batch_size"] = sizes[0]
        elif isinstance(sizes, list) and sizes:
            graph["batch_sizes"] = sizes
        given = data.get("cuda_graph_config", {})
        if not graph or given is None:  # no sizes, or no graphs at all (enforce_eager wins, as in vLLM)
            return data
        if isinstance(given, BaseModel):
            given = given.model_dump(exclude_unset=True)
        for key, value in graph.items():
            if key in given and given[key] != value:
                raise ValueError(
                    f"cuda_graph_config.{key} is {given[key]!r} but vLLM's compilation_config / cuda_graph_sizes give "
                    f"{value!r}: give one of them"
                )
        return {**data, "cuda_graph_config": {**given, **graph}}

    @field_validator("cuda_graph_sizes", mode="before")
    @classmethod
    def _one_size_as_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value  # YAML: 2048

    @model_validator(mode="after")
    def _one_gpu_named_for_one_rank(self) -> EngineConfig:
        if self.tp_size > 1 and self.device.startswith("cuda:"):
            raise ValueError(
                f"{self.device} names one GPU, but tp_size {self.tp_size} ranks need one each (rank r takes GPU "
                "LOCAL_RANK r): give cuda or auto, and choose the GPUs with CUDA_VISIBLE_DEVICES"
            )
        return self

    @model_validator(mode="after")
    def _host_tier_needs_prefix_caching(self) -> EngineConfig:
        kv = self.kv_cache_config
        if self.kv_offloading_size is not None and "host_cache_size" in kv.model_fields_set:
            raise ValueError(
                "kv_offloading_size and kv_cache_config.host_cache_size both size the host KV tier: give one of them"
            )
        if (kv.host_cache_size or self.kv_offloading_size) and not kv.enable_block_reuse:
            raise ValueError(
                "the host KV tier keeps prefix-cache blocks: kv_cache_config.host_cache_size / kv_offloading_size "
                "need kv_cache_config.enable_block_reuse (vLLM: --enable-prefix-caching)"
            )
        if (kv.host_cache_size or self.kv_offloading_size) and not kv.onboard_blocks:
            raise ValueError(
                "kv_cache_config.onboard_blocks false with a host KV tier: brisk's attention reads only the device "
                "pool, so a host-tier block is always copied back to serve a hit; give onboard_blocks true, or no "
                "host tier"
            )
        return self

    @field_validator("override_generation_config")
    @classmethod
    def _sampling_keys_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        known = (*SAMPLING_DEFAULT_KEYS, "max_new_tokens")
        given = value or {}
        others = sorted(k for k in given if k not in known and not (k == "skip_special_tokens" and given[k]))
        if others:
            raise ValueError(
                f"{', '.join(others)}: brisk's default sampling parameters are {', '.join(known)} (skip_special_tokens "
                "is always true)"
            )
        return value

    @field_validator("env_overrides")
    @classmethod
    def _only_trtllm_switches(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        others = sorted(k for k in value or {} if not k.startswith("TRTLLM_"))
        if others:
            raise ValueError(
                f"{', '.join(others)}: brisk reads no settings from environment variables given as options; set them "
                "in the server's environment (only TensorRT-LLM's own TRTLLM_* switches are accepted here, with no "
                "effect)"
            )
        return value

    @field_validator("backend", "kv_offloading_backend")
    @classmethod
    def _brisks_own_only(cls, value: str, info: ValidationInfo) -> str:
        """Peers' implementation choices where brisk has only its own: that one, or a clear refusal."""
        return only_values(value, str(info.field_name), BRISKS_OWN_ONLY)

    @field_validator("backend", mode="before")
    @classmethod
    def _trtllm_backend_spellings(cls, value: Any) -> Any:
        return "tensorrt" if value == "trt" else value  # trtllm-serve's --backend trt (1.0 on)

    @field_validator("attn_backend", mode="before")
    @classmethod
    def _brisk_attention(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        name = value.lower()
        return TRTLLM_ATTENTION_BACKENDS.get(name) or VLLM_ATTENTION_BACKENDS.get(name, name)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_spellings(cls, value: Any) -> Any:
        aliases = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
        return aliases.get(value, value) if isinstance(value, str) else value

    @field_validator("max_seq_len", mode="before")
    @classmethod
    def _human_length(cls, value: Any) -> Any:
        return human_int(value)

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
        return self.kv_cache_config.tokens_per_block

    @property
    def enable_prefix_caching(self) -> bool:
        return self.kv_cache_config.enable_block_reuse

    @property
    def memory_fraction(self) -> float:
        return self.kv_cache_config.free_gpu_memory_fraction

    @classmethod
    def build(
        cls, model: str, yaml_path: str | os.PathLike | None = None, *, find_model: bool = False, **options: Any
    ) -> EngineConfig:
        """The engine config from keyword options in any spelling of the option table, over the YAML files named
        by `yaml_path` (trtllm's extra_llm_api_options) and the `config` / `extra_llm_api_options` options;
        ConfigError naming the bad key. Server options are refused here. find_model: `model` is MODEL as a user
        gives it (a folder or a Hub id), looked for once the options are valid."""
        given = dict(options)
        if yaml_path is not None:
            given["extra_llm_api_options"] = str(yaml_path)
        merged = resolve_with_files(given, "the keyword arguments")
        direct = resolve_options(given, "the keyword arguments")[ServerConfig]
        if direct:
            raise ConfigError(f"'{next(iter(direct))}' is an option of brisk serve, not of the engine")
        for key in merged[ServerConfig]:  # a serving config (trtllm's, say) loaded offline: its server part idles
            logger.info("%s (from an options file): an option of brisk serve, no effect on LLM(...)", key)
        return cls.from_options(model, merged[EngineConfig], find_model=find_model)

    @classmethod
    def from_options(cls, model: str, options: dict[str, Any], find_model: bool = False) -> EngineConfig:
        """Validate resolved options (each at its option's path) into the config in effect on this machine;
        the start-up notes of options that run something else here are logged. find_model: `model` is MODEL as
        given, looked for (resolve_model) after the options are checked, so a bad value is reported first."""
        try:
            cfg = cls(**options, model=model)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc)) from None
        if find_model:  # MODEL and --tokenizer given as Hub ids: their folders
            token = cfg.hf_token.get_secret_value() if cfg.hf_token is not None else None
            found = {"model": resolve_model(model, cfg.revision, cfg.download_dir, token)}
            if cfg.tokenizer is not None:
                found["tokenizer"] = resolve_model(cfg.tokenizer, cfg.tokenizer_revision, cfg.download_dir, token)
            cfg = cfg.model_copy(update=found)
        if cfg.tp_size % cfg.ep_size != 0:
            raise ConfigError(
                f"ep_size ({cfg.ep_size}) must divide tp_size ({cfg.tp_size}): the MoE runs on the tp_size ranks, "
                f"split ep_size ways by expert and tp_size / ep_size ways by intermediate size"
            )
        if not cfg.enable_chunked_prefill and cfg.max_seq_len is not None and cfg.max_seq_len > cfg.max_num_tokens:
            raise ConfigError(
                f"max_seq_len ({cfg.max_seq_len}) > max_num_tokens ({cfg.max_num_tokens}) needs enable_chunked_prefill"
            )
        if cfg.long_prefill_token_threshold and not cfg.enable_chunked_prefill:
            raise ConfigError(
                f"long_prefill_token_threshold {cfg.long_prefill_token_threshold} splits prompts into chunks: it needs "
                "enable_chunked_prefill"
            )
        requested_moe = (options.get("moe_config") or {}).get("backend")
        cfg, notes = cfg.on_device(_device_type(cfg.device), requested_moe)
        for note in notes:
            logger.info("%s", note)
        return cfg

    def on_device(self, device_type: str, requested_moe: Any = None) -> tuple[EngineConfig, list[str]]:
        """The config in effect on a `device_type` device, and one log line per option given that runs something
        else here (or nothing): GPU-only options on a CPU, trtllm's backend names, vLLM's memory sizing."""
        given, notes = self.model_fields_set, []
        changes: dict[str, Any] = {}
        gpu = device_type == "cuda"
        if isinstance(requested_moe, str) and requested_moe.lower() in TRTLLM_MOE_BACKENDS:
            if self.moe_config.backend == "torch":
                runs = "brisk's torch reference MoE runs"
            else:
                runs = (
                    "brisk's Triton MXFP4 grouped GEMM runs on this GPU" if gpu else "the CPU MoE path runs on this CPU"
                )
            notes.append(f"moe_config.backend {requested_moe}: {runs}")
        if not gpu:
            if "cuda_graph_config" in given and self.cuda_graph_config is not None:
                notes.append(
                    "cuda_graph_config on a CPU: decode steps run on the padded static buffers, uncaptured "
                    "(no CUDA graphs)"
                )
            if self.moe_config.backend == "triton":
                notes.append("moe_config.backend 'triton' means nothing on a CPU: the CPU MoE path runs")
                changes["moe_config"] = self.moe_config.model_copy(update={"backend": "auto"})
            if self.attn_backend == "triton":
                notes.append("attn_backend 'triton' means nothing on a CPU: the CPU attention path runs")
                changes["attn_backend"] = "auto"
            if "free_gpu_memory_fraction" in self.kv_cache_config.model_fields_set:
                notes.append(
                    "kv_cache_free_gpu_memory_fraction is a share of GPU memory; on a CPU the KV cache takes that "
                    "share of the available RAM, at most 2 GiB (kv_cache_config.max_blocks sets it exactly)"
                )
        kv_changes: dict[str, Any] = {}
        if self.gpu_memory_utilization is not None:
            notes.append(utilization_note(self, gpu))
            if not gpu:
                kv_changes["free_gpu_memory_fraction"] = self.gpu_memory_utilization
        if self.kv_offloading_size is not None:  # vLLM's GiB over all ranks -> each rank's bytes
            per_rank = int(self.kv_offloading_size * 2**30) // self.tp_size
            notes.append(
                f"kv_offloading_size {self.kv_offloading_size:g} GiB: kv_cache_config.host_cache_size {per_rank} "
                f"bytes on each of the {self.tp_size} rank(s)"
            )
            kv_changes["host_cache_size"] = per_rank
            changes["kv_offloading_size"] = None  # converted: the engine process validates the config again
        kv = self.kv_cache_config
        priority = kv.secondary_offload_min_priority
        if priority is not None and kv_changes.get("host_cache_size", kv.host_cache_size):
            if priority >= DEFAULT_RETENTION_PRIORITY:
                notes.append(
                    f"kv_cache_config.secondary_offload_min_priority {priority}: brisk's KV blocks all have "
                    f"trtllm's default retention priority {DEFAULT_RETENTION_PRIORITY}, so none may go to the host "
                    "tier: it is off"
                )
                kv_changes["host_cache_size"] = 0
            else:
                notes.append(
                    f"kv_cache_config.secondary_offload_min_priority {priority}: every evicted block may go to the "
                    f"host tier (brisk's blocks all have trtllm's default retention priority "
                    f"{DEFAULT_RETENTION_PRIORITY})"
                )
        if "onboard_blocks" in kv.model_fields_set and not kv.onboard_blocks:
            notes.append("kv_cache_config.onboard_blocks false: there is no host KV tier, so no block to onboard")
        if not gpu and kv.max_gpu_total_bytes:
            notes.append(
                f"kv_cache_config.max_gpu_total_bytes {kv.max_gpu_total_bytes} on a CPU: the KV cache takes at most "
                "that many bytes of RAM"
            )
        notes += OPTIONS.no_effect_notes(self)
        if "compilation_config" in given:
            notes.append(compilation_config_note(self.compilation_config, self.cuda_graph_config is not None))
        if kv_changes:
            changes["kv_cache_config"] = self.kv_cache_config.model_copy(update=kv_changes)
        if "enable_mixed_sampler" in given:
            notes.append("enable_mixed_sampler: brisk always samples each request with its own parameters")
        if self.trust_remote_code:
            notes.append("trust_remote_code: brisk runs no code from checkpoints; its own model code runs")
        return (self.model_copy(update=changes) if changes else self), notes


def compilation_config_note(compilation: dict[str, Any] | int | None, graphs: bool) -> str:
    """The start-up line for vLLM's compilation_config: what of it brisk runs."""
    if not isinstance(compilation, dict):
        return f"compilation_config {compilation}: brisk compiles nothing with torch.compile (no effect)"
    done = []
    mode = compilation.get("cudagraph_mode")
    if mode is not None:
        done.append(
            f"cudagraph_mode {mode}: "
            + ("brisk captures whole decode steps" if graphs else "no CUDA graphs (cuda_graph_config null)")
        )
    sizes = [k for k in ("cudagraph_capture_sizes", "max_cudagraph_capture_size") if k in compilation]
    if sizes:
        done.append(f"{' and '.join(sizes)}: cuda_graph_config")
    ignored = sorted(set(compilation) - {"cudagraph_mode", *sizes})
    if ignored:
        done.append(f"{', '.join(ignored)}: no effect (brisk compiles nothing with torch.compile)")
    return "compilation_config: " + "; ".join(done)


class OptionFiles(OptionModel):
    """Option files (`brisk serve`; `LLM(extra_llm_api_options=...)`)"""

    config: str | None = option(
        None,
        "a YAML file of options in any spelling of this table (vLLM's --config: flags by name; trtllm's keys too)",
        vllm="config",
    )
    extra_llm_api_options: str | None = option(
        None,
        "a YAML file of options (trtllm's LLM API keys; any spelling of this table); overrides --config",
        trtllm="extra_llm_api_options",
    )


OPTIONS = OptionTable(OptionFiles, ServerConfig, EngineConfig, peers=PEER_OPTIONS, containers=PEER_CONTAINERS)


def resolve_options(given: dict[str, Any], source: str) -> dict[type[BaseModel], dict[str, Any]]:
    """`given` keys in any spelling -> each option model's keyword dict; ConfigError naming an unknown key."""
    try:
        return OPTIONS.resolve(given, source)
    except OptionError as exc:
        raise ConfigError(str(exc)) from None


def merge_options(*sources: dict[type[BaseModel], dict[str, Any]]) -> dict[type[BaseModel], dict[str, Any]]:
    """Resolved option sources, later ones overriding earlier ones option by option (groups merged key by key)."""
    out: dict[type[BaseModel], dict[str, Any]] = {model: {} for model in OPTIONS.models}
    for source in sources:
        for model, values in source.items():
            _deep_update(out[model], values)
    return out


def _deep_update(into: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_update(into[key], value)
        else:
            into[key] = value


def resolve_with_files(given: dict[str, Any], source: str) -> dict[type[BaseModel], dict[str, Any]]:
    """Options in any spelling (`given`), over the YAML files they name: the `config` file, then the
    `extra_llm_api_options` file, then `given` itself, each overriding the one before option by option."""
    flags = resolve_options(given, source)
    files = OptionFiles(**flags[OptionFiles])
    sources = [
        resolve_options(load_yaml_options(path), path)
        for path in (files.config, files.extra_llm_api_options)
        if path is not None
    ]
    return merge_options(*sources, flags)


def build_serve_configs(
    model: str | None, given: dict[str, Any], default_model: str
) -> tuple[EngineConfig, ServerConfig]:
    """`brisk serve`'s configs from the flags given (keys in any spelling) and the option files they name, for
    MODEL (`model`: a folder or a Hub id, looked for once the options are valid; None: the `default_model`
    folder)."""
    merged = resolve_with_files(given, "the command line")
    _reasoning_parser_from_structured_outputs(merged)
    try:
        server = ServerConfig(**merged[ServerConfig])
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    if server.num_postprocess_workers > 1:
        logger.info(
            "num_postprocess_workers %d: brisk detokenizes in its API-server processes, so %d of them run "
            "(as --api-server-count %d)",
            *(server.num_postprocess_workers,) * 3,
        )
    return EngineConfig.from_options(model or default_model, merged[EngineConfig], find_model=bool(model)), server


def _reasoning_parser_from_structured_outputs(merged: dict[type[BaseModel], dict[str, Any]]) -> None:
    """vLLM keeps the reasoning parser in structured_outputs_config (its --reasoning-parser sets it there): given
    there, it is brisk serve's --reasoning-parser."""
    nested = (merged[EngineConfig].get("structured_outputs_config") or {}).get("reasoning_parser")
    if not nested:
        return
    given = merged[ServerConfig].get("reasoning_parser")
    if given is not None and given != nested:
        raise ConfigError(
            f"--reasoning-parser {given} and structured_outputs_config.reasoning_parser {nested} differ: give one"
        )
    merged[ServerConfig]["reasoning_parser"] = nested


def utilization_note(config: EngineConfig, gpu: bool) -> str:
    """The start-up line for vLLM's gpu_memory_utilization u. On a GPU the engine sizes the KV pool by vLLM's rule
    once it has measured the weights and a step (model_runner/memory.py): nothing of the GPU is touched here, so
    that the API process creates no CUDA context. On a CPU u is the KV cache's share of the RAM (the caller sets
    it as the fraction)."""
    u = config.gpu_memory_utilization
    assert u is not None  # the caller checks
    if "free_gpu_memory_fraction" in config.kv_cache_config.model_fields_set:
        raise ConfigError(
            "gpu_memory_utilization (vLLM's sizing) and kv_cache_free_gpu_memory_fraction (trtllm's) both size the "
            "KV cache: give one of them"
        )
    if not gpu:
        return (
            f"gpu_memory_utilization {u:g} on a CPU: the KV cache takes {u:.0%} of the available RAM (at most 2 GiB), "
            "as kv_cache_free_gpu_memory_fraction does"
        )
    return (
        f"gpu_memory_utilization {u:g} (vLLM's sizing): the KV cache gets what the weights, a profiled step's "
        f"activations and the CUDA context, measured at start-up, leave of {u:.0%} of each GPU "
        "(kv_cache_free_gpu_memory_fraction is not used)"
    )


def check_fits_machine(config: EngineConfig, model_config: ModelConfig, launched_externally: bool) -> None:
    """A layout this machine or this model cannot run, as one ConfigError naming the option to change: more ranks
    than devices (GPUs; on a CPU its cores, a rank each), or a model that does not split tp_size / ep_size ways."""
    if not launched_externally:  # torchrun / mpirun with several ranks: each node checks its own (resolve_device)
        if _device_type(config.device) == "cuda":
            import torch

            devices, what = torch.cuda.device_count(), "GPUs"
            # "auto" and "cuda" name no index (the launcher's rank picks one); only "cuda:N" is checked here
            index = None if config.device == "auto" else torch.device(config.device).index
            if index is not None and index >= devices:  # before the engine starts, not as its start-up failure
                raise ConfigError(f"device {config.device} does not exist: this machine has {devices} GPUs (--device)")
        else:
            devices, what = os.cpu_count() or 1, "CPU cores (no CUDA GPU; one CPU rank a core)"
        if config.tp_size > devices:
            raise ConfigError(
                f"tp_size {config.tp_size} needs {config.tp_size} devices, and this machine has {devices} {what}: "
                f"lower --tp_size (--tensor-parallel-size) to at most {devices}"
            )
    attention_tp = 1 if config.enable_attention_dp else config.tp_size
    heads, kv_heads = model_config.num_heads, model_config.num_kv_heads
    if heads % attention_tp or (kv_heads % attention_tp if attention_tp < kv_heads else attention_tp % kv_heads):
        raise ConfigError(
            f"tp_size {config.tp_size} does not split the model's {heads} attention heads ({kv_heads} KV heads) "
            "evenly: choose a tp_size that divides them, or enable_attention_dp (attention data parallel)"
        )
    experts = getattr(model_config.text_config, "num_local_experts", None) or getattr(
        model_config.text_config, "num_experts", None
    )
    if isinstance(experts, int) and experts % config.ep_size:
        raise ConfigError(
            f"ep_size {config.ep_size} does not split the model's {experts} experts evenly: choose an ep_size "
            "that divides them"
        )


def generation_defaults(config: EngineConfig, model_config: ModelConfig) -> dict[str, Any]:
    """The default sampling parameters (vLLM's --generation-config): the model's generation_config.json (auto),
    none (vllm), or those of the folder named."""
    override = sampling_defaults(config.override_generation_config or {}, max_new_tokens=True)
    if config.generation_config == "auto":
        return {**model_config.generation_defaults, **override}
    if config.generation_config == "vllm":
        return override
    if not os.path.isfile(os.path.join(config.generation_config, "generation_config.json")):
        raise ConfigError(f"--generation-config {config.generation_config}: no generation_config.json there")
    return {**sampling_defaults(read_generation_config(config.generation_config), max_new_tokens=True), **override}


def load_chat_template(config: EngineConfig) -> str | None:
    """The --chat-template text: a file's contents, or the argument itself when it is no file."""
    template = config.chat_template
    if template is None:
        return None
    if os.path.isfile(template):
        with open(template) as f:
            return f.read()
    if "{" not in template:  # neither a file nor a template: a path with a typo
        raise ConfigError(f"--chat-template {template}: no such file")
    return template


def describe_validation_error(exc: ValidationError) -> str:
    """pydantic's errors as one line, each naming the option (and its other spellings, one of which the user
    may have written)."""
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        row = OPTIONS.by_path.get(key)
        others = [a.name for a in row.aliases if a.name not in (row.name, row.path)] if row is not None else []
        spelled = f" ({', '.join(dict.fromkeys(others))})" if others else ""
        if not key:
            parts.append(message)
        elif err["type"] == "extra_forbidden":
            parts.append(f"unknown option '{key}'")
        else:
            parts.append(f"option '{key}'{spelled}: {message} (got {err.get('input')!r})")
    return "; ".join(parts)


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
        raise ConfigError(f"options file {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"options file {path} must hold a mapping of option names to values")
    return data


def load_model_config(
    config: EngineConfig, device: Any, model_config: ModelConfig | None = None
) -> tuple[ModelConfig, int]:
    """The model's config (dtype resolved for the device, unless given) and the max_seq_len in effect: every
    rank's view."""
    model_config = model_config or ModelConfig.from_pretrained(config.model, config.dtype, device.type)
    return model_config, config.max_seq_len or model_config.max_position_embeddings
