"""`brisk bench serve` against a live `brisk serve` on a tiny Llama: metrics, JSON schema, plots, --compare.

Timings are never asserted (the machine may be busy); only their consistency: TTFT <= E2E, gaps >= 0, and the
aggregates agree with the per-request records.
"""

from __future__ import annotations

import glob
import json
import os
import random
from pathlib import Path

import pytest

from brisk.bench.client import RequestResult
from brisk.bench.metrics import STATS, summarize_point
from brisk.bench.plots import pareto_front
from brisk.bench.workload import LocalTokenizer, RequestFactory, WordTokenizer, Workload, exact_prompt
from brisk.cli import main
from tests.server_utils import RunningServer, free_port
from tests.tiny_models import make_tiny_llama_with_tokenizer
from tests.tiny_tokenizer import make_tiny_tokenizer

RUN_KEYS = {
    "schema_version",
    "command",
    "date",
    "base_url",
    "endpoint",
    "model",
    "label",
    "server",
    "machine",
    "num_gpus",
    "workload",
    "settings",
    "points",
}
POINT_KEYS = {
    "spec_decode",  # the server's speculation counters over the point (None: it has none)
    "multi_turn",  # --multi-turn runs only (None otherwise)
    "concurrency",
    "request_rate",
    "num_requests",
    "completed",
    "failed",
    "errors",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "output_tokens_source",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "output_throughput_per_gpu",
    "output_throughput_per_user",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "requests",
}
REQUEST_KEYS = {
    "prompt_tokens",
    "output_tokens",
    "output_tokens_from_usage",
    "ttft_ms",
    "e2e_ms",
    "itl_ms",
    "error",
    "cached_tokens",
    "conversation",
    "turn",
}
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 16, 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_bench")
    make_tiny_llama_with_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = RunningServer(model_dir, "--served-model-name", "tiny", "--max_batch_size", "8", "--max_num_tokens", "256")
    yield srv
    srv.stop()


def _bench(out_dir: str, *args: str) -> dict:
    assert main(["bench", "serve", "--out-dir", out_dir, *args]) == 0
    (path,) = glob.glob(os.path.join(out_dir, "*.json"))
    with open(path) as f:
        return {"path": path, "run": json.load(f)}


@pytest.fixture(scope="module")
def fixed_run(server, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bench_fixed"))
    return _bench(
        out,
        "--base-url",
        server.url,
        "--concurrency",
        "1,4",
        "--num-prompts",
        str(NUM_PROMPTS),
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--warmup",
        "1",
        "--num-gpus",
        "2",
    )


@pytest.fixture(scope="module")
def chat_run(server, tmp_path_factory):
    """Chat endpoint, random lengths, Poisson arrivals under a concurrency cap, model taken from /v1/models."""
    out = str(tmp_path_factory.mktemp("bench_chat"))
    return _bench(
        out,
        "--base-url",
        f"{server.url}/v1",
        "--endpoint",
        "chat",
        "--concurrency",
        "2",
        "--request-rate",
        "50",
        "--num-prompts",
        "4",
        "--random-input-range",
        "20",
        "40",
        "--random-output-range",
        "2",
        "6",
        "--warmup",
        "0",
        "--label",
        "tiny chat",
    )


def _check_point(point: dict, num_gpus: int) -> None:
    assert set(point) == POINT_KEYS
    assert point["spec_decode"] is None or point["spec_decode"]["acceptance_rate"] is None  # no speculation here
    assert point["num_requests"] == point["completed"] == len(point["requests"])
    assert point["failed"] == 0 and point["errors"] == []
    assert point["output_tokens_source"] == "usage"
    for request in point["requests"]:
        assert set(request) == REQUEST_KEYS
        assert request["error"] is None
        assert 0 < request["ttft_ms"] <= request["e2e_ms"]
        assert all(gap >= 0 for gap in request["itl_ms"])
        assert len(request["itl_ms"]) <= request["output_tokens"] - 1  # one gap per output chunk after the first
        assert request["output_tokens"] == request["output_tokens_from_usage"]
    assert point["total_input_tokens"] == sum(r["prompt_tokens"] for r in point["requests"])
    assert point["total_output_tokens"] == sum(r["output_tokens"] for r in point["requests"])
    assert point["duration_s"] > 0
    assert point["request_throughput"] == pytest.approx(point["completed"] / point["duration_s"])
    assert point["output_throughput"] == pytest.approx(point["total_output_tokens"] / point["duration_s"])
    assert point["output_throughput_per_gpu"] == pytest.approx(point["output_throughput"] / num_gpus)
    assert point["output_throughput_per_user"] == pytest.approx(1000.0 / point["tpot_ms"]["mean"])
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = point[metric]
        assert set(stats) == set(STATS)
        if metric != "itl_ms" or any(r["itl_ms"] for r in point["requests"]):
            assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"]
    assert point["ttft_ms"]["p50"] <= point["e2e_ms"]["p99"]


def test_fixed_lengths_sweep(fixed_run, server):
    run = fixed_run["run"]
    assert set(run) == RUN_KEYS
    assert run["model"] == "tiny" and run["endpoint"] == "completions" and run["base_url"] == server.url
    assert run["server"]["name"] == "brisk" and run["server"]["version"]
    assert run["command"].startswith("brisk bench serve ") and run["machine"]["hostname"]
    assert run["workload"]["kind"] == "fixed" and run["workload"]["prompt_tokenizer"] == "server"
    assert [p["concurrency"] for p in run["points"]] == [1, 4]
    for point in run["points"]:
        _check_point(point, num_gpus=2)
        assert point["request_rate"] is None and point["num_requests"] == NUM_PROMPTS
        # Prompts are cut with the server's own tokenizer and outputs forced by ignore_eos: both exact.
        assert {r["prompt_tokens"] for r in point["requests"]} == {INPUT_LEN}
        assert {r["output_tokens"] for r in point["requests"]} == {OUTPUT_LEN}


def test_chat_random_lengths_with_request_rate(chat_run):
    run = chat_run["run"]
    assert set(run) == RUN_KEYS and run["endpoint"] == "chat" and run["label"] == "tiny chat"
    assert run["workload"]["kind"] == "random" and run["workload"]["random_output_range"] == [2, 6]
    (point,) = run["points"]
    assert point["concurrency"] == 2 and point["request_rate"] == 50
    _check_point(point, num_gpus=1)
    for request in point["requests"]:
        assert 20 <= request["prompt_tokens"] <= 40 and 2 <= request["output_tokens"] <= 6


def test_plots_and_compare(fixed_run, chat_run, tmp_path):
    for run in (fixed_run, chat_run):
        stem = run["path"].removesuffix(".json")
        for kind in ("pareto", "ttft", "itl"):
            with open(f"{stem}_{kind}.png", "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    out = str(tmp_path / "compare")
    assert main(["bench", "serve", "--compare", fixed_run["path"], chat_run["path"], "--out-dir", out]) == 0
    with open(os.path.join(out, "compare_pareto.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and len(f.read()) > 1000


def test_unreachable_server_and_bad_compare_input(tmp_path):
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--out-dir", str(tmp_path)]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "serve", "--compare", str(bad), "--out-dir", str(tmp_path)]) == 2


def test_exact_prompt_lengths_with_a_local_tokenizer(tmp_path):
    make_tiny_tokenizer(tmp_path)
    for endpoint in ("completions", "chat"):
        tokenizer = LocalTokenizer(str(tmp_path), endpoint)
        for target in (20, 64, 300):
            text, count = exact_prompt(tokenizer, random.Random(target), target)
            assert count == target == tokenizer.count(text)


def test_sharegpt_dataset(tmp_path):
    def conversation(question: str, answer: str) -> dict:
        return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}

    data = [
        conversation("what is the capital city of the old river state", "the old river city is the capital"),
        conversation("hi", "too short a question to keep"),  # filtered out, as vLLM does
        {"conversations": [{"from": "human", "value": "no answer"}]},
        "not a conversation",
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    specs = RequestFactory(Workload("sharegpt", dataset=str(path)), WordTokenizer(), seed=0).take(3)
    assert [(s.prompt_tokens, s.max_tokens) for s in specs] == [(10, 7)] * 3  # one usable turn, reused
    specs = RequestFactory(Workload("sharegpt", output_len=5, dataset=str(path)), WordTokenizer(), seed=0).take(1)
    assert specs[0].max_tokens == 5


def test_point_summary_definitions():
    ok = RequestResult(
        prompt_tokens=10, output_tokens=5, output_tokens_from_usage=5, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1] * 4
    )
    no_usage = RequestResult(10, 3, None, 0.2, 0.4, [0.1, 0.1])
    failed = RequestResult(10, 0, None, None, None, [], error="HTTP 500: boom")
    point = summarize_point(
        [ok, no_usage, failed, failed], duration_s=2.0, concurrency=4, request_rate=None, num_gpus=2
    )
    assert (point["completed"], point["failed"], point["errors"]) == (2, 2, ["HTTP 500: boom"])
    assert point["output_tokens_source"] == "mixed"
    assert point["total_output_tokens"] == 8 and point["output_throughput_per_gpu"] == pytest.approx(2.0)
    assert point["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4 and (0.4 - 0.2) / 2
    assert point["output_throughput_per_user"] == pytest.approx(10.0)
    assert pareto_front([(1, 5), (2, 4), (2, 1), (3, 1), (0.5, 5)]) == [(1, 5), (2, 4), (3, 1)]


def test_spec_decode_counters_from_metrics_text():
    from brisk.bench.metrics import spec_decode_counters, spec_decode_summary

    def text(drafts: int, draft_tokens: int, accepted: int) -> str:
        return (
            "# TYPE vllm:spec_decode_num_drafts counter\n"
            f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}\n'
            f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {draft_tokens}\n'
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}\n'
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {accepted}\n'
        )

    assert spec_decode_counters("brisk:num_requests_running 0\n") is None
    summary = spec_decode_summary(spec_decode_counters(text(10, 40, 10)), spec_decode_counters(text(30, 120, 70)))
    assert summary is not None
    assert summary["acceptance_rate"] == 60 / 80 and summary["mean_accepted_length"] == 1 + 60 / 20


def test_the_vllm_recipes_benchmark_command(server, tmp_path):
    """vLLM's gpt-oss recipe's `vllm bench serve` command (run_performance.sh) with `brisk bench serve` in its place,
    at small sizes: --host/--port, --dataset-name random, --random-input-len/--random-output-len,
    --max-concurrency, --save-result --result-filename, and --result-dir."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    command = (
        f"--host {host} --port {port} --model tiny --trust-remote-code --dataset-name random --random-input-len 24 "
        f"--random-output-len 6 --ignore-eos --max-concurrency 2 --num-prompts 4 --save-result --result-filename "
        f"vllm_benchmark_serving_results.json --result-dir {tmp_path}"
    )
    assert main(["bench", "serve", *command.split()]) == 0
    run = json.loads((tmp_path / "vllm_benchmark_serving_results.json").read_text())
    (point,) = run["points"]
    assert point["concurrency"] == 2 and run["endpoint"] == "completions" and run["workload"]["kind"] == "fixed"
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in point["requests"]] == [(24, 6)] * 4
    # --random-range-ratio: lengths uniform around the mean; --backend openai-chat: the chat endpoint
    ranged = f"--random-input-len 30 --random-output-len 6 --random-range-ratio 0.5 --backend openai-chat --max-concurrency 2 --num-prompts 6 --result-dir {tmp_path / 'r'}"
    assert main(["bench", "serve", "--host", host, "--port", port, *ranged.split()]) == 0
    (path,) = glob.glob(str(tmp_path / "r" / "*.json"))
    run = json.loads(Path(path).read_text())
    assert run["endpoint"] == "chat" and run["workload"]["random_output_range"] == [3, 9]
    assert all(3 <= r["output_tokens"] <= 9 for r in run["points"][0]["requests"])
    # a vLLM spelling and brisk's own one that disagree are an error, not a silent choice
    assert main(["bench", "serve", "--port", port, "--base-url", "http://127.0.0.1:1", "--out-dir", str(tmp_path)]) == 2
