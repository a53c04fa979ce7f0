"""Observability against the real things: a live `brisk serve` on a tiny Llama, scraped by Debian's Prometheus
with deploy/prometheus's rules; every PromQL query of the Grafana dashboard must return data after real traffic.
Also: promtool on the rules, the metric set at /metrics, the JSON request log, and the profiling endpoints.

Set BRISK_DASHBOARD_IMAGE_DIR=docs/images to refresh the dashboard picture in docs/observability.md.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from brisk.server.metrics import ServerMetrics
from tests.server_utils import RunningServer, free_port, wait_until
from tests.tiny_models import make_tiny_llama_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "brisk-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "brisk.json"
API_KEY = "observability-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TRAFFIC_S = 12.0  # long enough for several 1 s scrapes while requests run
SHARED_PREFIX = (
    "You are a terse assistant. Answer in one short sentence about the kingdom of Denmark and its old castles. "
)

render_module_spec = importlib.util.spec_from_file_location(
    "render_dashboard", ROOT / "deploy/grafana/render_dashboard.py"
)
render_dashboard = importlib.util.module_from_spec(render_module_spec)
render_module_spec.loader.exec_module(render_dashboard)


def _tool(name: str) -> str | None:
    return shutil.which(name)


# ---- static checks ---------------------------------------------------------------------------------------
def test_promtool_checks_and_unit_tests_the_rules() -> None:
    promtool = _tool("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it where apt exists)")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(
        [promtool, "test", "rules", RULES.with_name("brisk-rules.test.yml").name],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
    )
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr
    config = subprocess.run([promtool, "check", "config", str(RULES.with_name("prometheus.yml"))], capture_output=True)
    assert config.returncode == 0, config.stdout


def _dashboard_exprs() -> list[tuple[int, str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["id"], t["refId"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def test_rules_and_dashboard_reference_only_exported_metrics() -> None:
    exported = ServerMetrics("m").exported_names()
    rules = yaml.safe_load(RULES.read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    texts = [r["expr"] for g in rules["groups"] for r in g["rules"]] + [e for _, _, e in _dashboard_exprs()]
    referenced = {name for text in texts for name in re.findall(r"\bbrisk:[A-Za-z0-9_:]+", text)}
    assert referenced - recorded <= exported, sorted(referenced - recorded - exported)
    titles = " ".join(p["title"].lower() for p in json.loads(DASHBOARD.read_text())["panels"])
    for topic in (
        "throughput",
        "first token",
        "inter-token",
        "end-to-end",
        "queue",
        "kv",
        "prefix",
        "preempt",
        "error",
    ):
        assert topic in titles, topic


# ---- the live server and Prometheus ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("observability")
    model = root / "model"
    make_tiny_llama_with_tokenizer(model)
    # A small KV cache (24 blocks of 8 tokens) against 6 concurrent requests: queueing and preemptions happen.
    options = root / "options.yaml"
    options.write_text("kv_cache_config:\n  max_blocks: 24\n  tokens_per_block: 8\n")
    srv = RunningServer(
        str(model),
        *("--served-model-name", "tiny", "--api-key", API_KEY, "--log-format", "json"),
        *("--profile-dir", str(root / "profiles"), "--max_batch_size", "4", "--max_num_tokens", "64"),
        *("--extra_llm_api_options", str(options)),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = _tool("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package prometheus; .ci/run installs it where apt exists)")
    root = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "brisk",
                "authorization": {"type": "Bearer", "credentials": API_KEY},
                "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}],
            }
        ],
    }
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(root / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(ready, timeout=60), (root / "prometheus.log").read_text()[-3000:]
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _query(url: str, expr: str, **params) -> list[dict]:
    path = "query_range" if "start" in params else "query"
    body = httpx.get(f"{url}/api/v1/{path}", params={"query": expr, **params}, timeout=30).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


async def _drive_traffic(url: str) -> dict[str, int]:
    """Shared-prefix completions (some streamed) for TRAFFIC_S seconds, 10 at a time (max_batch_size 4: requests wait
    in every scrape, however fast the machine); worker 0 also sends a
    refused request of each kind (401, 400, 404) every 40 of its requests, so the error counters grow."""
    counts = {"ok": 0, "refused": 0}
    deadline = time.monotonic() + TRAFFIC_S
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:

        async def refused() -> None:
            for status, request in [
                (401, http.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})),
                (400, http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})),
                (404, http.post("/v1/completions", json={"model": "nope", "prompt": "x"})),
            ]:
                assert (await request).status_code == status
                counts["refused"] += 1

        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < deadline and i < 400:
                if w == 0 and i % 40 == 0:
                    await refused()
                body = {
                    "model": "tiny",
                    "prompt": SHARED_PREFIX + f"Question {w}-{i}?",
                    "max_tokens": 24 + 8 * (i % 4),
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": i % 2 == 1,
                }
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                counts["ok"] += 1
                i += 1

        await asyncio.gather(*(worker(w) for w in range(10)))
    return counts


@pytest.fixture(scope="module")
def traffic(server, prometheus):
    """Run the traffic once; wait until Prometheus has scraped its end. Returns (start, end, counts)."""
    start = time.time()
    counts = asyncio.run(_drive_traffic(server.url))
    end = time.time()

    def scraped_everything() -> bool:
        result = _query(prometheus, "sum(brisk:request_success_total)")
        last_scrape = _query(prometheus, 'timestamp(up{job="brisk"})')
        return (
            bool(result and last_scrape)
            and float(result[0]["value"][1]) >= counts["ok"]
            and float(last_scrape[0]["value"][1]) > end + 3  # the queries' range ends at end + 3
        )

    assert wait_until(scraped_everything, timeout=30)
    return start, end, counts


def test_prometheus_scrapes_brisk(prometheus, traffic) -> None:
    up = _query(prometheus, 'up{job="brisk"}')
    assert [float(s["value"][1]) for s in up] == [1.0]
    engine_up = _query(prometheus, "brisk:engine_up")
    assert [float(s["value"][1]) for s in engine_up] == [1.0]


def test_every_dashboard_query_returns_data(prometheus, traffic, tmp_path) -> None:
    start, end, _ = traffic
    results = {}
    empty = []
    for panel_id, ref_id, expr in _dashboard_exprs():
        series = _query(prometheus, render_dashboard.promql(expr), start=start - 2, end=end + 3, step="1s")
        finite = [v for s in series for _, v in s["values"] if math.isfinite(float(v))]
        if not finite:
            empty.append(expr)
        results[(panel_id, ref_id)] = series
    assert not empty, f"queries without data: {empty}"
    # What the traffic did shows in the data: tokens flowed, requests queued, prefixes hit, 4xx were counted.
    peak = {
        name: max(float(v) for s in results[key] for _, v in s["values"] if math.isfinite(float(v)))
        for name, key in [("tokens", (1, "A")), ("waiting", (7, "A")), ("hit_rate", (9, "A"))]
    }
    assert peak["tokens"] > 0 and peak["waiting"] >= 1 and peak["hit_rate"] > 0.2, peak
    statuses = {s["metric"]["status"] for s in results[(11, "A")]}
    assert {"400", "401", "404"} <= statuses
    out_dir = Path(os.environ.get("BRISK_DASHBOARD_IMAGE_DIR", "") or tmp_path)
    image = out_dir / "grafana_dashboard.png"
    render_dashboard.render(json.loads(DASHBOARD.read_text()), results, image, start)
    assert image.stat().st_size > 10_000


def test_recording_rules_evaluate_on_live_data(prometheus, traffic) -> None:
    # The recording group runs every 15 s: wait for an evaluation that saw the traffic.
    assert wait_until(lambda: bool(_query(prometheus, "model_name:brisk_generation_tokens:rate1m > 0")), timeout=40)
    assert _query(prometheus, "model_name:brisk_prefix_cache_hit_ratio:rate5m > 0")
    ttft = _query(prometheus, "model_name:brisk_time_to_first_token_seconds:p90_rate5m")
    assert ttft and 0 < float(ttft[0]["value"][1]) < 60
    alerts = _query(prometheus, 'ALERTS{alertname="BriskEngineDown"}')
    assert not alerts


def test_metrics_phases_add_up_and_engine_series_present(server, traffic) -> None:
    m = server.metrics(headers=AUTH)
    label = '{model_name="tiny"}'
    ttft, queue, prefill = (
        m[f"brisk:{n}_sum{label}"]
        for n in ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds")
    )
    assert m[f"brisk:request_queue_time_seconds_count{label}"] == m[f"brisk:time_to_first_token_seconds_count{label}"]
    assert queue + prefill == pytest.approx(ttft, rel=1e-6)
    assert queue > 0 and prefill > 0
    assert m[f"brisk:iteration_tokens_total_sum{label}"] >= m[f"brisk:generation_tokens_total{label}"]
    assert m[f"brisk:num_preemptions_total{label}"] > 0  # 24 blocks cannot hold 4 running requests
    assert m[f"brisk:prefix_cache_hits_total{label}"] > 0
    assert m['brisk:kv_cache_usage_perc_by_dp_rank{dp_rank="0",model_name="tiny"}'] >= 0
    info = [k for k in m if k.startswith("brisk:cache_config_info{")]
    assert len(info) == 1 and 'block_size="8"' in info[0] and 'num_gpu_blocks="24"' in info[0]
    assert m[f"brisk:request_params_max_tokens_count{label}"] == m[f"brisk:e2e_request_latency_seconds_count{label}"]


def test_json_log_has_a_line_per_request(server, traffic) -> None:
    _, _, counts = traffic
    with open(server.log_path) as f:
        lines = f.read().splitlines()
    # The API server's lines are JSON (the engine process's model-loading lines are not: see observability.md).
    entries = [json.loads(line) for line in lines if line.startswith('{"time"')]
    assert any(e["message"] == "configuration in effect" for e in entries)
    finished = [e for e in entries if e["message"] == "request finished"]
    assert len(finished) == counts["ok"]
    assert len({e["request_id"] for e in finished}) == counts["ok"]
    assert all(e["ttft_s"] > 0 and e["e2e_s"] >= e["ttft_s"] and e["output_tokens"] >= 24 for e in finished)
    assert any(e["cached_tokens"] > 0 for e in finished)


def test_profiling_endpoints_write_a_chrome_trace(server, traffic) -> None:
    url = server.url
    assert httpx.post(f"{url}/start_profile").status_code == 401  # admin-only: the API key is required
    assert httpx.post(f"{url}/stop_profile", headers=AUTH).status_code == 409  # nothing to stop
    assert httpx.post(f"{url}/start_profile", headers=AUTH).status_code == 200
    assert httpx.post(f"{url}/start_profile", headers=AUTH).status_code == 409
    body = {"prompt": "profile me", "max_tokens": 8, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    stopped = httpx.post(f"{url}/stop_profile", headers=AUTH, timeout=180)
    assert stopped.status_code == 200, stopped.text
    trace = json.loads(Path(stopped.json()["trace_path"]).read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("aten::") for name in names), sorted(names)[:20]
