"""deploy/ray/serve_brisk.py on a local Ray cluster on the CPU: 2 replicas of a tiny model.

Both replicas serve; prefix-aware routing gives a higher prefix-cache hit rate than round-robin on a
shared-prefix workload (measured from the responses' cached_tokens); killing a replica loses no request that
had not started streaming.

Ray runs in a subprocess (tests/ray_serve_driver.py) whose PYTHONPATH adds the directory `make install` puts
`ray[serve]` in (.venv/ray-site), so this process never imports Ray: Ray brings uvloop and httptools, which
would switch uvicorn's event loop and HTTP parser under every other server test if they were in the venv.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAY_SITE = Path(sys.prefix) / "ray-site"  # the Makefile's $(VENV)/ray-site
DRIVER_TIMEOUT_S = 480  # ~90 s on 2 shared cores; the bound is for a hang, not for a slow machine
STOP_GRACE_S = 30  # after SIGTERM (which every process of the group gets), before SIGKILL

# Where `pip install 'brisk-llm[ray]'` put Ray in this environment, the driver runs without RAY_SITE.
HAVE_RAY = (RAY_SITE / "ray").is_dir() or importlib.util.find_spec("ray") is not None  # finds, does not import

pytestmark = pytest.mark.skipif(
    not HAVE_RAY,
    reason=f"Ray Serve is not installed in {RAY_SITE} (`make install` or `make test` installs it there)",
)


def _stop(proc: subprocess.Popen) -> None:
    """End the driver's process group (the driver, Ray's raylet, GCS and workers, the replicas' brisk servers)."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue


def _run_driver(workdir: Path) -> dict:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    ray_site = str(RAY_SITE) if RAY_SITE.is_dir() else None
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), ray_site, env.get("PYTHONPATH")) if p)
    log = workdir / "driver.log"
    # Ray's Unix sockets live under its temp dir: a short path keeps them under the 107-byte limit. Removed here,
    # as Ray's processes die on SIGTERM without cleaning up after themselves.
    ray_temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ray_serve_driver", str(workdir), ray_temp],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so that _stop reaches everything Ray started
        )
        try:
            code = proc.wait(timeout=DRIVER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop(proc)  # after a normal exit too: nothing Ray started may outlive the test
            shutil.rmtree(ray_temp, ignore_errors=True)
    tail = log.read_text(errors="replace")[-4000:]
    assert code is not None, f"the Ray driver ran past {DRIVER_TIMEOUT_S} s:\n{tail}"
    assert code == 0 and (workdir / "result.json").exists(), f"the Ray driver failed (exit code {code}):\n{tail}"
    return json.loads((workdir / "result.json").read_text())


def _replicas(run: dict) -> set[str]:
    return set().union(*map(set, run["served_by"].values()))


def test_prefix_aware_routing_beats_round_robin_and_survives_a_killed_replica(tmp_path) -> None:
    result = _run_driver(tmp_path)
    round_robin, prefix = result["round_robin"], result["prefix"]
    assert not round_robin["failures"] and not prefix["failures"], (round_robin["failures"], prefix["failures"])
    assert len(_replicas(round_robin)) == 2, "both replicas serve"
    print(f"\nprefix-cache hit rate: round-robin {round_robin['hit_rate']:.3f}, prefix-aware {prefix['hit_rate']:.3f}")
    assert len(_replicas(prefix)) == 2, "both replicas serve under prefix-aware routing"
    assert prefix["hit_rate"] > round_robin["hit_rate"] + 0.1, (prefix["hit_rate"], round_robin["hit_rate"])

    # The driver killed the replica that held group 0's prefix, then sent that group's requests (none had
    # started): every one must be served, by the other replica or the replacement Serve starts.
    kill = result["kill"]
    assert len(kill["victim_actors"]) == 1, kill["victim_actors"]
    after = kill["after_kill"]
    assert after and all(r["status"] == 200 and r["error"] is None for r in after), after
    assert all(r["usage"]["completion_tokens"] == 4 for r in after), after
    assert all(r["replica"] != kill["victim"] for r in after), after
    assert kill["healthy_after_kill"]
