"""Every HTTP route of `vllm serve` (0.32) and `trtllm-serve` is served by brisk or answered with its reason
(brisk/server/peer_routes.py), on a live server with an API key; the routes served for the peers' clients work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from brisk.server.app import build_app
from brisk.server.peer_routes import UNSERVED_ROUTES
from brisk.server.peers import Peers
from tests.server_utils import RunningServer
from tests.test_security import fake_state
from tests.tiny_models import make_tiny_llama_with_tokenizer

DATA = Path(__file__).parent / "data" / "peer_flags"
KEY = "peer-routes-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def vllm_routes() -> list[tuple[str, str]]:
    routes = json.loads((DATA / "vllm_routes.json").read_text())["routes"]
    return [(method, path) for path, methods in routes for method in methods]


def trtllm_routes() -> list[tuple[str, str]]:
    lines = (DATA / "trtllm_serve_routes.txt").read_text().splitlines()
    return [tuple(line.split()) for line in lines if line and not line.startswith("#")]  # type: ignore[misc]


PEER_ROUTES = sorted(set(vllm_routes()) | set(trtllm_routes()))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("peer_routes_model")
    make_tiny_llama_with_tokenizer(path)
    # --enable-server-load-tracking: vLLM's switch for /load, accepted (brisk always tracks the load)
    srv = RunningServer(str(path), "--served-model-name", "tiny", "--api-key", KEY, "--enable-server-load-tracking")
    yield srv
    srv.stop()


def test_route_lists_are_read():
    assert len(vllm_routes()) > 70 and ("POST", "/invocations") in vllm_routes()
    assert ("GET", "/health_generate") in trtllm_routes() and len(trtllm_routes()) > 15


def test_every_peer_route_is_known(server):
    """No route of a peer's meets the bare 404 of a route brisk does not have, nor a 405."""
    for method, path in PEER_ROUTES:
        url = server.url + re.sub(r"\{[a-z_]+\}", "resp_x", path)
        answer = httpx.request(method, url, headers=AUTH, json={}, timeout=60)
        assert answer.status_code != 405, (method, path)
        if answer.status_code == 404:
            message = answer.json()["error"]["message"]
            assert message != "Not found.", (method, path)


def test_unserved_routes_say_why(server):
    for route in UNSERVED_ROUTES:
        for method in route.methods:
            answer = httpx.request(method, server.url + route.path.replace("{adapter_name}", "a"), headers=AUTH)
            assert answer.status_code == 404, (method, route.path)
            error = answer.json()["error"]
            assert error["code"] == "unsupported_endpoint"
            assert error["message"] == f"{route.path} is not served by brisk: {route.reason}."
    assert httpx.get(server.url + "/no_such_route", headers=AUTH).json()["error"]["message"] == "Not found."


def test_ping_is_health_and_needs_no_key(server):
    for method in ("GET", "POST"):
        answer = httpx.request(method, server.url + "/ping")
        assert answer.status_code == 200 and answer.text == ""
    assert httpx.get(server.url + "/load").status_code == 401  # every other route needs the key


def test_load_counts_requests_in_flight(server, tmp_path):
    assert httpx.get(server.url + "/load", headers=AUTH).json() == {"server_load": 0}
    # In flight: an in-process app over a fake engine client, whose counts the test sets.
    state = fake_state()
    http = TestClient(build_app(state))
    state.client.num_in_flight = 3
    assert http.get("/load").json() == {"server_load": 3}
    # With several API-server processes, the engine's count of all their requests, when it is the larger.
    state.peers = Peers(str(tmp_path), 1, 2)
    state.client.engine_load = lambda: 7
    assert http.get("/load").json() == {"server_load": 7}


def test_invocations_is_chat_or_completions(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
    direct = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json=chat, timeout=60).json()
    invoked = httpx.post(server.url + "/invocations", headers=AUTH, json=chat, timeout=60).json()
    assert invoked["object"] == "chat.completion"
    assert invoked["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert invoked.keys() == direct.keys()  # written as the route writes it (unset fields left out)

    completion = {"model": "tiny", "prompt": "The king", "max_tokens": 8, "temperature": 0}
    direct = httpx.post(server.url + "/v1/completions", headers=AUTH, json=completion, timeout=60).json()
    invoked = httpx.post(server.url + "/invocations", headers=AUTH, json=completion, timeout=60).json()
    assert invoked["object"] == "text_completion" and invoked["choices"][0]["text"] == direct["choices"][0]["text"]

    streamed = httpx.post(server.url + "/invocations", headers=AUTH, json={**completion, "stream": True}, timeout=60)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines() if line[6:7] == "{"]
    assert "".join(texts) == direct["choices"][0]["text"] and streamed.text.rstrip().endswith("data: [DONE]")


def test_invocations_refuses_other_bodies(server):
    neither = httpx.post(server.url + "/invocations", headers=AUTH, json={"model": "tiny", "input": "x"})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
    bad = httpx.post(server.url + "/invocations", headers=AUTH, json={"prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    unknown = httpx.post(server.url + "/invocations", headers=AUTH, json={"prompt": "x", "bogus_field": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "bogus_field"
    not_json = httpx.post(server.url + "/invocations", headers=AUTH, content=b"{")
    assert not_json.status_code == 400


def test_trtllm_routes(server):
    before = server.metrics(AUTH)
    answer = httpx.get(server.url + "/health_generate", headers=AUTH, timeout=60)
    assert answer.status_code == 200 and answer.text == "Generation health check OK"
    after = server.metrics(AUTH)
    tokens = 'brisk:generation_tokens_total{model_name="tiny"}'
    assert after[tokens] == before.get(tokens, 0) + 1  # one token through the engine

    prometheus = httpx.get(server.url + "/prometheus/metrics", headers=AUTH)
    assert prometheus.status_code == 200 and "# TYPE brisk:generation_tokens_total counter" in prometheus.text
    assert httpx.get(server.url + "/perf_metrics", headers=AUTH).json() == []
    assert httpx.post(server.url + "/kv_cache_events", headers=AUTH).json() == []
    assert httpx.get(server.url + "/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}


def test_docs_list_every_peer_route():
    text = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    start = text.index("## Other routes")
    section = text[start : text.index("\n## ", start + 1)]
    missing = {path for _, path in PEER_ROUTES if f"`{path}`" not in section}
    assert not missing, sorted(missing)
