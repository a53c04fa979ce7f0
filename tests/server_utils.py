"""Start a real server subprocess (`brisk serve`, or a script taking MODEL --port) and wait until /health answers."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time

import httpx

from brisk.config import EngineConfig

STARTUP_TIMEOUT_S = 180


def wait_until(predicate, timeout: float = 60.0) -> bool:
    """Poll an observable condition until it holds or the deadline passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)  # polling with a deadline, not synchronisation of the code under test
    return False


def is_idle(metrics: dict[str, float], model: str) -> bool:
    """A server's /metrics (RunningServer.metrics()) say no KV block in use and no request running, waiting or in
    flight for `model` (its served name): each gauge present and 0."""
    gauges = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "num_requests_in_flight")
    return all(metrics.get(f'brisk:{gauge}{{model_name="{model}"}}') == 0.0 for gauge in gauges)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_kernels_args(launcher: list[str], args: tuple[str, ...]) -> list[str]:
    """`pytest --cpu-kernels X` reaches a `brisk serve` subprocess as its `--cpu_kernels X` (conftest sets the
    EngineConfig default of this run), unless the test chose one itself."""
    choice = EngineConfig.model_fields["cpu_kernels"].default
    if (
        launcher[-1:] != ["serve"]
        or choice == "auto"
        or any(a.startswith(("--cpu_kernels", "--cpu-kernels")) for a in args)
    ):
        return []
    return ["--cpu_kernels", choice]


class RunningServer:
    def __init__(
        self,
        model: str,
        *args: str,
        env: dict[str, str] | None = None,
        script: str | None = None,
        launcher: list[str] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`launcher`: python arguments before MODEL (default `-m brisk.cli serve`, or `script`); `tls`: the server
        serves HTTPS (--ssl-certfile), reached with this client context."""
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        launcher = launcher or ([script] if script else ["-m", "brisk.cli", "serve"])
        cmd = [sys.executable, *launcher, model, "--port", str(self.port), *args]
        cmd += _cpu_kernels_args(launcher, args)
        self.log_path = f"/tmp/brisk-test-server-{self.port}.log"
        self._log = open(self.log_path, "w")
        # brisk serve keeps stored Responses under XDG_STATE_HOME unless --state-dir says otherwise: a test's own
        self._state_home = tempfile.TemporaryDirectory(prefix="brisk-test-state-")
        env = {**os.environ, "XDG_STATE_HOME": self._state_home.name, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        verify = tls or True
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1, verify=verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # polling for readiness, not synchronisation of the code under test
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:  # after stop() too: a start-up failure's message quotes the log
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()  # whole: the start-up lines come before the configuration's (long) listing

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", headers=headers).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._state_home.cleanup()
        return self.proc.returncode
