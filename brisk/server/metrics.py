"""Prometheus metrics with vLLM's names, in a registry owned by the app (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("brisk:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("brisk:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("brisk:kv_cache_usage_perc", "Fraction of KV blocks in use", labels, registry=r)
        self.prefix_queries = Gauge(
            "brisk:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r
        )
        self.prefix_hits = Gauge(
            "brisk:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r
        )
        self.preemptions = Gauge("brisk:num_preemptions", "Requests preempted (recomputed) so far", labels, registry=r)
        self.prompt_tokens = Counter("brisk:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("brisk:generation_tokens", "Tokens generated", labels, registry=r)
        self.request_success = Counter(
            "brisk:request_success", "Finished requests", labels + ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "brisk:time_to_first_token_seconds", "Time to first token", labels, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "brisk:inter_token_latency_seconds", "Time between tokens", labels, buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "brisk:e2e_request_latency_seconds", "Request latency", labels, buckets=LATENCY_BUCKETS, registry=r
        )
        self.in_flight = Gauge("brisk:num_requests_in_flight", "Requests the API server is serving", labels, registry=r)
        self.coalesced = Gauge(
            "brisk:stream_deltas_coalesced",
            "Deltas merged because a client read its stream too slowly (monotonic)",
            labels,
            registry=r,
        )
        self.model_name = model_name

    def observe_engine(self, stats) -> None:
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_usage)
        self.prefix_queries.labels(m).set(stats.prefix_queries)
        self.prefix_hits.labels(m).set(stats.prefix_hits)
        self.preemptions.labels(m).set(stats.num_preemptions)

    def observe_client(self, num_in_flight: int, num_coalesced_deltas: int) -> None:
        self.in_flight.labels(self.model_name).set(num_in_flight)
        self.coalesced.labels(self.model_name).set(num_coalesced_deltas)

    def observe_request(
        self,
        num_prompt: int,
        num_generated: int,
        finish_reasons: list[str | None],
        ttft: float | None,
        token_times: list[float],
        e2e: float,
    ) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(num_prompt)
        self.generation_tokens.labels(m).inc(num_generated)
        for reason in finish_reasons:
            self.request_success.labels(m, reason or "abort").inc()
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        for a, b in zip(token_times, token_times[1:]):
            self.itl.labels(m).observe(b - a)
        self.e2e.labels(m).observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def exported_names(self) -> set[str]:
        """Every sample name /metrics can show (a histogram's _bucket/_sum/_count, a counter's _total, ...),
        labelled or not yet observed included: what dashboards, rules and autoscalers may reference."""
        suffixes = {
            "counter": ("_total", "_created"),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",),
            "info": ("_info",),
        }
        return {family.name + s for family in self.registry.collect() for s in suffixes[family.type]}
