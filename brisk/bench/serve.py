"""`brisk bench serve`: load-test any OpenAI-compatible server (brisk, vLLM, SGLang, trtllm-serve, llama.cpp).

One run sweeps concurrency levels (and/or Poisson request rates); every point streams its requests, measures
TTFT, TPOT, ITL and end-to-end latency per request, and the run is saved as one JSON file with PNG plots.
`--compare A.json B.json` overlays saved runs on one Pareto plot.

`--multi-turn N`: conversations of N turns instead of single requests (SGLang's bench_multiturn shape): every
conversation is active at once, turn k resends turns 1..k-1 (each user message and the model's answer) plus a new
message, on /v1/chat/completions as messages or on /v1/completions as one growing text. Each point then reports
TTFT by turn, the prompt tokens the server computed vs served from its prefix cache (each response's
usage.prompt_tokens_details.cached_tokens), and the deltas of the server's /metrics prompt and KV-cache counters.

This module imports only the standard library at the top: `brisk --help` must work without the `[bench]` extra
(httpx, matplotlib), so the modules that need those are imported when a benchmark actually runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from typing import Any

DEFAULT_LEN = 1024
DEFAULT_CONCURRENCY = (1, 4, 16, 64)


class BenchError(Exception):
    """A problem with the command line or the server that ends the run with a message, not a traceback."""


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _rates(text: str) -> list[float | None]:
    """Comma-separated requests/s; "inf" sends every request at once (None)."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected rates > 0, got {text!r}")
    return [None if v == float("inf") else v for v in values]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://host:8000")
    p.add_argument(
        "--endpoint",
        type=_endpoint,
        default="completions",
        help="completions or chat (vLLM's paths /v1/completions, /v1/chat/completions work too)",
    )
    p.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    w = p.add_argument_group("workload (default: fixed lengths, 1024 in / 1024 out)")
    w.add_argument("--input-len", type=int, help="prompt tokens, chat template included")
    w.add_argument("--output-len", type=int, help="output tokens (with --dataset: overrides the answer length)")
    w.add_argument("--random-input-range", type=int, nargs=2, metavar=("LO", "HI"), help="uniform prompt length")
    w.add_argument("--random-output-range", type=int, nargs=2, metavar=("LO", "HI"), help="uniform output length")
    w.add_argument(
        "--dataset",
        help="ShareGPT-format JSON: the first human turn is the prompt, the gpt answer's length the output length",
    )
    w.add_argument("--tokenizer", help="local tokenizer for exact prompt lengths when the server has no /tokenize")
    w.add_argument(
        "--multi-turn",
        type=int,
        metavar="TURNS",
        help="conversations of TURNS turns, each resending the history (--input-len: the first prompt, "
        "--turn-input-len: each later message, --output-len: every answer; --concurrency: requests in flight, "
        "--request-rate: conversations started a second)",
    )
    w.add_argument("--turn-input-len", type=int, help="multi-turn: tokens of each new user message after the first")
    w.add_argument(
        "--num-conversations", type=int, help="multi-turn: conversations per point (default 2 * concurrency, >= 8)"
    )
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="force exactly max_tokens output (ignore_eos and min_tokens in the request body)",
    )
    w.add_argument(
        "--no-extensions",
        dest="extensions",
        action="store_false",
        help="send only standard OpenAI fields, for servers that reject unknown ones",
    )
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("load")
    s.add_argument(
        "--concurrency",
        type=_positive_ints,
        help="max requests in flight, comma-separated: one point each (default 1,4,16,64, or no limit "
        "with --request-rate)",
    )
    s.add_argument(
        "--request-rate", type=_rates, help="Poisson arrivals, requests/s, comma-separated (default inf: all at once)"
    )
    s.add_argument(
        "--num-prompts",
        type=int,
        help="requests per point (default max(32, 4 * concurrency); 128 without a concurrency limit)",
    )
    s.add_argument("--warmup", type=int, default=1, help="requests before each point, not counted")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    o = p.add_argument_group("output")
    o.add_argument("--num-gpus", type=int, default=1, help="GPUs the server uses, for tok/s/GPU")
    o.add_argument("--out-dir", default="bench_results")
    o.add_argument("--label", help="name of this run in plots (default: model and server)")
    o.add_argument("--compare", nargs="+", metavar="RUN_JSON", help="plot saved runs on one Pareto chart and exit")
    _add_vllm_spellings(
        p.add_argument_group("vLLM's `vllm bench serve` spellings (the recipes' commands run as written)")
    )


def _add_vllm_spellings(g) -> None:
    """`vllm bench serve`'s flags for what brisk bench serve measures (vllm_spellings() maps them)."""
    g.add_argument("--host", help="with --port: the server at http://HOST:PORT (instead of --base-url)")
    g.add_argument("--port", type=int, help="with --host: the server at http://HOST:PORT")
    g.add_argument("--backend", choices=["openai", "vllm", "openai-chat"], help="openai-chat: --endpoint chat")
    g.add_argument("--dataset-name", choices=["random", "sharegpt"], help="random: --random-*-len; sharegpt: a file")
    g.add_argument("--dataset-path", help="sharegpt: the file (--dataset)")
    g.add_argument("--random-input-len", type=int, help="--input-len (with --random-range-ratio: a range)")
    g.add_argument("--random-output-len", type=int, help="--output-len (with --random-range-ratio: a range)")
    g.add_argument("--random-range-ratio", type=float, help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    g.add_argument("--max-concurrency", type=int, help="--concurrency, one point")
    g.add_argument("--result-dir", help="--out-dir")
    g.add_argument("--result-filename", help="the run's JSON file name (in --out-dir)")
    g.add_argument("--save-result", action="store_true", help="no effect: the run is always saved")
    g.add_argument("--trust-remote-code", action="store_true", help="no effect: no code is loaded")
    g.add_argument("--percentile-metrics", help="no effect: the table has the mean, p50, p90 and p99 of each")
    g.add_argument("--metric-percentiles", help="no effect: the table has the mean, p50, p90 and p99 of each")


def _endpoint(text: str) -> str:
    name = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(text, text)
    if name not in ("completions", "chat"):
        raise argparse.ArgumentTypeError(f"expected completions or chat (or their /v1 paths), got {text!r}")
    return name


def vllm_spellings(args: argparse.Namespace) -> None:
    """`vllm bench serve`'s flags as brisk's (in place); BenchError where one contradicts brisk's own flag."""

    def take(name: str, value: Any, default: Any = None) -> None:
        if value is None:
            return
        if getattr(args, name) not in (None, default) and getattr(args, name) != value:
            raise BenchError(f"--{name.replace('_', '-')} and its vLLM spelling give different values: give one")
        setattr(args, name, value)

    if args.host is not None or args.port is not None:
        take("base_url", f"http://{args.host or '127.0.0.1'}:{args.port or 8000}", "http://127.0.0.1:8000")
    if args.backend == "openai-chat":
        take("endpoint", "chat", "completions")
    if args.dataset_name == "sharegpt" and not (args.dataset_path or args.dataset):
        raise BenchError("--dataset-name sharegpt needs --dataset-path (a ShareGPT-format JSON file)")
    if args.dataset_name == "random" and (args.dataset_path or args.dataset):
        raise BenchError("--dataset-name random makes its prompts: drop --dataset-path")
    take("dataset", args.dataset_path)
    ratio = args.random_range_ratio
    if ratio is not None and not 0 <= ratio < 1:
        raise BenchError("--random-range-ratio must be in [0, 1)")
    for vllm_name, name, range_name in (
        ("random_input_len", "input_len", "random_input_range"),
        ("random_output_len", "output_len", "random_output_range"),
    ):
        length = getattr(args, vllm_name)
        if length is None:
            continue
        if ratio:
            take(range_name, [max(1, int(length * (1 - ratio))), int(length * (1 + ratio))])
        else:
            take(name, length)
    if args.max_concurrency is not None:
        take("concurrency", [args.max_concurrency])
    take("out_dir", args.result_dir, "bench_results")


def _workload(args: argparse.Namespace):
    from brisk.bench.workload import Workload

    if args.multi_turn is not None:
        if args.multi_turn < 1:
            raise BenchError("--multi-turn must be >= 1")
        if args.dataset or args.random_input_range or args.random_output_range:
            raise BenchError("--multi-turn takes fixed lengths: --input-len, --turn-input-len, --output-len")
        for name in ("input_len", "output_len", "turn_input_len"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
        input_len = args.input_len or DEFAULT_LEN
        return Workload(
            "multi-turn",
            input_len,
            args.output_len or DEFAULT_LEN,
            turns=args.multi_turn,
            turn_input_len=args.turn_input_len or input_len,
        )
    if args.turn_input_len is not None or args.num_conversations is not None:
        raise BenchError("--turn-input-len and --num-conversations need --multi-turn")
    if args.dataset:
        if args.input_len or args.random_input_range or args.random_output_range:
            raise BenchError("--dataset takes its lengths from the file: drop --input-len and the random ranges")
        if not os.path.isfile(args.dataset):
            raise BenchError(f"--dataset {args.dataset}: no such file")
        return Workload("sharegpt", output_len=args.output_len, dataset=args.dataset)
    for name in ("random_input_range", "random_output_range"):
        lo_hi = getattr(args, name)
        if lo_hi and not 1 <= lo_hi[0] <= lo_hi[1]:
            raise BenchError(f"--{name.replace('_', '-')} needs 1 <= LO <= HI")
    for name in ("input_len", "output_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    kind = "random" if args.random_input_range or args.random_output_range else "fixed"
    input_range = tuple(args.random_input_range) if args.random_input_range else None
    output_range = tuple(args.random_output_range) if args.random_output_range else None
    return Workload(
        kind,
        None if input_range else args.input_len or DEFAULT_LEN,
        None if output_range else args.output_len or DEFAULT_LEN,
        input_range,
        output_range,
    )


def _load_points(args: argparse.Namespace) -> list[tuple[int | None, float | None]]:
    rates = args.request_rate or [None]
    if args.concurrency:
        concurrencies: list[int | None] = list(args.concurrency)
    else:
        concurrencies = [None] if args.request_rate else list(DEFAULT_CONCURRENCY)
    return [(c, r) for c in concurrencies for r in rates]


def _prompt_tokenizer(http, base_url: str, model: str, endpoint: str, local_path: str | None):
    from brisk.bench.workload import LocalTokenizer, ServerTokenizer, WordTokenizer

    server = ServerTokenizer.probe(http, base_url, model, endpoint)
    if server is not None:
        return server
    if local_path:
        return LocalTokenizer(local_path, endpoint)
    print(
        "note: no /tokenize on the server and no --tokenizer: prompt lengths are approximate (words)", file=sys.stderr
    )
    return WordTokenizer()


def _extra_body(args: argparse.Namespace) -> dict[str, Any]:
    import json

    try:
        extra_body = json.loads(args.extra_body)
    except ValueError as exc:
        raise BenchError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(extra_body, dict):
        raise BenchError("--extra-body must be a JSON object")
    return extra_body


def _model_and_server(http, base_url: str, model: str | None) -> tuple[str, dict[str, Any]]:
    """The model to request (`--model`, else the first one served) and what server this is."""
    import httpx

    from brisk.bench import report

    try:
        response = http.get(f"{base_url}/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        if not model:
            raise BenchError(f"cannot list models at {base_url}/v1/models ({exc}): give --model") from None
        models = []  # the model is known: a server without the route can still be measured
    model = model or (models[0]["id"] if models else None)
    if not model:
        raise BenchError(f"{base_url}/v1/models lists no model: give --model")
    return model, report.server_info(http, base_url, models)


def _server_metrics(http, base_url: str) -> str | None:
    """The server's /metrics text now (None: it has no /metrics)."""
    import httpx

    try:
        response = http.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def _parsed(parse, texts: tuple[str | None, ...]) -> list[Any]:
    """Counters parsed from /metrics texts read before and after a point (None where the server has none)."""
    return [None if text is None else parse(text) for text in texts]


def _output_stem(out_dir: str, label: str) -> str:
    """`OUT_DIR/DATE-TIME_LABEL`, made unique: two runs in the same second must not overwrite each other."""
    from brisk.bench import report

    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{datetime.datetime.now():%Y%m%d-%H%M%S}_{report.slug(label)}")
    unique, n = stem, 1
    while os.path.exists(f"{unique}.json"):
        n += 1
        unique = f"{stem}-{n}"
    return unique


def benchmark(args: argparse.Namespace, command: str) -> int:
    import httpx

    from brisk.bench import plots, report
    from brisk.bench.client import Target, run_conversations, run_point
    from brisk.bench.metrics import (
        counter_deltas,
        kv_cache_counters,
        multi_turn_summary,
        spec_decode_counters,
        spec_decode_summary,
        summarize_point,
    )
    from brisk.bench.workload import PREPARE_THREADS, RequestFactory

    workload = _workload(args)
    if args.num_gpus < 1 or (args.num_prompts is not None and args.num_prompts < 1) or args.warmup < 0:
        raise BenchError("--num-gpus and --num-prompts must be >= 1, --warmup >= 0")
    extra_body = _extra_body(args)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=PREPARE_THREADS)  # prompts are prepared this many at a time
    with httpx.Client(timeout=60, headers=headers, limits=limits) as http:
        model, server = _model_and_server(http, base_url, args.model)
        try:
            tokenizer = _prompt_tokenizer(http, base_url, model, args.endpoint, args.tokenizer)
            factory = RequestFactory(workload, tokenizer, args.seed)
        except (OSError, ValueError) as exc:
            raise BenchError(str(exc)) from None
        target = Target(
            base_url,
            args.endpoint,
            model,
            api_key=args.api_key,
            ignore_eos=args.ignore_eos,
            extensions=args.extensions,
            temperature=args.temperature,
            extra_body=extra_body,
            timeout_s=args.timeout,
        )
        print(
            f"benchmarking {model} at {base_url} ({server['name'] or 'unknown server'} {server['version'] or ''}), "
            f"/v1/{args.endpoint}, {workload.kind} workload, prompt lengths by {tokenizer.source}",
            file=sys.stderr,
        )
        points = []
        for i, (concurrency, rate) in enumerate(_load_points(args)):
            num_prompts = args.num_prompts or max(32, 4 * (concurrency or 32))
            num_conversations = args.num_conversations or max(8, 2 * (concurrency or 4))
            try:
                warmup = factory.take(args.warmup)
                if workload.kind == "multi-turn":
                    conversations = factory.take_conversations(num_conversations)
                else:
                    specs = factory.take(num_prompts)
            except httpx.HTTPError as exc:
                raise BenchError(f"preparing prompts with the server's /tokenize failed: {exc}") from None
            if warmup:
                run_point(target, warmup, concurrency, None)
            name = f"concurrency {concurrency or 'inf'}" + (f", {rate:g} req/s" if rate else "")
            metrics_before = _server_metrics(http, base_url)
            if workload.kind == "multi-turn":
                results, duration = run_conversations(
                    target, conversations, concurrency, rate, seed=args.seed + i, description=name
                )
            else:
                results, duration = run_point(target, specs, concurrency, rate, seed=args.seed + i, description=name)
            metrics_after = _server_metrics(http, base_url)
            point = summarize_point(results, duration, concurrency, rate, args.num_gpus)
            texts = (metrics_before, metrics_after)
            point["spec_decode"] = spec_decode_summary(*_parsed(spec_decode_counters, texts))
            point["multi_turn"] = (
                multi_turn_summary(results, counter_deltas(*_parsed(kv_cache_counters, texts)))
                if workload.kind == "multi-turn"
                else None
            )
            points.append(point)
            spec = point["spec_decode"]
            print(
                f"{name}: {point['completed']} ok, {point['failed']} failed, "
                f"{point['output_throughput']:.1f} output tok/s"
                + (
                    f", drafts accepted {spec['acceptance_rate']:.1%}, mean accepted length "
                    f"{spec['mean_accepted_length']:.2f}"
                    if spec and spec["acceptance_rate"] is not None
                    else ""
                ),
                file=sys.stderr,
            )
            for error in point["errors"]:
                print(f"  error: {error}", file=sys.stderr)
    if factory.inexact_prompts:
        print(
            f"note: {factory.inexact_prompts} prompts missed their target length (is the chat template alone "
            "longer?); the results record each request's actual prompt tokens",
            file=sys.stderr,
        )

    run: dict[str, Any] = {
        "schema_version": report.SCHEMA_VERSION,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model": model,
        "label": args.label,
        "server": server,
        "machine": report.machine_info(),
        "num_gpus": args.num_gpus,
        "workload": {**workload.describe(), "prompt_tokenizer": tokenizer.source},
        "settings": {
            "ignore_eos": args.ignore_eos,
            "extensions": args.extensions,
            "temperature": args.temperature,
            "extra_body": extra_body,
            "num_prompts": args.num_prompts,
            "num_conversations": args.num_conversations,
            "warmup": args.warmup,
            "seed": args.seed,
            "timeout_s": args.timeout,
        },
        "points": points,
    }
    label = report.run_label(run)
    stem = _output_stem(args.out_dir, label)
    if args.result_filename:  # vLLM's --result-filename names the JSON file
        stem = os.path.join(args.out_dir, args.result_filename.removesuffix(".json"))
    report.write_json(run, f"{stem}.json")
    plots.plot_pareto([(label, points)], f"{stem}_pareto.png", f"{label}: throughput vs interactivity")
    plots.plot_cdfs(points, "ttft_ms", f"{stem}_ttft.png", f"{label}: time to first token")
    plots.plot_cdfs(points, "itl_ms", f"{stem}_itl.png", f"{label}: inter-token latency")
    print(f"\n{label} | {workload.kind} workload | /v1/{args.endpoint} | latencies in ms\n")
    print(report.format_table(points))
    for point in points:
        if point.get("multi_turn"):
            print(f"\nconcurrency {point['concurrency'] or 'inf'}: {report.format_multi_turn(point['multi_turn'])}")
    print(f"\nwrote {stem}.json and {stem}_{{pareto,ttft,itl}}.png")
    return 1 if any(p["failed"] for p in points) else 0


def compare(paths: list[str], out_dir: str) -> int:
    from brisk.bench import plots, report

    try:
        runs = [report.load_run(path) for path in paths]
    except (OSError, ValueError) as exc:
        raise BenchError(str(exc)) from None
    labels = [report.run_label(run) for run in runs]
    # Two runs of the same model on the same server need telling apart: add the file name.
    labels = [f"{lab} [{os.path.basename(path)}]" if labels.count(lab) > 1 else lab for lab, path in zip(labels, paths)]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "compare_pareto.png")
    plots.plot_pareto(list(zip(labels, (run["points"] for run in runs))), path, "throughput vs interactivity")
    for label, run in zip(labels, runs):
        print(f"\n{label} | {run.get('workload', {}).get('kind')} workload | latencies in ms\n")
        print(report.format_table(run["points"]))
    print(f"\nwrote {path}")
    return 0


def run(args: argparse.Namespace, command: str) -> int:
    """Run the parsed `brisk bench serve` command; the exit code is 1 when any request failed."""
    try:
        vllm_spellings(args)
        if args.compare:
            return compare(args.compare, args.out_dir)
        return benchmark(args, command)
    except ImportError as exc:
        print(f"error: {exc}; install the benchmark extra: pip install 'brisk-llm[bench]'", file=sys.stderr)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python benchmarks/serve.py ...`), the same as `brisk bench serve ...`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="brisk bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), "brisk bench serve " + shlex.join(argv))
