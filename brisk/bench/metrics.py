"""From request results to one benchmark point: throughputs and latency distributions, vLLM's definitions.

TTFT: request sent to first output chunk. E2E: request sent to end of stream. TPOT per request: the decode time
over the tokens after the first, (E2E - TTFT) / (output_tokens - 1). ITL: gaps between output chunks.
Output tok/s per user: 1 / mean TPOT, the decode speed one user sees.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from brisk.bench.client import RequestResult

STATS = ("mean", "p50", "p90", "p99")
ERRORS_KEPT = 5  # distinct error messages recorded per point


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds; None everywhere when there is nothing to measure."""
    if not values_s:
        return {stat: None for stat in STATS}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {
        "mean": float(ms.mean()),
        "p50": float(np.percentile(ms, 50)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def tpot_s(result: RequestResult) -> float | None:
    if result.error is not None or result.output_tokens < 2:
        return None  # a single token has no decode time
    if result.ttft_s is None or result.e2e_s is None:
        return None  # only failed requests (handled above) lack timings
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def request_record(result: RequestResult) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
        "output_tokens_from_usage": result.output_tokens_from_usage,
        "ttft_ms": _ms(result.ttft_s),
        "e2e_ms": _ms(result.e2e_s),
        "itl_ms": [round(s * 1000.0, 4) for s in result.itl_s],
        "error": result.error,
        "cached_tokens": result.cached_tokens,
        "conversation": result.conversation,
        "turn": result.turn,
    }


def summarize_point(
    results: list[RequestResult], duration_s: float, concurrency: int | None, request_rate: float | None, num_gpus: int
) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    errors: list[str] = []
    for r in results:
        if r.error is not None and r.error not in errors and len(errors) < ERRORS_KEPT:
            errors.append(r.error)
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    with_usage = sum(r.output_tokens_from_usage is not None for r in ok)
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    tpot = distribution_ms(tpots)
    output_throughput = output_tokens / duration_s if duration_s > 0 else 0.0
    return {
        "concurrency": concurrency,
        "request_rate": request_rate,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "output_tokens_source": "usage" if with_usage == len(ok) else "chunks" if with_usage == 0 else "mixed",
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_throughput,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s > 0 else 0.0,
        "output_throughput_per_gpu": output_throughput / num_gpus,
        "output_throughput_per_user": 1000.0 / tpot["mean"] if tpot["mean"] else None,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": tpot,
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "requests": [request_record(r) for r in results],
    }


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
# The server's prompt and KV-cache counters a multi-turn run reads before and after (brisk's and vLLM's names, the
# `brisk:` / `vllm:` prefix and `_total` suffix dropped): prompt tokens, prefix-cache lookups and hits (tokens),
# those of the host KV tier (vLLM: external, the offloading connector), the bytes it moved each way, preemptions.
KV_COUNTERS = (
    "prompt_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
    "kv_offload_bytes_to_host",
    "kv_offload_bytes_to_device",
    "num_preemptions",
)


def _counters(metrics_text: str, names: tuple[str, ...], strip: str = "") -> dict[str, float]:
    """Counters of the Prometheus text summed over their labels; a `direction` label is kept in the name."""
    totals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sample, _, value = line.rpartition(" ")
        name, _, labels = sample.partition("{")
        base = name.split(":", 1)[-1].removesuffix("_total").removeprefix(strip)
        direction = next(
            (p.split("=", 1)[1].strip('"') for p in labels.rstrip("}").split(",") if p.startswith("direction=")), None
        )
        if direction:
            base = f"{base}_{direction}"
        if base in names:
            totals[base] = totals.get(base, 0.0) + float(value)
    return totals


def spec_decode_counters(metrics_text: str) -> dict[str, float] | None:
    """The server's speculative-decoding counters from its /metrics text (brisk's or vLLM's names; summed over
    labels), or None when it has none."""
    return _counters(metrics_text, SPEC_COUNTERS, strip="spec_decode_") or None


def kv_cache_counters(metrics_text: str) -> dict[str, float]:
    """The KV_COUNTERS the server exposes (an empty dict: none)."""
    return _counters(metrics_text, KV_COUNTERS)


def counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """after - before of each counter (one not there before had not been touched yet: 0); None: no /metrics."""
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0.0) for k in after}


def multi_turn_summary(results: list[RequestResult], server: dict[str, float] | None) -> dict[str, Any]:
    """Per turn index: requests, mean prompt / cached tokens, TTFT; over the run: prompt tokens the server computed
    (prompt - cached, from each request's usage) and served from its prefix cache; `server`: its counters' deltas."""
    ok = [r for r in results if r.error is None]
    cached_known = all(r.cached_tokens is not None for r in ok)
    by_turn = []
    for turn in sorted({r.turn for r in results if r.turn is not None}):
        done = [r for r in ok if r.turn == turn]
        by_turn.append(
            {
                "turn": turn,
                "requests": sum(r.turn == turn for r in results),
                "completed": len(done),
                "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in done])) if done else None,
                "mean_cached_tokens": (
                    float(np.mean([r.cached_tokens or 0 for r in done])) if done and cached_known else None
                ),
                "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
            }
        )
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok) if cached_known else None
    return {
        "turns": len(by_turn),
        "conversations": len({r.conversation for r in results}),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": None if cached is None else prompt - cached,
        "mean_ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None])["mean"],
        "by_turn": by_turn,
        "server_counters": server,
    }


def spec_decode_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """Acceptance over one benchmark point: accepted / draft tokens, and the mean accepted length per draft
    (accepted + 1: the target's own token comes with every verification)."""
    if before is None or after is None:
        return None
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    if delta["num_drafts"] <= 0:
        return {**delta, "acceptance_rate": None, "mean_accepted_length": None}  # type: ignore[dict-item]
    return {
        **delta,
        "acceptance_rate": delta["num_accepted_tokens"] / max(1.0, delta["num_draft_tokens"]),
        "mean_accepted_length": 1.0 + delta["num_accepted_tokens"] / delta["num_drafts"],
    }
