"""ServerMetrics: per-request phases from RequestTiming, engine totals as counters, engine up/down, cache config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from brisk.engine.messages import EngineInfo, SchedulerStats
from brisk.server.metrics import REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS, RequestTiming, ServerMetrics

M = {"model_name": "m"}


def _timing(**overrides) -> RequestTiming:
    timing = RequestTiming("r", num_prompt_tokens=7, max_tokens=16, n=1, arrival=100.0)
    timing.scheduled = 100.25
    timing.token_times = [101.0, 101.5, 102.0, 103.0]
    timing.num_generated = 4
    timing.finish_reasons = ["length"]
    timing.completed = True
    timing.end = 103.5
    for key, value in overrides.items():
        setattr(timing, key, value)
    return timing


def test_request_phases_add_up() -> None:
    t = _timing()
    assert (t.queue_time, t.prefill_time, t.ttft) == (0.25, 0.75, 1.0)
    assert t.queue_time + t.prefill_time == t.ttft
    assert (t.decode_time, t.inference_time, t.e2e) == (2.0, 2.75, 3.5)
    assert t.time_per_output_token == pytest.approx(2.0 / 3)
    never_scheduled = _timing(scheduled=0.0, token_times=[], num_generated=0, completed=False)
    assert never_scheduled.queue_time is None and never_scheduled.ttft is None and never_scheduled.prefill_time is None


def test_observe_request_fills_every_histogram() -> None:
    metrics = ServerMetrics("m")
    seen = []
    metrics.request_listeners.append(seen.append)
    metrics.observe_request(_timing())
    get = metrics.registry.get_sample_value
    for name, total in [
        ("brisk:time_to_first_token_seconds", 1.0),
        ("brisk:request_queue_time_seconds", 0.25),
        ("brisk:request_prefill_time_seconds", 0.75),
        ("brisk:request_decode_time_seconds", 2.0),
        ("brisk:request_inference_time_seconds", 2.75),
        ("brisk:e2e_request_latency_seconds", 3.5),
        ("brisk:inter_token_latency_seconds", 2.0),
        ("brisk:request_prompt_tokens", 7),
        ("brisk:request_generation_tokens", 4),
        ("brisk:request_params_max_tokens", 16),
        ("brisk:request_params_n", 1),
    ]:
        assert get(f"{name}_sum", M) == pytest.approx(total), name
    assert get("brisk:inter_token_latency_seconds_count", M) == 3
    assert get("brisk:request_success_total", {**M, "finished_reason": "length"}) == 1
    assert seen and seen[0].request_id == "r"


def test_a_request_cut_short_counts_as_abort_without_whole_request_histograms() -> None:
    metrics = ServerMetrics("m")
    metrics.observe_request(_timing(completed=False, finish_reasons=[None]))
    get = metrics.registry.get_sample_value
    assert get("brisk:request_success_total", {**M, "finished_reason": "abort"}) == 1
    assert get("brisk:time_to_first_token_seconds_count", M) == 1
    assert get("brisk:e2e_request_latency_seconds_count", M) is None  # only completed requests


def test_engine_totals_become_counters_and_ranks_their_own_series() -> None:
    metrics = ServerMetrics("m")
    get = metrics.registry.get_sample_value
    metrics.observe_engine(SchedulerStats(1, 2, 0.5, 100, 40, 3, (0.25, 0.75)))
    metrics.observe_engine(SchedulerStats(1, 2, 0.5, 150, 60, 5, (0.5, 0.5)))
    assert get("brisk:prefix_cache_queries_total", M) == 150
    assert get("brisk:prefix_cache_hits_total", M) == 60
    assert get("brisk:num_preemptions_total", M) == 5
    assert get("brisk:kv_cache_usage_perc_by_dp_rank", {**M, "dp_rank": "1"}) == 0.5
    assert get("brisk:num_requests_waiting", M) == 2


def test_bind_engine_reports_up_down_cache_config_and_iterations() -> None:
    client = SimpleNamespace(
        dead=False, info=EngineInfo("LlamaForCausalLM", 100, 256, 64, [16]), stats_listeners=[], in_flight_listeners=[]
    )
    config = SimpleNamespace(enable_prefix_caching=True, dtype="auto")
    metrics = ServerMetrics("m")
    metrics.bind_engine(client, config)
    get = metrics.registry.get_sample_value
    assert get("brisk:engine_up", M) == 1
    client.dead = True
    assert get("brisk:engine_up", M) == 0
    labels = {**M, "block_size": "16", "num_gpu_blocks": "64", "enable_prefix_caching": "true"}
    assert get("brisk:cache_config_info", {**labels, "num_kv_groups": "1", "dtype": "auto"}) == 1
    client.stats_listeners[0](SchedulerStats(iteration_tokens=(5, 300)))
    assert get("brisk:iteration_tokens_total_count", M) == 2
    assert get("brisk:iteration_tokens_total_sum", M) == 305


def test_buckets_cover_cpu_and_gpu_latencies() -> None:
    assert REQUEST_LATENCY_BUCKETS[0] <= 0.01 and REQUEST_LATENCY_BUCKETS[-1] >= 300  # ms on a GPU, minutes on a CPU
    assert TOKEN_LATENCY_BUCKETS[0] <= 0.001 and TOKEN_LATENCY_BUCKETS[-1] >= 5
    assert list(REQUEST_LATENCY_BUCKETS) == sorted(set(REQUEST_LATENCY_BUCKETS))
