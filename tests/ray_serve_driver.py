"""The Ray half of tests/test_ray_serve.py, run in its own process so that pytest never imports Ray.

    PYTHONPATH=REPO:RAY_SITE python -m tests.ray_serve_driver WORKDIR RAY_TEMP_DIR

RAY_SITE is where `make test` installs `ray[serve]` (outside the venv's site-packages: Ray brings uvloop and
httptools, which would switch uvicorn's event loop and HTTP parser under every other server test). This starts a
local Ray cluster (2 CPUs, small object store, its files under RAY_TEMP_DIR), deploys deploy/ray/serve_brisk.py
with 2 replicas of a tiny model, runs the workload and writes what it observed to WORKDIR/result.json, which
tests/test_ray_serve.py asserts on. Nothing here asserts on the outcome: a request that fails is recorded
(status, error) so that the test can say which one.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

from tests.server_utils import free_port, wait_until
from tests.tiny_models import make_tiny_llama_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]

# Distinct shared prefixes; a replica's small KV cache holds about three of them. Odd, so that round-robin over
# 2 replicas does not pin each group to one replica by accident (it would with an even number, interleaved).
NUM_GROUPS = 5
PER_GROUP = 6
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _load_serve_brisk() -> Any:
    spec = importlib.util.spec_from_file_location("serve_brisk", ROOT / "deploy" / "ray" / "serve_brisk.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_brisk"] = module
    spec.loader.exec_module(module)
    return module


def _prefix(group: int) -> str:
    return " ".join(WORDS[(group * 7 + i) % len(WORDS)] + str(group) for i in range(12))  # 64 tokens: 8 blocks of 8


def _workload() -> list[tuple[int, str]]:
    """Requests interleaved across groups (group 0, 1, ..., 4, 0, 1, ...), each a group prefix + its own tail."""
    return [(g, f"{_prefix(g)} question {i} of group {g}:") for i in range(PER_GROUP) for g in range(NUM_GROUPS)]


def _complete(http: httpx.Client, base: str, prompt: str, stream: bool = False) -> dict[str, Any]:
    """One completion: {status, replica, usage, error}; error is None when the response is complete and clean."""
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    if not stream:
        response = http.post(f"{base}/v1/completions", json=body)
        ok = response.status_code == 200
        return {
            "status": response.status_code,
            "replica": response.headers.get("x-brisk-replica"),
            "usage": response.json()["usage"] if ok else None,
            "error": None if ok else response.text,
        }
    body.update(stream=True, stream_options={"include_usage": True})
    with http.stream("POST", f"{base}/v1/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        clean = response.status_code == 200 and events[-1:] == ["[DONE]"] and len(events) >= 2
        clean = clean and not any('"error"' in e for e in events)
        return {
            "status": response.status_code,
            "replica": response.headers.get("x-brisk-replica"),
            "usage": json.loads(events[-2])["usage"] if clean else None,
            "error": None if clean else events,
        }


class Cluster:
    def __init__(self, workdir: Path, ray_temp: str) -> None:
        model = workdir / "model"
        make_tiny_llama_with_tokenizer(model)
        options = workdir / "options.yaml"
        # 36 blocks of 8 tokens per replica: room for the blocks of three requests (~10 blocks each) at once, so
        # a replica that sees all five groups in turn (round-robin) evicts each prefix before its group comes back.
        options.write_text("kv_cache_config:\n  max_blocks: 36\n  tokens_per_block: 8\n")
        self.model = str(model)
        self.args = ["--max_batch_size", "4", "--extra_llm_api_options", str(options)]
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=80 << 20,
            _temp_dir=ray_temp,
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})

    def deploy(self, serve_brisk: Any, routing: str) -> str:
        app = serve_brisk.build_app(self.model, self.args, replicas=2, routing=routing, served_model_name="tiny")
        serve.run(app, name=routing, route_prefix=f"/{routing}")
        return f"{self.url}/{routing}"


def _hit_rate_run(cluster: Cluster, serve_brisk: Any, routing: str) -> tuple[dict[str, Any], str]:
    base = cluster.deploy(serve_brisk, routing)
    served_by: dict[int, set[str]] = {}
    cached = prompt = 0
    failures = []
    with httpx.Client(timeout=120) as http:
        for group, text in _workload():
            result = _complete(http, base, text)
            if result["error"] is not None:
                failures.append(result)
                continue
            served_by.setdefault(group, set()).add(result["replica"])
            cached += result["usage"]["prompt_tokens_details"]["cached_tokens"]
            prompt += result["usage"]["prompt_tokens"]
    run = {
        "hit_rate": cached / prompt if prompt else 0.0,
        "served_by": {str(g): sorted(r) for g, r in served_by.items()},
        "failures": failures,
    }
    return run, base


def _kill_and_resend(served_by: dict[str, list[str]], base: str) -> dict[str, Any]:
    """Kill the replica that served group 0; then send its groups' requests (none has started)."""
    victim = served_by["0"][0]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
    outcome: dict[str, Any] = {"victim": victim, "victim_actors": names}
    if len(names) != 1:
        return outcome
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    groups = [g for g in range(NUM_GROUPS) if served_by.get(str(g)) == [victim]] or [0]
    prompts = [f"{_prefix(g)} after the kill {i}:" for g in groups for i in range(3)]
    with httpx.Client(timeout=180) as http, ThreadPoolExecutor(4) as pool:
        outcome["after_kill"] = list(
            pool.map(lambda p: _complete(http, base, p[1], stream=p[0] % 2 == 1), enumerate(prompts))
        )
    with httpx.Client(timeout=30) as http:
        outcome["healthy_after_kill"] = wait_until(lambda: http.get(f"{base}/health").status_code == 200, timeout=60)
    return outcome


def main(workdir: Path, ray_temp: str) -> None:
    serve_brisk = _load_serve_brisk()
    try:
        cluster = Cluster(workdir, ray_temp)
        round_robin, _ = _hit_rate_run(cluster, serve_brisk, "round_robin")
        serve.delete("round_robin")
        prefix, base = _hit_rate_run(cluster, serve_brisk, "prefix")
        result: dict[str, Any] = {"round_robin": round_robin, "prefix": prefix}
        if "0" in prefix["served_by"]:
            result["kill"] = _kill_and_resend(prefix["served_by"], base)
        (workdir / "result.json").write_text(json.dumps(result, indent=1))
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
