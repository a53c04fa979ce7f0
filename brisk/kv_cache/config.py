"""The KV cache's options (`kv_cache_config`): brisk's own, and every key of trtllm's KvCacheConfig, each one
implemented, refused with the reason where brisk has no such thing, or accepted with its documented no-effect
(docs/options.md, "trtllm's kv_cache_config keys"). brisk/config.py puts it in the option table."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationInfo, field_validator

from brisk.options import OptionModel, human_int, only_values, option, parse_human_int

# trtllm's kv_cache_config keys for what brisk does not have: the values that mean what brisk does, and why any other
# is refused.
KV_CACHE_ONLY = {
    "max_attention_window": (
        (None,),
        "brisk attends over each layer's own window, from the model's config.json (sliding_window, layer_types); a "
        "window cap of its own would change the model's outputs and is not available",
    ),
    "cross_kv_cache_fraction": (
        (None,),
        "brisk serves decoder-only models: there is no cross-attention KV cache to reserve memory for",
    ),
    "use_uvm": (
        (False,),
        "brisk keeps the KV pool in device memory, not CUDA unified memory; kv_cache_config.host_cache_size keeps "
        "evicted blocks in host memory",
    ),
    "event_buffer_max_size": (
        (0,),
        "brisk publishes no KV cache events (trtllm's /kv_cache_events): 0 (no event buffer) only",
    ),
    "disk_cache_size": (
        (None, 0),
        "brisk has no disk KV tier; kv_cache_config.host_cache_size keeps evicted blocks in host memory",
    ),
}
BLOCK_REUSE_POLICY_REFUSAL = (
    "brisk indexes each full block as soon as a prefill chunk computes it (trtllm's all_reusable); trtllm's "
    "per_request and per_conversation policies (its v2 KV manager) are not available"
)
# trtllm's default retention priority of a KV block (its priorities run 0-100): every brisk block has it, since brisk
# has no per-request retention priorities; kv_cache_config.secondary_offload_min_priority compares against it.
DEFAULT_RETENTION_PRIORITY = 35
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
KV_SKIP_LAYER_TYPES = ("sliding_window",)  # vLLM's --kv-cache-dtype-skip-layers layer types
# KV dtypes the peers take that brisk does not store, and why (trtllm's nvfp4, vLLM's fp8_inc and fp8_ds_mla)
KV_DTYPES_REFUSED = {
    "nvfp4": "brisk has no FP4 KV cache (Blackwell's NVFP4); fp8 halves the KV's bytes",
    "fp8_inc": "that is Intel Gaudi's FP8 KV format; use fp8",
    "fp8_ds_mla": "that is DeepSeek MLA's FP8 KV layout, and brisk serves no MLA model; use fp8",
}


class BlockReuseConfig(OptionModel):
    """kv_cache_config.block_reuse_config"""

    policy: str = option(
        "all_reusable",
        "when blocks become reusable: all_reusable only (" + BLOCK_REUSE_POLICY_REFUSAL + ")",
        trtllm="kv_cache_config.block_reuse_config.policy",
    )
    max_num_turns: int = option(
        1,
        "trtllm's turns kept by its per_conversation policy, which brisk does not have",
        trtllm="kv_cache_config.block_reuse_config.max_num_turns",
        ge=1,
        no_effect=True,
    )

    @field_validator("policy")
    @classmethod
    def _all_reusable(cls, value: str) -> str:
        if value != "all_reusable":
            raise ValueError(BLOCK_REUSE_POLICY_REFUSAL)
        return value


class KvCacheConfig(OptionModel):
    """kv_cache_config"""

    enable_block_reuse: bool = option(
        True,
        "prefix caching: full KV blocks are kept and shared by requests with the same prefix",
        vllm="enable_prefix_caching",
        trtllm="kv_cache_config.enable_block_reuse",
    )
    tokens_per_block: int = option(
        32,
        "tokens per KV cache block (the unit of paging and prefix caching)",
        vllm="block_size",
        aliases="tokens_per_block",
        ge=1,
        le=1024,
        trtllm="kv_cache_config.tokens_per_block",
    )
    free_gpu_memory_fraction: float = option(
        0.9,
        "the share of GPU memory left after the weights and a profiled step's activations that the KV cache takes "
        "(on a CPU: that share of the available RAM, at most 2 GiB)",
        trtllm=(
            "kv_cache_free_gpu_memory_fraction",
            "free_gpu_memory_fraction",  # trtllm-serve's other flag for it
            "kv_cache_config.free_gpu_memory_fraction",
        ),
        gt=0.0,
        le=1.0,
    )
    host_cache_size: int = option(
        0,
        "bytes of host memory (each rank) for prefix-cache KV blocks evicted from the device pool; a later request "
        "with their prefix gets them copied back instead of recomputed (0: none, evicted blocks are dropped)",
        trtllm="kv_cache_config.host_cache_size",
        ge=0,
    )
    max_blocks: int | None = option(
        None, "a fixed number of KV blocks (overrides the memory fraction)", vllm="num_gpu_blocks_override", ge=2
    )
    dtype: Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"] = option(
        "auto",
        "the KV cache's dtype; auto: the model's compute dtype (bfloat16 / float16: the same, where it is that one); "
        "fp8 / fp8_e4m3: FP8 E4M3 with static per-layer K and V scales (the checkpoint's k_scale / v_scale, else "
        "1.0), twice the tokens per GiB; fp8_e5m2, nvfp4, fp8_inc and fp8_ds_mla are refused with the reason",
        vllm="kv_cache_dtype",
        trtllm="kv_cache_config.dtype",
    )
    dtype_skip_layers: list[str] = option(
        default_factory=list,
        help="layer types whose KV stays in the model's dtype under an FP8 KV cache: sliding_window (the other "
        "layers' FP8 blocks then hold twice the tokens, so a block is the same bytes in every layer)",
        vllm="kv_cache_dtype_skip_layers",
        nargs="+",
        metavar="LAYER_TYPE",
    )
    # ---- trtllm's other KvCacheConfig keys: what they do in brisk, or why they are refused ----
    max_tokens: int | None = option(
        None,
        "the KV pool holds at most this many tokens in every KV group (the pool is the smallest of this, "
        "max_gpu_total_bytes, max_blocks and the memory fraction)",
        trtllm="kv_cache_config.max_tokens",
        ge=1,
    )
    max_gpu_total_bytes: int = option(
        0,
        "bytes the KV pool takes at most (0: no cap; on a CPU, bytes of RAM); vLLM's --kv-cache-memory-bytes (1G, "
        "8GiB: human-readable) sizes the pool so, within the memory fraction",
        trtllm="kv_cache_config.max_gpu_total_bytes",
        vllm="kv_cache_memory_bytes",
        parse=parse_human_int,
        ge=0,
    )
    secondary_offload_min_priority: int | None = option(
        None,
        "only blocks of a retention priority above this go to the host tier; brisk's blocks all have trtllm's "
        f"default priority {DEFAULT_RETENTION_PRIORITY}, so below {DEFAULT_RETENTION_PRIORITY} (or null) all of "
        "them may, and from it up none (the host tier is off, logged)",
        trtllm="kv_cache_config.secondary_offload_min_priority",
    )
    onboard_blocks: bool = option(
        True,
        "host-tier blocks are copied back to the device pool to serve a hit (brisk's attention reads only the "
        "device pool); false is refused with a host tier, and means nothing without one (logged)",
        trtllm="kv_cache_config.onboard_blocks",
    )
    max_attention_window: list[int] | None = option(
        None,
        "trtllm's per-layer KV window caps: null only (" + KV_CACHE_ONLY["max_attention_window"][1] + ")",
        trtllm="kv_cache_config.max_attention_window",
    )
    cross_kv_cache_fraction: float | None = option(
        None,
        "encoder-decoder models' cross-attention share: null only ("
        + KV_CACHE_ONLY["cross_kv_cache_fraction"][1]
        + ")",
        trtllm="kv_cache_config.cross_kv_cache_fraction",
    )
    use_uvm: bool = option(False, "false only (" + KV_CACHE_ONLY["use_uvm"][1] + ")", trtllm="kv_cache_config.use_uvm")
    event_buffer_max_size: int = option(
        0, KV_CACHE_ONLY["event_buffer_max_size"][1], trtllm="kv_cache_config.event_buffer_max_size"
    )
    disk_cache_size: int | None = option(
        None, "null or 0 only (" + KV_CACHE_ONLY["disk_cache_size"][1] + ")", trtllm="kv_cache_config.disk_cache_size"
    )
    kv_events_config: dict[str, Any] | None = option(
        None,
        "trtllm's KV event publisher: null, or with enable_kv_cache_events false (brisk publishes no KV cache "
        "events; its other keys then configure nothing)",
        trtllm="kv_cache_config.kv_events_config",
    )
    block_reuse_config: BlockReuseConfig = option(
        default_factory=BlockReuseConfig,
        help="trtllm's block reuse policies",
        trtllm="kv_cache_config.block_reuse_config",
    )
    enable_partial_reuse: bool = option(
        True,
        "brisk's prefix cache reuses whole matching blocks only; a partially matched block is recomputed",
        trtllm="kv_cache_config.enable_partial_reuse",
        no_effect=True,
    )
    copy_on_partial_reuse: bool = option(
        True,
        "brisk reuses no partially matched block (enable_partial_reuse)",
        trtllm="kv_cache_config.copy_on_partial_reuse",
        no_effect=True,
    )
    sink_token_length: int | None = option(
        None,
        "StreamingLLM sink tokens, ignored as on trtllm's PyTorch backend (gpt-oss's attention sinks are model "
        "weights, always used)",
        trtllm="kv_cache_config.sink_token_length",
        no_effect=True,
    )
    attention_dp_events_gather_period_ms: int = option(
        5,
        "gathers KV cache events, which brisk does not publish",
        trtllm="kv_cache_config.attention_dp_events_gather_period_ms",
        ge=0,
        no_effect=True,
    )
    kv_cache_event_hash_algo: Literal["auto", "v1_block_key", "v2_sha256", "v2_sha256_64"] = option(
        "auto",
        "hashes of KV cache events, which brisk does not publish",
        trtllm="kv_cache_config.kv_cache_event_hash_algo",
        no_effect=True,
    )
    iteration_stats_interval: int = option(
        1,
        "brisk counts its KV statistics (/metrics) every step",
        trtllm="kv_cache_config.iteration_stats_interval",
        ge=1,
        no_effect=True,
    )
    disk_cache_path: str | None = option(
        None,
        "brisk has no disk KV tier (disk_cache_size)",
        trtllm="kv_cache_config.disk_cache_path",
        no_effect=True,
    )
    disk_prefetch_num_reqs: int = option(
        0,
        "brisk has no disk KV tier to prefetch from",
        trtllm="kv_cache_config.disk_prefetch_num_reqs",
        ge=0,
        no_effect=True,
    )
    use_kv_cache_manager_v2: bool | Literal["auto"] = option(
        "auto",
        "trtllm's choice of its two KV cache managers; brisk has one, which runs",
        trtllm="kv_cache_config.use_kv_cache_manager_v2",
        no_effect=True,
    )
    max_util_for_resume: float = option(
        0.95,
        "trtllm's v2 KV manager only; brisk resumes a preempted request once its blocks fit",
        trtllm="kv_cache_config.max_util_for_resume",
        gt=0.0,
        le=1.0,
        no_effect=True,
    )
    enable_swa_scratch_reuse: bool = option(
        False,
        "trtllm's v2 KV manager only; brisk frees a sliding-window layer's blocks as the window passes them",
        trtllm="kv_cache_config.enable_swa_scratch_reuse",
        no_effect=True,
    )
    pool_ratio: list[float] | None = option(
        None,
        "brisk's KV groups share one block pool (a block serves any group): there are no per-group pools to size",
        trtllm="kv_cache_config.pool_ratio",
        no_effect=True,
    )
    avg_seq_len: int | None = option(
        None,
        "sizes trtllm's per-group pools of hybrid models; brisk's groups share one pool",
        trtllm="kv_cache_config.avg_seq_len",
        ge=1,
        no_effect=True,
    )
    enable_kv_pool_rebalance: bool = option(
        False,
        "brisk's KV groups share one block pool: there are no pool ratios to rebalance",
        trtllm="kv_cache_config.enable_kv_pool_rebalance",
        no_effect=True,
    )
    kv_pool_rebalance_min_sampled_kv_caches: int = option(
        2000,
        "tunes enable_kv_pool_rebalance",
        trtllm="kv_cache_config.kv_pool_rebalance_min_sampled_kv_caches",
        ge=0,
        no_effect=True,
    )
    kv_pool_rebalance_cooldown_secs: float = option(
        120.0,
        "tunes enable_kv_pool_rebalance",
        trtllm="kv_cache_config.kv_pool_rebalance_cooldown_secs",
        ge=0.0,
        no_effect=True,
    )
    kv_pool_rebalance_target_ratio_update_interval: int = option(
        100,
        "tunes enable_kv_pool_rebalance",
        trtllm="kv_cache_config.kv_pool_rebalance_target_ratio_update_interval",
        gt=0,
        no_effect=True,
    )
    kv_pool_rebalance_ratio_threshold: float = option(
        1.25,
        "tunes enable_kv_pool_rebalance",
        trtllm="kv_cache_config.kv_pool_rebalance_ratio_threshold",
        gt=1.0,
        no_effect=True,
    )
    kv_pool_rebalance_moving_average_decay: float = option(
        0.9999,
        "tunes enable_kv_pool_rebalance",
        trtllm="kv_cache_config.kv_pool_rebalance_moving_average_decay",
        gt=0.0,
        lt=1.0,
        no_effect=True,
    )
    kv_pool_rebalance_check_interval: int = option(
        10,
        "tunes enable_kv_pool_rebalance",
        trtllm="kv_cache_config.kv_pool_rebalance_check_interval",
        gt=0,
        no_effect=True,
    )
    fp8_context_mla_kv_len_cap: int | None = option(
        None,
        "multi-head latent attention (DeepSeek) only; no model brisk serves has it",
        trtllm="kv_cache_config.fp8_context_mla_kv_len_cap",
        no_effect=True,
    )
    mamba_ssm_cache_dtype: Literal["auto", "float16", "bfloat16", "float32"] = option(
        "auto",
        "no model brisk serves has Mamba (SSM) layers",
        trtllm="kv_cache_config.mamba_ssm_cache_dtype",
        no_effect=True,
    )
    mamba_ssm_stochastic_rounding: bool = option(
        False,
        "no model brisk serves has Mamba (SSM) layers",
        trtllm="kv_cache_config.mamba_ssm_stochastic_rounding",
        no_effect=True,
    )
    mamba_ssm_philox_rounds: int = option(
        10,
        "no model brisk serves has Mamba (SSM) layers",
        trtllm="kv_cache_config.mamba_ssm_philox_rounds",
        ge=1,
        no_effect=True,
    )
    mamba_state_cache_interval: int | None = option(
        None,
        "no model brisk serves has Mamba (SSM) layers",
        trtllm="kv_cache_config.mamba_state_cache_interval",
        ge=0,
        no_effect=True,
    )
    mamba_state_config: dict[str, Any] | None = option(
        None,
        "no model brisk serves has Mamba (SSM) layers",
        trtllm="kv_cache_config.mamba_state_config",
        no_effect=True,
    )

    @field_validator(*KV_CACHE_ONLY)
    @classmethod
    def _brisks_kv_cache_only(cls, value: Any, info: ValidationInfo) -> Any:
        return only_values(value, str(info.field_name), KV_CACHE_ONLY)

    @field_validator("kv_events_config")
    @classmethod
    def _no_kv_events(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("enable_kv_cache_events"):
            raise ValueError(
                "brisk publishes no KV cache events: give enable_kv_cache_events false, or leave kv_events_config out"
            )
        return value

    def block_limit(self, bytes_per_block: int, group_block_sizes: tuple[int, ...]) -> int | None:
        """The most blocks max_tokens and max_gpu_total_bytes leave the pool (None: neither is set): max_tokens in
        every group (each group's tokens a block) plus the null block, the whole pool within the byte budget."""
        limits = []
        if self.max_tokens is not None:
            limits.append(sum(-(-self.max_tokens // bs) for bs in group_block_sizes) + 1)
        if self.max_gpu_total_bytes:
            limits.append(self.max_gpu_total_bytes // bytes_per_block)
        return max(2, min(limits)) if limits else None

    @field_validator("max_gpu_total_bytes", mode="before")
    @classmethod
    def _human_bytes(cls, value: Any) -> Any:
        return human_int(value)

    @field_validator("host_cache_size", mode="before")
    @classmethod
    def _no_host_tier_as_zero(cls, value: Any) -> Any:
        return 0 if value is None else value  # trtllm's null: no host tier

    @field_validator("dtype", mode="before")
    @classmethod
    def _lower_dtype(cls, value: Any) -> Any:
        value = value.lower() if isinstance(value, str) else value
        reason = KV_DTYPES_REFUSED.get(value)
        if reason is not None:
            raise ValueError(f"{value} is not supported: {reason}")
        return value

    @field_validator("dtype")
    @classmethod
    def _no_e5m2(cls, value: str) -> str:
        if value == "fp8_e5m2":
            raise ValueError(
                "fp8_e5m2 is not supported: brisk stores an FP8 KV cache as E4M3 with static scales (one more "
                "mantissa bit for the same bytes); use fp8 or fp8_e4m3"
            )
        return value

    @field_validator("dtype_skip_layers")
    @classmethod
    def _skip_layer_types(cls, value: list[str]) -> list[str]:
        for item in value:
            if item not in KV_SKIP_LAYER_TYPES:
                raise ValueError(
                    f"{item!r}: brisk keeps whole layer types in the model's dtype ({', '.join(KV_SKIP_LAYER_TYPES)});"
                    " single layers cannot be skipped, since the layers of a KV group share one pool layout"
                )
        return value

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8_KV_CACHE_DTYPES
