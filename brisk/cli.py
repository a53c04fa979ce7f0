"""Command line: `brisk generate` (offline, one prompt) and `brisk serve` (HTTP server, next milestone)."""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    # trtllm-serve spellings; both `--tp_size` and `--tp-size` are accepted.
    for name, typ in [("max_batch_size", int), ("max_num_tokens", int), ("max_seq_len", int),
                      ("kv_cache_free_gpu_memory_fraction", float), ("tp_size", int), ("ep_size", int)]:
        p.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest=name, type=typ)
    p.add_argument("--extra_llm_api_options", "--extra-llm-api-options", dest="extra_llm_api_options")
    p.add_argument("--load_format", "--load-format", dest="load_format", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="brisk")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion offline")
    gen.add_argument("model")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max_tokens", "--max-tokens", dest="max_tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    _add_engine_args(gen)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?")
    _add_engine_args(serve)
    args = parser.parse_args(argv)

    if args.command == "serve":
        print("brisk serve: the HTTP server is not built yet (see the server issue); use `brisk generate`.",
              file=sys.stderr)
        return 2

    from brisk import LLM, SamplingParams
    from brisk.config import ConfigError

    options = {k: v for k, v in vars(args).items()
               if k not in ("command", "model", "prompt", "max_tokens", "temperature") and v is not None}
    try:
        llm = LLM(args.model, **options)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = llm.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    print(out[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
