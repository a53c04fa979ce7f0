"""Traces and the JSON request log, in process: a real engine process on a tiny Llama, the app driven through
httpx's ASGI transport, spans caught by the OpenTelemetry SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="OpenTelemetry SDK (otel extra) is not installed")
pytest.importorskip("opentelemetry.instrumentation.asgi", reason="OpenTelemetry ASGI instrumentation is not installed")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from transformers import AutoTokenizer

from brisk.config import EngineConfig
from brisk.engine.client import AsyncEngineClient
from brisk.sampling_params import SamplingParams
from brisk.server.app import build_app
from brisk.server.state import ServerState
from brisk.server.tracing import JSONFormatter, ObservabilityConfig, make_tracer_provider
from tests.tiny_models import make_tiny_llama_with_tokenizer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(app, exporter, state) for one engine process shared by the module; torn down at the end."""
    path = str(tmp_path_factory.mktemp("tracing_llama"))
    make_tiny_llama_with_tokenizer(path)
    config = EngineConfig.build(path, None, max_batch_size=4, max_num_tokens=128)
    tokenizer = AutoTokenizer.from_pretrained(path)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    loop = asyncio.new_event_loop()
    client = AsyncEngineClient(config, tokenizer)
    loop.run_until_complete(client.start())
    try:
        state = ServerState(
            client,
            tokenizer,
            config,
            "tiny",
            {},
            False,
            observability=ObservabilityConfig(log_format="json", tracer_provider=provider),
        )
        yield loop, build_app(state), exporter, state
    finally:
        loop.run_until_complete(client.shutdown())
        loop.close()


def _post(served, body: dict, headers: dict | None = None) -> httpx.Response:
    loop, app, _, _ = served

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://brisk") as http:
            return await http.post("/v1/completions", json=body, headers=headers or {})

    return loop.run_until_complete(go())


@pytest.mark.parametrize("stream", [False, True])
def test_span_tree_continues_the_clients_trace(served, stream: bool) -> None:
    exporter = served[2]
    exporter.clear()
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": stream}
    response = _post(served, body, {"traceparent": TRACEPARENT})
    assert response.status_code == 200, response.text
    spans = {s.name: s for s in exporter.get_finished_spans()}
    http = spans["POST /v1/completions"]
    request = spans["llm_request"]
    # W3C traceparent honoured: the server span is a child of the client's span, in the client's trace.
    assert format(http.context.trace_id, "032x") == TRACE_ID
    assert format(http.parent.span_id, "016x") == CLIENT_SPAN_ID
    assert request.parent.span_id == http.context.span_id
    for phase in ("queued", "prefill", "decode"):
        assert spans[phase].parent.span_id == request.context.span_id, phase
        assert spans[phase].context.trace_id == http.context.trace_id
    # The phases tile the request in order: queued -> prefill -> decode, inside llm_request.
    assert request.start_time == spans["queued"].start_time
    assert spans["queued"].end_time == spans["prefill"].start_time
    assert spans["prefill"].end_time == spans["decode"].start_time
    assert spans["decode"].end_time <= request.end_time <= http.end_time
    events = [e.name for e in request.events]
    assert events == ["scheduled", "first_token", "finished"]
    attrs = request.attributes
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.usage.input_tokens"] == len(served[3].tokenizer.encode("Once upon a time"))
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    assert len(attrs["gen_ai.request.id"]) == 32


def test_without_traceparent_a_new_trace_starts(served) -> None:
    exporter = served[2]
    exporter.clear()
    assert _post(served, {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["POST /v1/completions"].parent is None
    assert spans["llm_request"].context.trace_id == spans["POST /v1/completions"].context.trace_id


def test_rejected_request_is_traced_with_its_status(served) -> None:
    exporter = served[2]
    exporter.clear()
    assert _post(served, {"prompt": "Hi", "max_tokens": -1}).status_code == 400
    spans = {s.name: s for s in exporter.get_finished_spans()}
    attrs = spans["POST /v1/completions"].attributes
    assert attrs.get("http.response.status_code", attrs.get("http.status_code")) == 400  # new or old semconv
    assert "llm_request" not in spans  # never reached the engine


def test_json_log_has_one_line_per_request_with_id_and_timings(served, caplog) -> None:
    caplog.set_level(logging.INFO, logger="brisk.server.requests")
    assert _post(served, {"prompt": "Hello there", "max_tokens": 3, "ignore_eos": True}).status_code == 200
    records = [r for r in caplog.records if r.getMessage() == "request finished"]
    assert len(records) == 1
    line = JSONFormatter().format(records[0])
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "INFO" and entry["logger"] == "brisk.server.requests"
    assert len(entry["request_id"]) == 32 and entry["output_tokens"] == 3 and entry["finish_reasons"] == ["length"]
    assert entry["queue_s"] >= 0 and entry["prefill_s"] > 0 and entry["decode_s"] > 0
    assert entry["ttft_s"] == pytest.approx(entry["queue_s"] + entry["prefill_s"], abs=2e-6)
    assert entry["e2e_s"] >= entry["ttft_s"] + entry["decode_s"] - 2e-6


def test_otlp_exporter_targets_the_traces_path() -> None:
    provider = make_tracer_provider("http://127.0.0.1:4318")
    try:
        exporter = provider._active_span_processor._span_processors[0].span_exporter
        assert exporter._endpoint == "http://127.0.0.1:4318/v1/traces"
    finally:
        provider.shutdown()


def test_profiling_endpoints_are_off_without_profile_dir(served) -> None:
    loop, app, _, _ = served

    async def go() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://brisk") as http:
            return [(await http.post(path)).status_code for path in ("/start_profile", "/stop_profile")]

    assert loop.run_until_complete(go()) == [404, 404]


def test_an_idle_engine_client_is_idle_without_waiting(served):
    """(This module holds the tests' one in-process engine client.) --shutdown-timeout 0 asks wait_idle for 0
    seconds: an idle client says so, where asyncio.wait_for alone times out before the wait starts; a request in
    flight is not waited for."""
    loop, _, _, state = served
    assert loop.run_until_complete(state.client.wait_idle(0)) is True

    async def with_one_in_flight() -> bool:
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        deltas = state.client.generate("idle-check", [1, 2, 3], params)
        await deltas.__anext__()  # running now
        idle = await state.client.wait_idle(0)
        await deltas.aclose()  # aborts it
        return idle

    assert loop.run_until_complete(with_one_in_flight()) is False
    assert loop.run_until_complete(state.client.wait_idle(30)) is True
