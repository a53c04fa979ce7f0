"""Command line: `brisk serve` (OpenAI-compatible HTTP server) and `brisk generate` (offline, one prompt)."""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    # trtllm-serve spellings; both `--tp_size` and `--tp-size` are accepted.
    for name, typ in [
        ("max_batch_size", int),
        ("max_num_tokens", int),
        ("max_seq_len", int),
        ("kv_cache_free_gpu_memory_fraction", float),
        ("ep_size", int),
    ]:
        p.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest=name, type=typ)
    p.add_argument(
        "--tp_size",
        "--tp-size",
        "--tensor-parallel-size",
        "-tp",
        dest="tp_size",
        type=int,
        help="ranks (GPUs) the model is split over; more than one node: see docs/parallelism.md",
    )
    p.add_argument(
        "--enable_attention_dp",
        "--enable-attention-dp",
        dest="enable_attention_dp",
        action="store_true",
        default=None,
        help="attention data parallel over the tp_size ranks, MoE expert/tensor parallel",
    )
    p.add_argument(
        "--enable-expert-parallel",
        "--enable_expert_parallel",
        dest="enable_expert_parallel",
        action="store_true",
        help="vLLM spelling of ep_size = tp_size",
    )
    p.add_argument("--extra_llm_api_options", "--extra-llm-api-options", dest="extra_llm_api_options")
    p.add_argument("--load_format", "--load-format", dest="load_format", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device")
    p.add_argument("--moe_backend", "--moe-backend", dest="moe_backend", choices=["auto", "torch", "triton"])
    p.add_argument("--attn_backend", "--attn-backend", dest="attn_backend", choices=["auto", "torch", "triton", "cpu"])
    p.add_argument(
        "--cpu_kernels",
        "--cpu-kernels",
        dest="cpu_kernels",
        choices=["auto", "avx512", "avx2", "torch"],
        help="CPU serving: which build of brisk's C kernels runs (auto: the best this CPU runs; torch: none)",
    )
    p.add_argument("--max_num_waiting", "--max-num-waiting", dest="max_num_waiting", type=int)
    p.add_argument(
        "--speculative-config",
        "--speculative_config",
        dest="speculative_config",
        type=_json_object,
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 3} or {"method": "eagle3", "num_speculative_tokens": 3, "model": PATH} '
        "(trtllm's speculative_config keys in --extra_llm_api_options work too)",
    )
    p.add_argument(
        "--trust_remote_code",
        "--trust-remote-code",
        dest="trust_remote_code",
        action="store_true",
        default=None,
        help="accepted for compatibility; brisk runs no model code from checkpoints",
    )


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _engine_options(args: argparse.Namespace, exclude: tuple[str, ...]) -> dict:
    """EngineConfig keyword options from the parsed flags that were given."""
    options = {k: v for k, v in vars(args).items() if k not in ("command", "model", *exclude) and v is not None}
    if "moe_backend" in options:
        options["moe_config"] = {"backend": options.pop("moe_backend")}
    if options.pop("enable_expert_parallel", False):
        options["ep_size"] = options.get("tp_size", 1)
    return options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="brisk")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion offline")
    gen.add_argument("model")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max_tokens", "--max-tokens", dest="max_tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    _add_engine_args(gen)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (no MODEL: the bundled demo model)")
    serve.add_argument("model", nargs="?")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", "--served_model_name", dest="served_model_name")
    serve.add_argument(
        "--api-key",
        "--api_key",
        dest="api_key",
        help="require 'Authorization: Bearer KEY' on every route but /health (default: $BRISK_API_KEY)",
    )
    serve.add_argument(
        "--api-key-file",
        "--api_key_file",
        dest="api_key_file",
        help="read the API key from the first line of this file (keeps it out of `ps`)",
    )
    serve.add_argument(
        "--max-request-body-size",
        "--max_request_body_size",
        dest="max_request_body_size",
        type=int,
        default=8 << 20,
        help="bytes; larger bodies get 413, chunked uploads included",
    )
    serve.add_argument(
        "--allowed-origins",
        "--allowed_origins",
        dest="allowed_origins",
        type=_comma_list,
        help="comma-separated origins allowed by CORS ('*' for any); CORS is off without this flag",
    )
    serve.add_argument(
        "--log-prompts",
        "--log_prompts",
        dest="log_prompts",
        action="store_true",
        help="log each request's prompt (off by default: request logs carry no prompt text)",
    )
    serve.add_argument(
        "--request-timeout",
        "--request_timeout",
        dest="request_timeout",
        type=_positive_float,
        help="seconds; longer-running requests are aborted (finish_reason 'abort')",
    )
    serve.add_argument(
        "--shutdown-timeout",
        "--shutdown_timeout",
        dest="shutdown_timeout",
        type=_positive_float,
        default=30.0,
        help="seconds in-flight requests may run after SIGTERM before being aborted",
    )
    serve.add_argument(
        "--otlp-traces-endpoint",
        "--otlp_traces_endpoint",
        dest="otlp_traces_endpoint",
        help="export OpenTelemetry traces by OTLP/HTTP to this URL (e.g. http://collector:4318; the otel extra)",
    )
    serve.add_argument(
        "--log-format",
        "--log_format",
        dest="log_format",
        choices=["text", "json"],
        default="text",
        help="json: one JSON object a log line, and one line per finished request with its id and timings",
    )
    serve.add_argument(
        "--profile-dir",
        "--profile_dir",
        dest="profile_dir",
        help="enable POST /start_profile and /stop_profile, writing torch profiler traces (Chrome JSON) here",
    )
    serve.add_argument(
        "--state-dir",
        "--state_dir",
        dest="state_dir",
        help="folder of the server's state: stored Responses (responses.sqlite3); default ~/.local/state/brisk",
    )
    serve.add_argument(
        "--response-ttl",
        "--response_ttl",
        dest="response_ttl",
        type=_positive_float,
        default=30 * 24 * 3600.0,
        help="seconds a stored Response is kept (default 30 days)",
    )
    serve.add_argument(
        "--max-stored-responses",
        "--max_stored_responses",
        dest="max_stored_responses",
        type=int,
        default=100_000,
        help="stored Responses kept at most; the oldest go first",
    )
    _add_engine_args(serve)
    from brisk.bench import add_subcommands as add_bench_subcommands

    add_bench_subcommands(sub.add_parser("bench", help="benchmark a running server (`brisk bench serve --help`)"))
    args = parser.parse_args(argv)

    if args.command == "bench":
        import shlex

        from brisk.bench import run as run_bench

        return run_bench(args, "brisk " + shlex.join(sys.argv[1:] if argv is None else argv))

    from brisk.config import ConfigError

    if args.command == "serve":
        from brisk.server.serve import run

        server_keys = (
            "host",
            "port",
            "served_model_name",
            "api_key",
            "api_key_file",
            "max_request_body_size",
            "extra_llm_api_options",
            "allowed_origins",
            "log_prompts",
            "request_timeout",
            "shutdown_timeout",
            "otlp_traces_endpoint",
            "log_format",
            "profile_dir",
            "state_dir",
            "response_ttl",
            "max_stored_responses",
        )
        try:
            return run(
                args.model, **{k: getattr(args, k) for k in server_keys}, **_engine_options(args, exclude=server_keys)
            )
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    from brisk import LLM, SamplingParams

    try:
        llm = LLM(args.model, **_engine_options(args, exclude=("prompt", "max_tokens", "temperature")))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = llm.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    print(out[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
