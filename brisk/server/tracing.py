"""Traces and the structured request log.

Traces (OpenTelemetry, the `otel` extra): the HTTP server span comes from OpenTelemetry's ASGI middleware, which
also continues a client's W3C `traceparent`; under it each generation gets an `llm_request` span with
`queued` -> `prefill` -> `decode` children and `scheduled` / `first_token` / `finished` events, built when the
request ends from its `RequestTiming` (spans take explicit start and end times, so nothing is held open while
the engine works). Exported by OTLP/HTTP to `--otlp-traces-endpoint`, vLLM's flag.

Logs (`--log-format json`): every log record is one JSON object a line; each request that ends adds one
`request finished` record with its id, token counts and phase times.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from brisk.errors import ConfigError
from brisk.server.metrics import HTTPMetricsMiddleware, RequestTiming, ServerMetrics

if TYPE_CHECKING:
    from fastapi import FastAPI

request_logger = logging.getLogger("brisk.server.requests")
SERVICE_NAME = "brisk"
REQUEST_LOGGER = "brisk.server.requests"  # the guard middleware's line per request (--disable-log-requests)


@dataclass
class ObservabilityConfig:
    """Server options for traces, logs and profiling (`brisk serve` flags)."""

    otlp_traces_endpoint: str | None = None
    log_format: Literal["text", "json"] = "text"
    profile_dir: str | None = None  # where /start_profile and /stop_profile write traces; None: endpoints off
    tracer_provider: Any = None  # an opentelemetry TracerProvider: set from otlp_traces_endpoint, or by tests


def make_tracer_provider(endpoint: str) -> Any:
    """A TracerProvider exporting by OTLP over HTTP (protobuf) to `endpoint` (e.g. http://collector:4318)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'brisk-llm[otel]'") from None
    if not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class Observed(Protocol):
    """What the observability needs of the server's state (ServerState has both)."""

    observability: ObservabilityConfig
    metrics: ServerMetrics


def install_observability(app: FastAPI, state: Observed) -> None:
    """HTTP request metrics, the trace middleware and the per-request listeners; called by `build_app` after its
    own middleware, so these wrap everything (401s, 413s and 429s are counted and traced too)."""
    config = state.observability
    app.add_middleware(HTTPMetricsMiddleware, metrics=state.metrics)
    listeners = []
    if config.tracer_provider is not None:
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        app.add_middleware(
            OpenTelemetryMiddleware,
            tracer_provider=config.tracer_provider,
            exclude_spans=["receive", "send"],
            excluded_urls="health,ping,metrics",
        )
        listeners.append(RequestTracer(config.tracer_provider).record)
    if config.log_format == "json":
        listeners.append(log_request)
    state.metrics.request_listeners[:] = listeners


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """Turns a finished request's timing into spans under the HTTP span that was current when it started."""

    def __init__(self, tracer_provider: Any) -> None:
        from brisk import __version__

        self.tracer = tracer_provider.get_tracer("brisk", __version__)

    def record(self, timing: RequestTiming) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        parent = timing.context.run(otel_context.get_current) if timing.context is not None else None
        span = self.tracer.start_span(
            "llm_request", context=parent, kind=SpanKind.INTERNAL, start_time=_ns(timing.arrival)
        )
        reasons = [r or "abort" for r in timing.finish_reasons] if timing.completed else ["abort"]
        span.set_attributes(
            {
                "gen_ai.request.id": timing.request_id,
                "gen_ai.usage.input_tokens": timing.num_prompt_tokens,
                "gen_ai.usage.output_tokens": timing.num_generated,
                "gen_ai.usage.cached_tokens": timing.num_cached_tokens,
                "gen_ai.request.max_tokens": timing.max_tokens if timing.max_tokens is not None else -1,
                "gen_ai.request.n": timing.n,
                "gen_ai.response.finish_reasons": reasons,
            }
        )
        phases = [
            ("queued", timing.arrival, timing.scheduled or None),
            ("prefill", timing.scheduled or None, timing.first_token),
            ("decode", timing.first_token, timing.last_token),
        ]
        child_context = set_span_in_context(span)
        for name, start, end in phases:
            if start is not None and end is not None:
                self.tracer.start_span(name, context=child_context, start_time=_ns(start)).end(end_time=_ns(end))
        for name, at in (("scheduled", timing.scheduled or None), ("first_token", timing.first_token)):
            if at is not None:
                span.add_event(name, timestamp=_ns(at))
        span.add_event("finished", {"finish_reasons": reasons}, timestamp=_ns(timing.end))
        if not timing.completed:
            span.set_status(Status(StatusCode.ERROR, "ended before finishing (client left, timeout or error)"))
        span.end(end_time=_ns(timing.end))


def request_record(timing: RequestTiming) -> dict[str, Any]:
    """The fields of a request's log line: id, token counts, finish reasons, phase times in seconds."""

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 6)

    return {
        "request_id": timing.request_id,
        "prompt_tokens": timing.num_prompt_tokens,
        "output_tokens": timing.num_generated,
        "cached_tokens": timing.num_cached_tokens,
        "finish_reasons": timing.finish_reasons if timing.completed else ["abort"],
        "queue_s": rounded(timing.queue_time),
        "prefill_s": rounded(timing.prefill_time),
        "ttft_s": rounded(timing.ttft),
        "decode_s": rounded(timing.decode_time),
        "e2e_s": rounded(timing.e2e),
    }


def log_request(timing: RequestTiming) -> None:
    request_logger.info("request finished", extra={"brisk": request_record(timing)})


class JSONFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, plus a record's `brisk` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "brisk", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(log_format: str, level: str = "info", quiet_requests: bool = False) -> None:
    """The server's logging: text or JSON lines at `level` (--log-level); quiet_requests (--disable-log-requests)
    drops the line per request."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger(REQUEST_LOGGER).setLevel(logging.WARNING if quiet_requests else logging.NOTSET)
