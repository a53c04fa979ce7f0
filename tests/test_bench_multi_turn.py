"""`brisk bench serve --multi-turn` against a live `brisk serve` on a tiny Llama: every turn resends the growing
history (the earlier messages and the model's answers), and the report's figures agree with the requests made.

The requests are watched on their way out (the client's `stream_request` wrapped), so the tests see exactly what
each turn sent and what came back. Timings are never asserted, only their consistency.
"""

from __future__ import annotations

import glob
import json
import os

import httpx
import numpy as np
import pytest

from brisk.bench import client
from brisk.bench.client import TURN_SEPARATOR, RequestResult, Target, run_conversations
from brisk.bench.metrics import kv_cache_counters, multi_turn_summary
from brisk.bench.report import format_multi_turn
from brisk.bench.workload import Conversation, RequestSpec
from brisk.cli import main
from tests.server_utils import RunningServer
from tests.tiny_models import make_tiny_llama_with_tokenizer

BLOCK = 16
CONVERSATIONS, TURNS, FIRST_LEN, TURN_LEN, OUTPUT_LEN = 3, 3, 3 * BLOCK + 5, 12, 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_multi_turn")
    make_tiny_llama_with_tokenizer(path)
    srv = RunningServer(str(path), "--served-model-name", "tiny", "--max_batch_size", "8", "--block-size", str(BLOCK))
    yield srv
    srv.stop()


def _run(server, out_dir: str, monkeypatch, endpoint: str) -> tuple[dict, list[tuple[dict, RequestResult]]]:
    """One multi-turn run; returns its JSON and every request sent (its body) with what came back."""
    sent: list[tuple[dict, RequestResult]] = []
    original = client.stream_request

    async def watched(http, target, spec):
        result = await original(http, target, spec)
        sent.append((target.payload(spec), result))
        return result

    monkeypatch.setattr(client, "stream_request", watched)
    args = ["--base-url", server.url, "--endpoint", endpoint, "--multi-turn", str(TURNS)]
    args += ["--num-conversations", str(CONVERSATIONS), "--concurrency", "2", "--warmup", "0"]
    args += ["--input-len", str(FIRST_LEN), "--turn-input-len", str(TURN_LEN), "--output-len", str(OUTPUT_LEN)]
    assert main(["bench", "serve", "--out-dir", out_dir, *args]) == 0
    (path,) = glob.glob(os.path.join(out_dir, "*.json"))
    with open(path) as f:
        return json.load(f), sent


def _by_conversation(sent: list[tuple[dict, RequestResult]]) -> dict[int, list[tuple[dict, RequestResult]]]:
    out: dict[int, list[tuple[dict, RequestResult]]] = {}
    for body, result in sorted(sent, key=lambda item: (item[1].conversation, item[1].turn)):
        out.setdefault(result.conversation, []).append((body, result))
    return out


def _check_report(run: dict, sent: list[tuple[dict, RequestResult]]) -> None:
    """The point's figures are those of the requests made, and the server's counters moved by as much."""
    (point,) = run["points"]
    assert run["workload"]["kind"] == "multi-turn" and run["workload"]["turns"] == TURNS
    assert point["completed"] == point["num_requests"] == CONVERSATIONS * TURNS == len(sent)
    records = point["requests"]
    assert sorted((r["conversation"], r["turn"]) for r in records) == [
        (c, t) for c in range(CONVERSATIONS) for t in range(TURNS)
    ]
    summary = point["multi_turn"]
    assert (summary["conversations"], summary["turns"]) == (CONVERSATIONS, TURNS)
    assert summary["prompt_tokens"] == sum(r["prompt_tokens"] for r in records) == point["total_input_tokens"]
    assert summary["cached_tokens"] == sum(r["cached_tokens"] for r in records)
    assert summary["computed_tokens"] == summary["prompt_tokens"] - summary["cached_tokens"]
    assert summary["mean_ttft_ms"] == pytest.approx(np.mean([r["ttft_ms"] for r in records]))
    for t, row in enumerate(summary["by_turn"]):
        of_turn = [r for r in records if r["turn"] == t]
        assert row["turn"] == t and row["requests"] == row["completed"] == CONVERSATIONS
        assert row["mean_prompt_tokens"] == pytest.approx(np.mean([r["prompt_tokens"] for r in of_turn]))
        assert row["mean_cached_tokens"] == pytest.approx(np.mean([r["cached_tokens"] for r in of_turn]))
        assert row["ttft_ms"]["mean"] == pytest.approx(np.mean([r["ttft_ms"] for r in of_turn]))
    # turns after the first find their history in the prefix cache (the pool is large: nothing is evicted)
    assert summary["by_turn"][0]["mean_cached_tokens"] == 0
    assert all(row["mean_cached_tokens"] >= BLOCK for row in summary["by_turn"][1:])
    # brisk's /metrics, read before and after: every prompt token was counted, each request looked up once
    counters = summary["server_counters"]
    assert counters["prompt_tokens"] == summary["prompt_tokens"]
    assert counters["prefix_cache_queries"] == summary["prompt_tokens"]
    assert counters["prefix_cache_hits"] == summary["cached_tokens"]
    assert counters["external_prefix_cache_hits"] == 0  # no host KV tier on this server
    text = format_multi_turn(summary)
    assert (
        f"{CONVERSATIONS} conversations x {TURNS} turns" in text and f"computed {summary['computed_tokens']:,}" in text
    )


def test_completions_turns_resend_the_transcript(server, tmp_path, monkeypatch):
    run, sent = _run(server, str(tmp_path), monkeypatch, "completions")
    _check_report(run, sent)
    for turns in _by_conversation(sent).values():
        assert [r.turn for _, r in turns] == list(range(TURNS))
        for (before, answered), (after, result) in zip(turns, turns[1:]):
            assert answered.text  # the model's answer, resent in the next turn
            assert after["prompt"].startswith(before["prompt"] + answered.text + TURN_SEPARATOR)
            assert len(after["prompt"]) > len(before["prompt"] + answered.text + TURN_SEPARATOR)  # a new message
            # the history grows by the answer and the new message (a byte-level BPE may merge one token at a seam)
            assert result.prompt_tokens >= answered.prompt_tokens + answered.output_tokens + TURN_LEN - 2
            # the server counted what was sent: /tokenize of the exact text agrees with the response's usage
            count = httpx.post(f"{server.url}/tokenize", json={"prompt": after["prompt"]}).json()["count"]
            assert count == result.prompt_tokens
            # the previous turn's prompt blocks (all but a seam block) came from the prefix cache
            assert result.cached_tokens >= (answered.prompt_tokens // BLOCK - 1) * BLOCK


def test_chat_turns_resend_the_messages(server, tmp_path, monkeypatch):
    run, sent = _run(server, str(tmp_path), monkeypatch, "chat")
    _check_report(run, sent)
    for turns in _by_conversation(sent).values():
        first = turns[0][0]["messages"]
        assert [m["role"] for m in first] == ["user"]
        for (before, answered), (after, result) in zip(turns, turns[1:]):
            # the earlier messages, the model's answer as the assistant's, then a new user message
            assert after["messages"][:-2] == before["messages"]
            assert after["messages"][-2] == {"role": "assistant", "content": answered.text}
            assert after["messages"][-1]["role"] == "user" and after["messages"][-1]["content"]
            assert answered.text and result.prompt_tokens > answered.prompt_tokens + TURN_LEN - 2


def test_multi_turn_summary_and_counters_from_records():
    def result(conversation: int, turn: int, prompt: int, cached: int | None, ttft: float) -> RequestResult:
        return RequestResult(prompt, 4, 4, ttft, ttft + 0.1, [0.02] * 3, None, cached, "x", conversation, turn)

    results = [result(0, 0, 100, 0, 0.5), result(0, 1, 140, 96, 0.2), result(1, 0, 100, 0, 0.7)]
    results.append(RequestResult(160, 0, None, None, None, [], "HTTP 500: boom", None, "", 1, 1))
    summary = multi_turn_summary(results, {"prompt_tokens": 340.0})
    assert (summary["conversations"], summary["turns"]) == (2, 2)
    assert (summary["prompt_tokens"], summary["cached_tokens"], summary["computed_tokens"]) == (340, 96, 244)
    assert summary["mean_ttft_ms"] == pytest.approx(1000 * (0.5 + 0.2 + 0.7) / 3)
    second = summary["by_turn"][1]
    assert (second["requests"], second["completed"], second["mean_cached_tokens"]) == (2, 1, 96)
    # a server that does not report cached tokens: no computed/cached split is claimed
    assert multi_turn_summary([result(0, 0, 100, None, 0.5)], None)["computed_tokens"] is None
    metrics_text = "\n".join(
        [
            "# HELP brisk:prefix_cache_hits_total Prompt tokens found in the prefix cache",
            'brisk:prefix_cache_hits_total{model_name="m"} 96.0',
            'brisk:kv_offload_bytes_total{direction="to_host",model_name="m"} 4096.0',
            'brisk:kv_offload_bytes_total{direction="to_device",model_name="m"} 2048.0',
            'vllm:prompt_tokens_total{model_name="m"} 340.0',
            'brisk:request_prompt_tokens_bucket{le="+Inf",model_name="m"} 3.0',
        ]
    )
    assert kv_cache_counters(metrics_text) == {
        "prefix_cache_hits": 96.0,
        "kv_offload_bytes_to_host": 4096.0,
        "kv_offload_bytes_to_device": 2048.0,
        "prompt_tokens": 340.0,
    }


@pytest.mark.parametrize(
    "args, message",
    [
        (["--multi-turn", "0"], "--multi-turn must be >= 1"),
        (["--multi-turn", "2", "--random-input-range", "1", "4"], "--multi-turn takes fixed lengths"),
        (["--turn-input-len", "8"], "need --multi-turn"),
    ],
)
def test_bad_multi_turn_arguments(args, message, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_failed_turn_ends_its_conversation(server):
    target = Target(server.url, "completions", "tiny")
    ok = RequestSpec("the quick brown fox", 4, 3)
    refused = RequestSpec("jumps over", 2, 0)  # max_tokens 0: the server answers 400
    conversations = [Conversation(0, (ok, refused, ok)), Conversation(1, (ok, ok))]
    results, _ = run_conversations(target, conversations, concurrency=1, request_rate=None)
    assert [(r.conversation, r.turn) for r in results] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    first, failed, skipped, *other = results
    assert first.error is None and first.text and failed.error.startswith("HTTP 400")
    assert skipped.error == "not sent: turn 1 of the conversation failed" and skipped.ttft_s is None
    assert all(r.error is None for r in other)  # the other conversation is not affected
