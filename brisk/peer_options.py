"""The options of `vllm serve`, `trtllm-serve` and TensorRT-LLM's LLM API that brisk does not have, with reasons.

A user's command line or YAML file from a peer must never fail on an option brisk does not know. Every option of
vLLM's `vllm serve` (0.33, and those of its releases since 0.10.1, gpt-oss's first, that 0.33 dropped), of
`trtllm-serve` and of TensorRT-LLM's `TorchLlmArgs` (the keys of an `extra_llm_api_options` file;
tests/data/peer_flags/ lists them all) is either an option of brisk's (a field of an option model in
brisk/config.py's `OPTIONS`, under any of its spellings) or listed here: given the value that means what brisk does anyway
(`accepted`; "false" for a switch) it is accepted and does nothing; any other value is refused with the reason.
"*" accepts every value: a tuning knob of the peer's own machinery, with no effect here. brisk/config.py puts the
list in the option table (`OptionTable(peers=...)`), which parses them (hidden from --help), refuses them and
documents them in docs/options.md.
"""

from __future__ import annotations

from typing import Any

from brisk.options import PeerOption

ANY = ("*",)


# vLLM 0.33's value of an option when it is not given, where that value asks for nothing brisk does not do (no
# plugin, no overrides, one node, the feature off). A command line that states it (launchers and deployment charts
# often write every flag out; tests/data/peer_flags/vllm_serve_defaults.json has each) is accepted, with no effect.
# Where vLLM's default means something brisk does otherwise, brisk has the option (--fingerprint-mode,
# --enable-prompt-tokens-details, --exclude-tools-when-tool-choice-none).
VLLM_DEFAULTS = {
    "tool-parser-plugin": ("",),
    "reasoning-parser-plugin": ("",),
    "worker-cls": ("auto",),
    "worker-extension-cls": ("",),
    "cohere-is-reasoning-model": ("true",),
    "cohere-format": ("cmd4",),
    "anthropic-disabled-thinking-effort": ("auto",),
    "data-parallel-supervisor-port": ("9256",),
    "dp-supervisor-probe-interval-s": ("5.0",),
    "dp-supervisor-probe-timeout-s": ("5.0",),
    "dp-supervisor-probe-failure-threshold": ("3",),
    "master-addr": ("127.0.0.1",),
    "master-port": ("29501",),
    "enable-flash-late-interaction": ("true",),
    "allowed-local-media-path": ("",),
    "hf-overrides": ("{}",),
    "model-class-overrides": ("{}",),
    "renderer-num-workers": ("1",),
    "model-loader-extra-config": ("{}",),
    "ignore-patterns": ('["original/**/*"]', "original/**/*"),
    "pt-load-map-location": ("cpu",),
    "mamba-backend": ("triton",),
    "mamba-cache-philox-rounds": ("0",),
    "mamba-cache-dtype": ("auto",),
    "mamba-ssm-cache-dtype": ("auto",),
    "replayssm-buffer-len": ("16",),
    "dcp-kv-cache-interleave-size": ("1",),
    "all2all-backend": ("allgather_reducescatter",),
    "ubatch-size": ("0",),
    "dbo-decode-token-threshold": ("32",),
    "dbo-prefill-token-threshold": ("512",),
    "dp-sync-interval": ("16",),
    "prefix-cache-retention-interval": ("0",),
    "swa-bounded-replay": ("true",),
    "offload-backend": ("auto",),
    "offload-group-size": ("0",),
    "offload-num-in-group": ("1",),
    "offload-prefetch-step": ("1",),
    "limit-mm-per-prompt": ("{}",),
    "media-io-kwargs": ("{}",),
    "mm-processor-cache-gb": ("4",),
    "mm-processor-cache-type": ("lru",),
    "mm-hasher-algorithm": ("blake3",),
    "mm-shm-cache-max-object-size-mb": ("128",),
    "mm-encoder-tp-mode": ("weights",),
    "mm-encoder-fp8-scale-save-margin": ("1.5",),
    "video-pruning-method": ("evs",),
    "mm-tensor-ipc": ("direct_rpc",),
    "mm-processor-device": ("auto",),
    "mm-ipc-gpu-memory-gb": ("0",),
    "per-request-spec-decode-metrics": ("none",),
    "kv-cache-metrics-sample": ("0.01",),
    "jit-monitor-mode": ("warn",),
    "scheduler-reserve-full-isl": ("true",),
    "watermark": ("0.0",),
    "prefill-schedule-interval": ("1",),
    "linear-backend": ("auto",),
    "sparse-indexer-topk-backend": ("auto",),
    "additional-config": ("{}",),
}


def _peer_option(name: str, reason: str, accepted: tuple[str, ...], **kwargs: Any) -> PeerOption:
    """`name`'s spellings are joined by '/' (`nnodes/-n`); vLLM's default (VLLM_DEFAULTS) is accepted too."""
    names = tuple(name.split("/"))
    if accepted != ANY:
        accepted = accepted + tuple(v for v in VLLM_DEFAULTS.get(names[0], ()) if v not in accepted)
    return PeerOption(names, reason, accepted, **kwargs)


def _switches(names: str, reason: str, accepted: tuple[str, ...] = ("false",)) -> list[PeerOption]:
    """One switch a word of `names`."""
    return [_peer_option(name, reason, accepted) for name in names.split()]


def _values(names: str, reason: str, accepted: tuple[str, ...] = (), nargs: str | None = None) -> list[PeerOption]:
    """One option taking a value a word of `names`."""
    return [_peer_option(name, reason, accepted, switch=False, nargs=nargs) for name in names.split()]


_LORA = (
    "brisk serves no LoRA adapters: merge the adapter into the weights (peft's merge_and_unload) and serve the "
    "merged model"
)
_MULTIMODAL = "brisk serves text-only models: there is no image, audio or video input to configure"
_MAMBA = "brisk serves attention models only (no Mamba / SSM layers)"
_ONE_NODE = (
    "brisk starts its ranks itself on one node, and on several through torchrun or mpirun running `brisk serve` "
    "with the same arguments on every rank (docs/parallelism.md); vLLM's and trtllm's own multi-node launchers "
    "(headless nodes, Ray, data-parallel RPC) are not available"
)
_NO_PLUGINS = (
    "brisk loads no code named on its command line (plugins, custom classes, middleware); its own implementation serves"
)
_DISAGGREGATION = (
    "prefill/decode disaggregation and KV transfer between instances are not available in brisk; its host KV tier "
    "is --kv-offloading-size"
)
_SLEEP = "brisk has no sleep mode: its weights and KV cache stay on the device for the life of the server"
_TORCH_COMPILE_TUNING = (
    "brisk compiles nothing with torch.compile and picks its own kernels (--attention-backend, --moe-backend); "
    "this tuning of vLLM's has nothing to act on"
)
_METRICS = "brisk's /metrics has a fixed set of vLLM's metric names (docs/observability.md); this one is not among them"
_ONE_API = (
    "brisk serves the OpenAI API (chat completions, completions, responses) over HTTP; this other interface is not "
    "available"
)
_SCHEDULER = (
    "brisk's scheduler has one policy: waiting requests by (priority, arrival), which is vLLM's 'priority' and, while "
    "every request's priority is 0, its 'fcfs'; bounded by --max-num-seqs, --max-num-batched-tokens and "
    "--max-num-waiting"
)
_NO_OVERRIDES = "brisk reads the model's config.json as it is; edit a local copy of the checkpoint's config instead"
_ENGINE_INTERNALS = "an implementation detail of vLLM's engine that brisk's engine does not have"
_CONTEXT_PARALLEL = "brisk has no context parallelism: attention is tensor or data parallel"
_WEIGHT_OFFLOAD = "brisk keeps every weight on the device: weight offloading to host memory is not available"
STATIC_EXPERTS = (
    "brisk places experts statically (rank r holds a contiguous range); expert load balancing is not available"
)
_V0_ENGINE = "no effect: a knob of vLLM's V0 engine, which its V1 engine ignored too"
_TRTLLM_SAMPLER = "no effect: it picks TensorRT-LLM's sampler implementation; brisk samples with its own"

# Keys whose mapping holds options by their top-level names (OptionTable's containers), with what the docs say.
PEER_CONTAINERS = {
    "pytorch_backend_config": "TensorRT-LLM <= 0.20's PyTorch backend options (its PyTorchConfig): each key is read "
    "as the top-level key of that name, as later releases spell them (use_cuda_graph, cuda_graph_batch_sizes, "
    "enable_overlap_scheduler as the opposite of disable_overlap_scheduler, moe_backend, kv_cache_dtype...)",
}

PEER_OPTIONS: list[PeerOption] = [
    # ---- vLLM: the API server ----
    *_switches("headless enable-scale-out", _ONE_NODE),
    *_values(
        "data-parallel-rank/-dpn data-parallel-start-rank/-dpr data-parallel-size-local/-dpl "
        "data-parallel-address/-dpa data-parallel-rpc-port/-dpp data-parallel-supervisor-port dp-supervisor-probe-interval-s "
        "dp-supervisor-probe-timeout-s dp-supervisor-probe-failure-threshold master-addr master-port "
        "distributed-timeout-seconds cpu-distributed-timeout-seconds",
        _ONE_NODE,
    ),
    *_switches(
        "data-parallel-hybrid-lb/-dph data-parallel-external-lb/-dpe data-parallel-multi-port-external-lb/-dpm",
        _ONE_NODE,
    ),
    *_values("nnodes/-n", _ONE_NODE, ("1",)),
    *_values("node-rank/-r", _ONE_NODE, ("0",)),
    *_values("data-parallel-backend/-dpb", _ONE_NODE + " (its data-parallel ranks are processes: mp)", ("mp",)),
    *_switches("grpc tokens-only cohere-is-reasoning-model", _ONE_API),
    *_values("grpc-port cohere-format anthropic-disabled-thinking-effort", _ONE_API),
    *_values("lora-modules", _LORA, nargs="+"),
    *_switches(
        "enable-lora enable-tower-connector-lora fully-sharded-loras specialize-active-lora "
        "enable-mixed-moe-lora-format enable-moe-shared-loras",
        _LORA,
    ),
    *_values("lora-target-modules default-mm-loras", _LORA),
    *_values(
        "max-loras max-lora-rank lora-dtype max-cpu-loras",
        "no effect: sizes of LoRA adapter slots, which vLLM and trtllm too use only with LoRA on; brisk serves no "
        "LoRA adapters (--enable-lora is refused)",
        ANY,
    ),
    *_values("max-lora-cls-labels", _LORA),
    *_values(
        "chat-template-content-format",
        "brisk renders a message's text parts joined into one string (vLLM's 'string'); the 'openai' form is not "
        "available",
        ("auto", "string"),
    ),
    *_switches(
        "trust-request-chat-template",
        "brisk renders every request with the server's chat template (--chat-template); a request's own template is "
        "not accepted",
    ),
    *_values("response-role", "brisk's responses always have the role 'assistant'", ("assistant",)),
    *_values("tool-parser-plugin reasoning-parser-plugin", _NO_PLUGINS),
    *_values(
        "tool-strict-level",
        "brisk constrains a forced or required tool call's arguments to the function's JSON schema (vLLM's auto)",
        ("auto",),
    ),
    *_values(
        "tool-server",
        "brisk runs no built-in tools (browser, python, MCP servers): clients run their tools through function calling",
    ),
    *_switches("enable-per-request-metrics", _METRICS),
    *_switches(
        "enable-server-load-tracking",
        "brisk always counts its requests in flight and serves the count at GET /load (the switch on is its behaviour)",
        ("true", "false"),
    ),
    *_switches(
        "enable-log-deltas",
        "no effect: brisk logs a request's outputs whole when it ends (--enable-log-outputs), not each streamed delta",
        ANY,
    ),
    *_switches(
        "log-error-stack",
        "brisk logs the traceback of a server error always (the switch on is its behaviour), and of a start-up error "
        "at --log-level debug",
        ("true", "false"),
    ),
    *_values(
        "disable-access-log-for-endpoints",
        "brisk logs /health and /metrics requests at debug level only; --disable-log-requests quiets every request "
        "line",
    ),
    *_switches(
        "enable-ssl-refresh",
        "brisk reads its certificate (--ssl-certfile, --ssl-keyfile) at start-up: restart it to load a new one",
    ),
    PeerOption(("middleware",), _NO_PLUGINS, (), switch=False, nargs="+"),
    *_switches("enable-offline-docs", "brisk's /docs page loads its scripts from a CDN"),
    *_values(
        "h11-max-incomplete-event-size h11-max-header-count",
        "no effect: brisk's HTTP server parses with httptools (a dependency), to which h11's limits do not apply; it "
        "bounds a request's body by --max-request-body-size",
        ANY,
    ),
    *_switches("enable-flash-late-interaction", _ENGINE_INTERNALS),
    # ---- vLLM: the model ----
    *_values("runner", "brisk runs generative models only (no pooling or draft runners)", ("auto", "generate")),
    *_values("convert", "brisk runs generative models only (no conversion to pooling models)", ("auto", "none")),
    *_values(
        "tokenizer-mode",
        "brisk loads the model's fast tokenizer (tokenizer.json) through transformers (vLLM's hf mode)",
        ("auto", "hf"),
    ),
    *_values("config-format", "brisk reads the Hugging Face config.json", ("auto", "hf")),
    *_values(
        "model-impl",
        "brisk runs its own model code (gpt-oss, Llama, Qwen3); other implementations are not available",
        ("auto", "vllm"),
    ),
    *_values("hf-config-path", _NO_OVERRIDES),
    *_values("allowed-local-media-path allowed-media-domains media-io-kwargs", _MULTIMODAL),
    *_values("code-revision", "brisk runs no code from a model's repository (only its own model code)"),
    PeerOption(
        ("quantization", "-q"),
        "brisk runs a checkpoint's own quantization (gpt-oss: MXFP4 experts, from its config.json) and quantizes "
        "nothing at load time",
        ("null", "none", "mxfp4"),
        switch=False,
    ),
    *_values("quantization-config", "brisk reads a checkpoint's quantization from its config.json"),
    *_switches("allow-deprecated-quantization", "brisk has no deprecated quantization methods"),
    *_switches(
        "enable-return-routed-experts return-sampling-mask use-fp64-gumbel enable-trace-replay enable-prompt-embeds "
        "skip-tokenizer-init",
        _ENGINE_INTERNALS,
    ),
    *_values(
        "logprobs-mode",
        "brisk's logprobs are the log-softmax of the model's raw logits (vLLM's raw_logprobs)",
        ("raw_logprobs",),
    ),
    *_switches(
        "disable-sliding-window",
        "brisk attends over each layer's window from the model's config.json; full attention on sliding-window "
        "layers would change the model's outputs",
    ),
    *_switches("disable-cascade-attn", "no effect in vLLM either: cascade attention is gone from both", ANY),
    *_values("hf-overrides model-class-overrides", _NO_OVERRIDES),
    *_values("pooler-config override-pooler-config", "brisk runs generative models only (no pooling)"),
    *_switches(
        "enable-sleep-mode sleep-mode-offload-cudagraph enable-cumem-allocator enable-nccl-comm-suspend", _SLEEP
    ),
    *_values("sleep-preserve-parameter-names", _SLEEP),
    *_values("sleep-mode-backend", _SLEEP, ("cumem",)),  # vLLM's default: what sleep mode would use (none here)
    *_values(
        "watchdog-config",
        "brisk has no stack-dump watchdog (a dump_dir would switch vLLM's on); `py-spy dump --pid PID` prints a "
        "running server's stacks",
        ("{}", '{"dump_dir": ""}'),
    ),
    *_values("logits-processors io-processor-plugin worker-cls worker-extension-cls scheduler-cls", _NO_PLUGINS),
    *_values(
        "renderer-num-workers",
        "brisk renders chat templates in its API-server processes: --api-server-count sets how many",
    ),
    *_values(
        "safetensors-load-strategy safetensors-prefetch-num-threads safetensors-prefetch-block-size "
        "max-parallel-loading-workers",
        "no effect: brisk's loader reads safetensors its own way (memory-mapped, tensor by tensor)",
        ANY,
    ),
    *_switches("use-tqdm-on-load", "no effect: brisk logs the load's time, not a progress bar", ANY),
    *_values(
        "model-loader-extra-config pt-load-map-location",
        "brisk's loader reads safetensors (and --load-format dummy) with no further settings",
    ),
    *_values(
        "ignore-patterns",
        "brisk downloads a model's config, tokenizer and safetensors files only (never original/ or .bin files)",
        nargs="+",
    ),
    *_values(
        "mamba-backend mamba-ssu-algorithm mamba-cache-philox-rounds mamba-cache-dtype mamba-ssm-cache-dtype "
        "mamba-block-size mamba-cache-mode replayssm-buffer-len prefix-match-unit",
        _MAMBA,
    ),
    *_switches("enable-mamba-cache-stochastic-rounding enable-mamba-shared-prefix-checkpoint use-replayssm", _MAMBA),
    # ---- vLLM: parallelism and loading ----
    *_values(
        "distributed-executor-backend",
        "brisk runs one process per rank (vLLM's mp; uni with one rank); ray and external launchers are not available",
        ("mp", "uni"),
    ),
    *_switches("numa-bind", "brisk sets no NUMA binding of its own: bind it with numactl or the container runtime"),
    *_values(
        "numa-bind-nodes numa-bind-cpus",
        "brisk sets no NUMA binding of its own: bind it with numactl or the container runtime",
    ),
    *_values("device-ids", "brisk uses the GPUs CUDA_VISIBLE_DEVICES gives it, in that order"),
    *_values("decode-context-parallel-size/-dcp prefill-context-parallel-size/-pcp", _CONTEXT_PARALLEL, ("1",)),
    *_values("dcp-comm-backend dcp-kv-cache-interleave-size cp-kv-cache-interleave-size", _CONTEXT_PARALLEL),
    *_switches("dcp-q-replicate", _CONTEXT_PARALLEL),
    *_switches(
        "enable-hc-sp enable-batch-sharded-sampling enable-ep-weight-filter enable-dbo enable-shm-tensor-arena "
        "disable-nccl-for-dp-synchronization ray-workers-use-nsight enable-elastic-ep enable-fault-tolerance",
        _ENGINE_INTERNALS,
    ),
    *_values(
        "all2all-backend ubatch-size dbo-decode-token-threshold dbo-prefill-token-threshold dp-sync-interval "
        "elastic-ep-max-dp-size fault-tolerance-config",
        _ENGINE_INTERNALS,
    ),
    *_switches("enable-eplb", STATIC_EXPERTS),
    *_values("eplb-config", STATIC_EXPERTS),
    *_values(
        "expert-placement-strategy", "brisk places experts in contiguous ranges per rank (vLLM's linear)", ("linear",)
    ),
    *_switches("disable-custom-all-reduce", "no effect: brisk's all-reduce is torch.distributed's (NCCL, gloo)", ANY),
    # ---- vLLM: the KV cache ----
    *_values(
        "prefix-caching-hash-algo",
        "no effect: brisk keys its prefix cache by each block's tokens and its parent's key (exact matches, no digest "
        "to choose)",
        ANY,
    ),
    *_values("prefix-cache-retention-interval", _ENGINE_INTERNALS),
    *_switches("kv-sharing-fast-prefill swa-bounded-replay disable-hybrid-kv-cache-manager", _ENGINE_INTERNALS),
    *_values(
        "offload-backend cpu-offload-params offload-group-size offload-num-in-group offload-prefetch-step "
        "offload-params",
        _WEIGHT_OFFLOAD,
    ),
    *_values("cpu-offload-gb", _WEIGHT_OFFLOAD, ("0",)),
    # ---- vLLM: multimodal inputs ----
    *_switches("language-model-only", "no effect: brisk's models are language models only", ("true", "false")),
    *_switches(
        "enable-mm-embeds mm-encoder-only interleave-mm-strings skip-mm-profiling mm-device-do-normalize "
        "trust-request-mm-kwargs disable-chunked-mm-input",
        _MULTIMODAL,
    ),
    *_values(
        "limit-mm-per-prompt mm-processor-kwargs mm-processor-cache-gb mm-processor-cache-type mm-hasher-algorithm "
        "mm-shm-cache-max-object-size-mb mm-encoder-tp-mode mm-encoder-attn-backend mm-encoder-attn-dtype "
        "mm-encoder-fp8-scale-path mm-encoder-fp8-scale-save-path mm-encoder-fp8-scale-save-margin "
        "video-pruning-rate video-pruning-method mm-tensor-ipc mm-processor-device mm-ipc-gpu-memory-gb",
        _MULTIMODAL,
    ),
    # ---- vLLM: logging and metrics ----
    *_values(
        "logging-config log-config-file",
        "brisk's logs are set by --log-level and --log-format (text, or JSON lines for collectors)",
    ),
    *_values("show-hidden-metrics-for-version", "no effect: brisk's /metrics hides no deprecated metrics", ANY),
    *_values(
        "collect-detailed-traces",
        "brisk's OpenTelemetry spans (--otlp-traces-endpoint) are per request and per engine step, with no more "
        "detailed level",
    ),
    *_values(
        "per-request-spec-decode-metrics kv-cache-metrics-sample custom-histogram-buckets jit-monitor-mode", _METRICS
    ),
    *_switches(
        "kv-cache-metrics cudagraph-metrics enable-layerwise-nvtx-tracing enable-mfu-metrics jit-monitor-verbose",
        _METRICS,
    ),
    *_switches("aggregate-engine-logging", "no effect: brisk has one engine process and logs from it", ANY),
    *_switches("fail-on-environ-validation", "brisk reads no performance settings from environment variables"),
    # ---- vLLM: the scheduler ----
    *_values(
        "max-num-scheduled-tokens",
        "brisk's one token budget per step is --max-num-batched-tokens (speculative tokens included)",
    ),
    *_values(
        "max-num-active-seqs",
        "brisk's running batch is bounded by --max-num-seqs, which also sizes its CUDA graphs",
    ),
    *_values(
        "max-num-queued-reqs",
        "brisk bounds the requests waiting beyond the running batch with --max-num-waiting (then answers 429), not "
        "the requests in flight",
    ),
    *_values("max-num-queued-tokens watermark prefill-schedule-interval", _SCHEDULER),
    *_switches("long-prefill-token-threshold-adaptive scheduler-reserve-full-isl", _SCHEDULER),
    *_values("scheduling-policy", _SCHEDULER, ("fcfs", "priority")),
    # ---- vLLM: kernels, compilation and other configs ----
    *_values(
        "ir-op-priority linear-backend sparse-indexer-topk-backend gdn-prefill-backend kda-prefill-backend "
        "kda-decode-backend kernel-config",
        _TORCH_COMPILE_TUNING,
    ),
    *_switches("enable-flashinfer-autotune", _TORCH_COMPILE_TUNING),
    *_switches(
        "monokernel", "brisk has no MonoKernel (vLLM's persistent decoder-layer kernel for DeepSeek on AMD GPUs)"
    ),
    PeerOption(
        ("attention-config", "-ac"),
        "brisk picks its attention kernels with --attention-backend (vLLM's names work)",
        (),
        switch=False,
    ),
    *_values(
        "spec-method spec-model spec-tokens",
        'give speculative decoding as one option: --speculative-config \'{"method": "ngram" or "eagle3", '
        '"model": ..., "num_speculative_tokens": N}\'',
    ),
    *_values("kv-transfer-config kv-events-config ec-transfer-config ec-manager-config", _DISAGGREGATION),
    *_values(
        "watermark-config diffusion-config/-dc engram-config aux-output-config additional-config", _ENGINE_INTERNALS
    ),
    *_values(
        "reasoning-config",
        "brisk parses gpt-oss's reasoning with its harmony parser; a request sets its depth with reasoning_effort",
    ),
    *_values(
        "profiler-config",
        "brisk's profiler is trtllm's: --profile-dir enables POST /start_profile and /stop_profile (torch profiler "
        "traces)",
    ),
    *_values("weight-transfer-config", _SLEEP.replace("has no sleep mode", "takes no weight updates while serving")),
    # ---- vLLM: flags of its releases 0.10.1 to 0.32 that 0.33 no longer has (vllm_serve_releases.json) ----
    *_switches(
        "calculate-kv-scales",
        "no effect, as in vLLM since it deprecated it: FP8 KV scales are the checkpoint's k_scale / v_scale, else 1.0",
        ANY,
    ),
    *_switches("disable-async-output-proc", _V0_ENGINE, ANY),
    *_values("num-lookahead-slots", _V0_ENGINE, ANY),
    *_switches(
        "disable-frontend-multiprocessing",
        "no effect: brisk's API server and engine always run in processes of their own (--api-server-count sets how "
        "many API servers)",
        ANY,
    ),
    *_switches(
        "disable-mm-preprocessor-cache use-gpu-for-pooling-score",
        "no effect: brisk serves text-only generative models (no multimodal preprocessing, no pooling)",
        ANY,
    ),
    *_switches(
        "enable-bf16x3-router-gemm",
        "brisk's MoE router multiplies in the model's dtype, as transformers' gpt-oss does; a bf16x3 (fp32-accurate) "
        "router GEMM is not available",
    ),
    *_switches("enable-lora-bias", _LORA),
    *_values("lora-extra-vocab-size", _LORA),
    *_switches("enable-prompt-adapter", "brisk serves no prompt adapters (vLLM removed them too)"),
    *_switches("enable-mamba-fine-grained-prefix-cache", _MAMBA),
    *_switches("enable-multimodal-encoder-data-parallel", _MULTIMODAL),
    *_switches("eplb-log-balancedness", STATIC_EXPERTS),
    *_values("eplb-window-size eplb-step-interval", STATIC_EXPERTS),
    *_values("num-redundant-experts", STATIC_EXPERTS, ("0",)),
    *_values("logits-processor-pattern", _NO_PLUGINS),
    *_values(
        "max-num-partial-prefills max-long-partial-prefills",
        "vLLM's V1 engine only derives --long-prefill-token-threshold (4% of max_model_len) from it: give that",
        ("1",),
    ),
    *_values(
        "max-seq-len-to-capture",
        "no effect: brisk's CUDA graphs serve every context length; they are captured per batch size "
        "(--max-cudagraph-capture-size)",
        ANY,
    ),
    *_values(
        "override-attention-dtype",
        "brisk's attention computes in the model's dtype (--dtype) and stores KV in --kv-cache-dtype",
    ),
    *_values("override-neuron-config", "brisk runs on NVIDIA GPUs and on CPUs (no AWS Neuron)"),
    *_values(
        "preemption-mode",
        "brisk preempts by recompute, as vLLM's V1 engine: a preempted request's full blocks stay in the prefix "
        "cache (and, with --kv-offloading-size, in host memory once evicted), so it recomputes only what neither "
        "holds",
        ("recompute",),
    ),
    *_values("rope-scaling rope-theta", _NO_OVERRIDES),
    *_values(
        "scheduler-delay-factor",
        "brisk schedules every waiting request at the next step; it holds none back to batch it with later ones",
        ("0", "0.0"),
    ),
    *_values(
        "swap-space",
        "no effect, as in vLLM's V1 engine (which only checked host memory with it): brisk's host KV tier is "
        "--kv-offloading-size",
        ANY,
    ),
    *_values("task", "brisk runs generative models only (no pooling or transcription tasks)", ("auto", "generate")),
    # ---- TensorRT-LLM's LLM API keys (extra_llm_api_options; TorchLlmArgs) ----
    *_values(
        "moe_tensor_parallel_size",
        "brisk splits the MoE ep_size ways by expert and tp_size / ep_size ways by intermediate size: give ep_size",
        ("null",),
    ),
    *_values("pp_partition", "brisk has no pipeline parallelism (pp_size 1)", ("null",)),
    *_values("cp_config", _CONTEXT_PARALLEL, ("null", "{}")),
    *_values("lora_config peft_cache_config", _LORA, ("null",)),
    *_values("guided_decoding_backend", "brisk's structured outputs run on xgrammar", ("null", "auto", "xgrammar")),
    *_values("post_processor_hook batched_logits_processor checkpoint_loader mpi_session", _NO_PLUGINS, ("null",)),
    *_values("model_kwargs", _NO_OVERRIDES, ("null", "{}")),
    *_values(
        "scheduler_config",
        "brisk's scheduler admits requests while KV blocks are free and preempts the newest when they run out "
        "(trtllm's MAX_UTILIZATION); its policies are not configurable",
        ("null", "{}", '{"capacity_scheduler_policy": "max_utilization"}'),
    ),
    *_values(
        "batch_wait_timeout_ms batch_wait_timeout_iters batch_wait_max_tokens_ratio",
        "brisk schedules every waiting request at the next step; it holds none back to batch it with later ones",
        ("0", "0.0"),
    ),
    *_values("cache_transceiver_config kv_connector_config dwdp_config", _DISAGGREGATION, ("null",)),
    *_values(
        "sparse_attention_config kv_cache_compression_config",
        "brisk attends over every token of each "
        "layer's window: sparse attention and KV compression would change the model's outputs",
        ("null",),
    ),
    *_switches("gather_generation_logits", "brisk returns logprobs (logprobs, top_logprobs), not whole logits"),
    *_values("decoding_config", "trtllm's deprecated decoding config: speculative_config sets brisk's", ("null",)),
    *_values(
        "orchestrator_type ray_worker_extension_cls ray_placement_config ray_worker_nsight_options",
        _ONE_NODE,
        ("null",),
    ),
    *_values("sleep_config", _SLEEP, ("null",)),
    *_values("reorder_policy_config", _SCHEDULER, ("null",)),
    *_values(
        "encoder_cuda_graph_config encoder_max_batch_size encoder_max_num_tokens",
        "brisk serves decoder-only models (no encoder)",
        ("null",),
    ),
    *_values("multimodal_config", _MULTIMODAL, ("null", "{}")),
    *_switches("encode_only", "brisk runs decoder-only generation (no encode-only forward)"),
    *_switches(
        "return_perf_metrics enable_energy_metrics enable_resource_governor force_dynamic_quantization "
        "enable_in_graph_sampling enable_speculative_beam_history_d2h",
        _ENGINE_INTERNALS,
    ),
    *_values("perf_metrics_output_dir prometheus_metrics_config", _METRICS, ("null",)),
    *_values("checkpoint_format", "brisk reads Hugging Face safetensors checkpoints", ("null", "hf")),
    # ---- TensorRT-LLM's LLM API keys of its releases 0.19 to 1.2 that later ones dropped ----
    *_switches(
        "enable_trtllm_sampler enable_trtllm_decoder use_torch_sampler disable_flashinfer_sampling",
        _TRTLLM_SAMPLER,
        ANY,
    ),
    *_values("sampler_type", _TRTLLM_SAMPLER, ANY),
    *_switches("use_kv_cache", "brisk always keeps a KV cache", ("true",)),
    *_values("extra_resource_managers", _NO_PLUGINS, ("null", "{}")),
    *_values("connector_config disagg_cluster", _DISAGGREGATION, ("null",)),
    *_switches("enable_sleep", _SLEEP),
    *_values(
        "batching_type",
        "brisk batches in flight (requests join and leave the batch at every step); static batching is not available",
        ("null", "inflight"),
    ),
    *_switches(
        "normalize_log_probs",
        "brisk reports each token's log-probability; length-normalized sequence log-probabilities (a beam-search "
        "output) are not available",
    ),
    *_values("max_prompt_adapter_token", "brisk serves no prompt adapters (vLLM removed them too)", ("0",)),
    *_values(
        "quant_config",
        "brisk reads the weights' quantization from the checkpoint's config.json (quantization_config); the KV "
        "cache's is kv_cache_config.dtype (fp8)",
        ("null", "{}"),
    ),
    *_values(
        "build_config",
        "no effect: TensorRT engine-build settings, which trtllm-serve drops for its PyTorch backend too; give "
        "max_batch_size, max_num_tokens and max_seq_len as top-level keys",
        ANY,
    ),
    *_values("checkpoint_io_policy", "brisk's loader reads checkpoints its own way", ("auto",)),
    *_values(
        "max_input_len",
        "no effect: brisk bounds a prompt by max_seq_len, as trtllm's PyTorch backend does",
        ANY,
    ),
    *_values(
        "postprocess_tokenizer_dir",
        "no effect: brisk post-processes with the model's tokenizer (or --tokenizer), as trtllm-serve sets it",
        ANY,
    ),
    *_values(
        "iter_stats_max_iterations request_stats_max_iterations max_stats_len perf_metrics_max_requests "
        "garbage_collection_gen0_threshold telemetry_config mx_config gms_config layer_wise_benchmarks_config "
        "nvfp4_gemm_config mla_skip_correction_threshold allreduce_strategy torch_compile_config "
        "prefill_cuda_graph_backend prefill_capture_num_tokens",
        "no effect: a statistics, telemetry or kernel-tuning knob of TensorRT-LLM's engine; brisk's engine has none "
        "of these (its statistics are on GET /metrics)",
        ANY,
    ),
    *_switches(
        "enable_iter_perf_stats enable_iter_req_stats enable_autotuner autotuner_enabled enable_layerwise_nvtx_marker "
        "enable_min_latency enable_lm_head_tp_in_adp enable_mla_skip_correction sampler_force_async_worker "
        "enable_early_first_token_response enable_low_latency_host_dispatch use_fine_grained_sync "
        "use_cute_dsl_blockscaling_mm use_cute_dsl_blockscaling_bmm use_cute_dsl_bf16_bmm use_cute_dsl_bf16_gemm "
        "enable_encoder_decoder_mixed_cuda_graph disable_mm_encoder torch_compile_enabled torch_compile_fullgraph "
        "torch_compile_inductor_enabled torch_compile_piecewise_cuda_graph torch_compile_enable_userbuffers",
        "no effect: a statistics or kernel-tuning switch of TensorRT-LLM's engine; brisk's engine has none of these",
        ANY,
    ),
    # ---- trtllm-serve ----
    *_values("custom_tokenizer", "brisk loads the model's tokenizer (or --tokenizer) through transformers"),
    *_values("custom_module_dirs", _NO_PLUGINS, nargs="+"),
    *_values("max_beam_width", "brisk has no beam search (one beam)", ("1",)),
    *_values("context_parallel_size cp_size", _CONTEXT_PARALLEL, ("1",)),
    *_values(
        "moe_cluster_parallel_size cluster_size",
        "brisk splits the MoE by expert (--ep_size) and by intermediate size (tp_size / ep_size) only",
        ("null", "1"),
    ),
    *_values(
        "gpus_per_node",
        "no effect: each rank uses the GPU of its LOCAL_RANK, as its launcher (torchrun / mpirun) sets it",
        ANY,
    ),
    *_values("metadata_server_config_file server_role disagg_cluster_uri", _DISAGGREGATION),
    *_switches(
        "fail_fast_on_attention_window_too_large",
        "brisk fails at start-up whenever one sequence of max_seq_len cannot fit in the KV cache (the switch on is its "
        "behaviour)",
        ("true", "false"),
    ),
]
