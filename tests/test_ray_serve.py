"""deploy/ray/serve_brisk.py on a local Ray cluster on the CPU: 2 replicas of a tiny model.

Both replicas serve; prefix-aware routing gives a higher prefix-cache hit rate than round-robin on a
shared-prefix workload (measured from the responses' cached_tokens); killing a replica loses no request that
had not started streaming. Ray is heavy on a small machine: this is the only module that starts it, once.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'brisk-llm[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'brisk-llm[ray]')")

from tests.server_utils import free_port, wait_until  # noqa: E402
from tests.tiny_models import make_tiny_llama_with_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("serve_brisk", ROOT / "deploy" / "ray" / "serve_brisk.py")
serve_brisk = importlib.util.module_from_spec(spec)
sys.modules["serve_brisk"] = serve_brisk
spec.loader.exec_module(serve_brisk)

# Distinct shared prefixes; a replica's small KV cache holds about three of them. Odd, so that round-robin over
# 2 replicas does not pin each group to one replica by accident (it would with an even number, interleaved).
NUM_GROUPS = 5
PER_GROUP = 6
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _prefix(group: int) -> str:
    return " ".join(WORDS[(group * 7 + i) % len(WORDS)] + str(group) for i in range(12))  # 64 tokens: 8 blocks of 8


def _workload() -> list[tuple[int, str]]:
    """Requests interleaved across groups (group 0, 1, ..., 4, 0, 1, ...), each a group prefix + its own tail."""
    return [(g, f"{_prefix(g)} question {i} of group {g}:") for i in range(PER_GROUP) for g in range(NUM_GROUPS)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray_serve")
    model = root / "model"
    make_tiny_llama_with_tokenizer(model)
    options = root / "options.yaml"
    # 36 blocks of 8 tokens per replica: room for the blocks of three requests (~10 blocks each) at once, so
    # a replica that sees all five groups in turn (round-robin) evicts each prefix before its group comes back.
    options.write_text("kv_cache_config:\n  max_blocks: 36\n  tokens_per_block: 8\n")
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield str(model), ["--max_batch_size", "4", "--extra_llm_api_options", str(options)], f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _deploy(cluster, routing: str) -> str:
    model, args, url = cluster
    serve.run(
        serve_brisk.build_app(model, args, replicas=2, routing=routing, served_model_name="tiny"),
        name=routing,
        route_prefix=f"/{routing}",
    )
    return f"{url}/{routing}"


def _complete(http: httpx.Client, base: str, prompt: str, stream: bool = False) -> tuple[dict, str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
        with http.stream("POST", f"{base}/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
            return json.loads(events[-2])["usage"], response.headers["x-brisk-replica"]
    response = http.post(f"{base}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"], response.headers["x-brisk-replica"]


def _hit_rate(cluster, routing: str) -> tuple[float, dict[int, set[str]], str]:
    base = _deploy(cluster, routing)
    served_by: dict[int, set[str]] = {}
    cached = prompt = 0
    with httpx.Client(timeout=120) as http:
        for group, text in _workload():
            usage, replica = _complete(http, base, text)
            served_by.setdefault(group, set()).add(replica)
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            prompt += usage["prompt_tokens"]
    return cached / prompt, served_by, base


def test_prefix_aware_routing_beats_round_robin_and_survives_a_killed_replica(cluster) -> None:
    round_robin, rr_served_by, _ = _hit_rate(cluster, "round_robin")
    assert len(set().union(*rr_served_by.values())) == 2, "both replicas serve"
    serve.delete("round_robin")
    prefix, served_by, base = _hit_rate(cluster, "prefix")
    print(f"\nprefix-cache hit rate: round-robin {round_robin:.3f}, prefix-aware {prefix:.3f}")
    assert len(set().union(*served_by.values())) == 2, "both replicas serve under prefix-aware routing"
    assert prefix > round_robin + 0.1, (prefix, round_robin)

    # Kill the replica that holds group 0's prefix; then send that group's requests (none has started): every
    # one must be served, by the other replica or the replacement Serve starts.
    victim = next(iter(served_by[0]))
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    groups = [g for g in range(NUM_GROUPS) if served_by[g] == {victim}] or [0]
    prompts = [f"{_prefix(g)} after the kill {i}:" for g in groups for i in range(3)]
    with httpx.Client(timeout=180) as http, ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: _complete(http, base, p[1], stream=p[0] % 2 == 1), enumerate(prompts)))
    assert len(results) == len(prompts)
    assert all(usage["completion_tokens"] == 4 for usage, _ in results)
    assert all(replica != victim for _, replica in results)
    with httpx.Client(timeout=30) as http:
        assert wait_until(lambda: http.get(f"{base}/health").status_code == 200, timeout=60)
