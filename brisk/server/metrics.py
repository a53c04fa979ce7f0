"""Prometheus metrics with vLLM's names under the `brisk:` prefix, in a registry owned by the app (no global state).

With several API-server processes (--api-server-count) each records into prometheus-client's multiprocess files
(`use_multiprocess_metrics`, in a folder of the server's private IPC directory) and a scrape of any of them reads
all: requests, tokens and latencies are summed over the processes, in-flight requests too; the engine's side
(scheduler gauges, prefix-cache and speculation counters, step sizes) is recorded by API-server process 0 alone,
which gets the engine's stats with every message.

docs/observability.md maps each metric to its vLLM name. Per-request timings come from `RequestTiming`: the API
server's clock for arrival, tokens and the end, the engine's for the step that first scheduled the request
(both `time.time()` on one machine).
"""

from __future__ import annotations

import bisect
import contextvars
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector

from brisk.engine.messages import shown_block_sizes

if TYPE_CHECKING:
    from brisk.config import EngineConfig
    from brisk.engine.client import AsyncEngineClient
    from brisk.engine.messages import SchedulerStats
    from brisk.engine.output_processor import CompletionDelta

# Whole-request phases (TTFT, queue, prefill, decode, E2E): from a millisecond on a GPU or a tiny CPU model to
# minutes for a long prompt on a CPU.
REQUEST_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# Per-token latencies (ITL, time per output token): ~1 ms a token on a GPU to seconds on a CPU under load.
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = tuple(float(2**i) for i in range(18))  # 1 .. 131072 tokens
N_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


@dataclass
class RequestTiming:
    """One request's life as the API server saw it; `ServerState.generate` fills it, the metrics, the trace and
    the request log read it. Times are `time.time()` seconds."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int | None
    n: int = 1
    arrival: float = field(default_factory=time.time)
    scheduled: float = 0.0  # the engine's first step for it (0: never scheduled)
    token_times: list[float] = field(default_factory=list)  # when each delta carrying tokens arrived
    num_generated: int = 0
    num_cached_tokens: int = 0
    finish_reasons: list[str | None] = field(default_factory=list)
    completed: bool = False  # every completion finished (else: the client left or an error cut it short)
    end: float = 0.0
    # The context the request started in (its HTTP span, when tracing): traces hang the request's spans there.
    context: contextvars.Context | None = field(default_factory=contextvars.copy_context, repr=False)

    def on_delta(self, delta: CompletionDelta) -> None:
        if delta.token_ids:
            now = time.time()
            if delta.num_steps > 1 and self.token_times:
                # The tokens of several engine steps in one delta (held for stream_interval, or by a slow reader):
                # their steps' arrivals are spread evenly since the last one, so inter-token latencies stay per step.
                last = self.token_times[-1]
                gap = (now - last) / delta.num_steps
                self.token_times += [last + gap * i for i in range(1, delta.num_steps)]
            self.token_times.append(now)
            self.num_generated += len(delta.token_ids)
        self.scheduled = delta.output.scheduled_time or self.scheduled
        self.num_cached_tokens = delta.output.num_cached_tokens

    def finish(self, last: CompletionDelta | None) -> None:
        self.end = time.time()
        if last is not None:
            self.finish_reasons = [o.finish_reason for o in last.output.outputs]
            self.completed = last.output.finished

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def last_token(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_time(self) -> float | None:
        return self.scheduled - self.arrival if self.scheduled else None

    @property
    def prefill_time(self) -> float | None:
        return self.first_token - self.scheduled if self.scheduled and self.first_token is not None else None

    @property
    def decode_time(self) -> float | None:
        return None if self.first_token is None or self.last_token is None else self.last_token - self.first_token

    @property
    def inference_time(self) -> float | None:
        return self.last_token - self.scheduled if self.scheduled and self.last_token is not None else None

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between a completion's tokens after its first (vLLM's request_time_per_output_token)."""
        per_completion = self.num_generated / max(1, self.n)
        decode = self.decode_time
        return decode / (per_completion - 1) if decode is not None and per_completion > 1 else None

    @property
    def e2e(self) -> float:
        return self.end - self.arrival


def observe_all(histogram: Any, values: list[float]) -> None:
    """`histogram.observe(v)` for each value (a labelled Histogram), with each bucket advanced once by its count
    rather than once a value: a request's inter-token latencies are a value per token. Falls back to observe()
    on a prometheus-client whose histograms are laid out otherwise."""
    bounds, buckets, total = (getattr(histogram, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1  # the first bucket whose upper bound is >= value
    for bucket, count in zip(buckets, counts):
        if count:
            bucket.inc(count)
    total.inc(sum(values))


def use_multiprocess_metrics(folder: str) -> None:
    """Record this process's metrics into prometheus-client's multiprocess files under `folder` (an API-server
    process of several, before it creates any metric). The library picks its value store by this variable."""
    os.makedirs(folder, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    values.ValueClass = values.get_value_class()


class ServerMetrics:
    def __init__(self, model_name: str, multiprocess_dir: str | None = None, observes_engine: bool = True) -> None:
        """`multiprocess_dir`: the files of every API-server process (see use_multiprocess_metrics), read at each
        scrape; `observes_engine`: this process records the engine's stats (one process of several does)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.multiprocess_dir = multiprocess_dir
        self.observes_engine = observes_engine
        self._client: AsyncEngineClient | None = None
        labels = ["model_name"]
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        # ---- engine state, sampled at each scrape -----------------------------------------------
        def engine_gauge(name: str, doc: str, extra_labels: tuple[str, ...] = ()) -> Gauge:
            # Set by one process of several (the most recent value is its value); the others never write them.
            return Gauge(name, doc, labels + list(extra_labels), registry=r, multiprocess_mode="mostrecent")

        self.running = engine_gauge("brisk:num_requests_running", "Requests in the running batch")
        self.waiting = engine_gauge("brisk:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = engine_gauge("brisk:kv_cache_usage_perc", "Fraction of KV blocks in use (mean over DP ranks)")
        self.kv_usage_by_rank = engine_gauge(
            "brisk:kv_cache_usage_perc_by_dp_rank",
            "Fraction of KV blocks in use, per attention-DP rank (each has its own pool)",
            ("dp_rank",),
        )
        self.prefix_queries = Counter(
            "brisk:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r
        )
        self.prefix_hits = Counter(
            "brisk:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r
        )
        self.preemptions = Counter("brisk:num_preemptions", "Requests preempted (recomputed)", labels, registry=r)
        # The host KV tier (kv_cache_config.host_cache_size): vLLM's names for prefix hits served from outside the
        # device pool, the bytes copied each way, and its usage.
        self.host_queries = Counter(
            "brisk:external_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache with the host KV tier on",
            labels,
            registry=r,
        )
        self.host_hits = Counter(
            "brisk:external_prefix_cache_hits",
            "Prompt tokens whose KV the host KV tier gave back (copied to the device, not recomputed)",
            labels,
            registry=r,
        )
        self.host_bytes = Counter(
            "brisk:kv_offload_bytes",
            "Bytes of KV blocks copied between the device pool and the host KV tier",
            labels + ["direction"],
            registry=r,
        )
        self.host_usage = Gauge(
            "brisk:kv_host_cache_usage_perc",
            "Fraction of the host KV tier's blocks holding content",
            labels,
            registry=r,
        )
        self.engine_up = Gauge(
            "brisk:engine_up",
            "1 while the engine-core process runs, 0 once it died",
            labels,
            registry=r,
            multiprocess_mode="min",  # any process that saw it die says so
        )
        self.cache_config = engine_gauge(
            "brisk:cache_config_info",
            "KV cache configuration (value 1; the labels carry it)",
            ("block_size", "num_gpu_blocks", "enable_prefix_caching", "num_kv_groups", "dtype"),
        )
        # Speculative decoding (vLLM's names): acceptance rate = accepted / draft tokens; mean accepted length =
        # 1 + accepted / drafts; per position, how often the draft token at that position was accepted.
        self.spec_drafts = Counter("brisk:spec_decode_num_drafts", "Draft runs verified", labels, registry=r)
        self.spec_draft_tokens = Counter(
            "brisk:spec_decode_num_draft_tokens", "Draft tokens verified", labels, registry=r
        )
        self.spec_accepted_tokens = Counter(
            "brisk:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "brisk:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft",
            labels + ["position"],
            registry=r,
        )
        self.iteration_tokens = histogram(
            "brisk:iteration_tokens_total", "Tokens scheduled in one engine step", TOKEN_COUNT_BUCKETS
        )
        # ---- per request -----------------------------------------------------------------------
        self.prompt_tokens = Counter("brisk:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("brisk:generation_tokens", "Tokens generated", labels, registry=r)
        self.request_success = Counter(
            "brisk:request_success", "Finished requests", labels + ["finished_reason"], registry=r
        )
        self.ttft = histogram("brisk:time_to_first_token_seconds", "Time to first token", REQUEST_LATENCY_BUCKETS)
        self.itl = histogram("brisk:inter_token_latency_seconds", "Time between tokens", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram(
            "brisk:request_time_per_output_token_seconds",
            "A request's mean time per output token after the first",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram("brisk:e2e_request_latency_seconds", "Request latency", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(
            "brisk:request_queue_time_seconds", "Arrival to first scheduled step", REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "brisk:request_prefill_time_seconds", "First scheduled step to first token", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "brisk:request_decode_time_seconds", "First token to last token", REQUEST_LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "brisk:request_inference_time_seconds", "First scheduled step to last token", REQUEST_LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "brisk:request_prompt_tokens", "Prompt length of finished requests", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "brisk:request_generation_tokens", "Tokens generated by finished requests", TOKEN_COUNT_BUCKETS
        )
        self.request_max_tokens = histogram(
            "brisk:request_params_max_tokens", "The max_tokens of finished requests", TOKEN_COUNT_BUCKETS
        )
        self.request_n = histogram("brisk:request_params_n", "The n of finished requests", N_BUCKETS)
        # ---- the API server ----------------------------------------------------------------------
        self.in_flight = Gauge(
            "brisk:num_requests_in_flight",
            "Requests the API server processes are serving",
            labels,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.coalesced = Gauge(
            "brisk:stream_deltas_coalesced",
            "Deltas merged because a client read its stream too slowly (monotonic)",
            labels,
            registry=r,
            multiprocess_mode="sum",
        )
        self.http_requests = Counter(
            "brisk:http_requests",
            "HTTP responses by route and status code (errors included)",
            ["method", "path", "status"],
            registry=r,
        )
        # the engine's running totals as last seen, by counter child (the key of _children)
        self._last_totals: dict[tuple[int, tuple[str, ...]], int] = {}
        # Called with each finished request's timing (traces, the JSON request log).
        self.request_listeners: list[Callable[[RequestTiming], None]] = []
        # (id(metric), further labels) -> its child labelled with this model's name and those
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _labelled(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(model_name, *labels)`, looked up once (labels() costs a lock and a validation each call)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.model_name, *labels)
        return child

    def bind_engine(self, client: AsyncEngineClient, config: EngineConfig) -> None:
        """Engine up/down, cache configuration, per-step stats and in-flight requests of a started engine client."""
        m = self.model_name
        self._client = client
        if self.multiprocess_dir is None:
            self.engine_up.labels(m).set_function(lambda: 0.0 if client.dead else 1.0)
        else:  # the files hold values, not functions: set at each scrape (render)
            self.engine_up.labels(m).set(0.0 if client.dead else 1.0)
        client.in_flight_listeners.append(self.observe_client)
        info = client.info
        if not self.observes_engine:
            return
        if info is not None:
            self.cache_config.labels(
                m,
                shown_block_sizes(info.block_sizes),
                str(info.num_kv_blocks),
                str(config.enable_prefix_caching).lower(),
                str(info.num_kv_groups),
                config.dtype,
            ).set(1)
        for counter in (
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.spec_drafts,
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
            self.host_queries,
            self.host_hits,
        ):
            self._labelled(counter)  # shown at 0 from the start, as before the first step moves them
        for direction in ("to_host", "to_device"):
            self._labelled(self.host_bytes, direction)
        client.stats_listeners.append(self.observe_engine)

    def observe_engine(self, stats: SchedulerStats) -> None:
        """The engine's stats, as each of its messages brings them (one a step: children looked up once, counters
        touched only when they moved)."""
        for num_tokens in stats.iteration_tokens:
            self._labelled(self.iteration_tokens).observe(num_tokens)
        self._labelled(self.running).set(stats.num_running)
        self._labelled(self.waiting).set(stats.num_waiting)
        self._labelled(self.kv_usage).set(stats.kv_usage)
        for rank, usage in enumerate(stats.kv_usage_per_dp_rank):
            self._labelled(self.kv_usage_by_rank, str(rank)).set(usage)
        self._labelled(self.host_usage).set(stats.host_usage)
        # The engine reports running totals; the counters advance by what is new since the last message.
        for total, counter, labels in (
            (stats.prefix_queries, self.prefix_queries, ()),
            (stats.prefix_hits, self.prefix_hits, ()),
            (stats.num_preemptions, self.preemptions, ()),
            (stats.spec_num_drafts, self.spec_drafts, ()),
            (stats.spec_num_draft_tokens, self.spec_draft_tokens, ()),
            (stats.spec_num_accepted_tokens, self.spec_accepted_tokens, ()),
            (stats.host_queries, self.host_queries, ()),
            (stats.host_hits, self.host_hits, ()),
            (stats.host_bytes_to_host, self.host_bytes, ("to_host",)),
            (stats.host_bytes_to_device, self.host_bytes, ("to_device",)),
        ):
            self._advance(total, counter, *labels)
        for pos, total in enumerate(stats.spec_accepted_per_pos):
            self._advance(total, self.spec_accepted_per_pos, str(pos))

    def _advance(self, total: int, counter: Any, *labels: str) -> None:
        """Advance the counter's child to the engine's running `total` (never back)."""
        key = (id(counter), labels)
        last = self._last_totals.get(key, 0)
        if total > last:
            self._labelled(counter, *labels).inc(total - last)
            self._last_totals[key] = total

    def observe_client(self, num_in_flight: int, num_coalesced_deltas: int) -> None:
        self.in_flight.labels(self.model_name).set(num_in_flight)
        self.coalesced.labels(self.model_name).set(num_coalesced_deltas)

    def observe_request(self, timing: RequestTiming) -> None:
        """Count a request that ended (completed, aborted, or failed) and hand it to the listeners."""
        m = self.model_name
        self._labelled(self.prompt_tokens).inc(timing.num_prompt_tokens)
        self._labelled(self.generation_tokens).inc(timing.num_generated)
        observe_all(self._labelled(self.itl), [b - a for a, b in zip(timing.token_times, timing.token_times[1:])])
        for histogram, value in (
            (self.ttft, timing.ttft),
            (self.queue_time, timing.queue_time),
            (self.prefill_time, timing.prefill_time),
        ):
            if value is not None:
                self._labelled(histogram).observe(value)
        for reason in timing.finish_reasons if timing.completed else ["abort"]:  # the client left, or it failed
            self.request_success.labels(m, reason or "abort").inc()
        if timing.completed:
            for histogram, value in (
                (self.decode_time, timing.decode_time),
                (self.inference_time, timing.inference_time),
                (self.tpot, timing.time_per_output_token),
                (self.e2e, timing.e2e),
                (self.request_prompt_tokens, timing.num_prompt_tokens),
                (self.request_generation_tokens, timing.num_generated),
                (self.request_n, timing.n),
                (self.request_max_tokens, timing.max_tokens),
            ):
                if value is not None:
                    self._labelled(histogram).observe(value)
        for listener in self.request_listeners:
            listener(timing)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        if self._client is not None:
            self.engine_up.labels(self.model_name).set(0.0 if self._client.dead else 1.0)
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process, self.multiprocess_dir)
        return generate_latest(every_process)

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


ASGIApp = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]


class HTTPMetricsMiddleware:
    """Counts every HTTP response by method, route and status code (`brisk:http_requests_total`).

    Paths the app does not route are counted as "other", so a scan of random URLs cannot grow the label set.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self._routes: set[str] | None = None

    def _route(self, scope: MutableMapping[str, Any]) -> str:
        if self._routes is None:
            router = scope.get("app")
            self._routes = {getattr(r, "path", "") for r in getattr(router, "routes", [])}
        return scope["path"] if scope["path"] in self._routes else "other"

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_and_note(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.http_requests.labels(scope["method"], self._route(scope), str(status["code"])).inc()
