"""`brisk serve` with one API-server process or several (--api-server-count N; trtllm's num_postprocess_workers).

N = 1: this process serves HTTP and starts the engine process itself (brisk/server/serve.py).

N > 1: this process supervises. It checks the configs, binds the port, starts the engine-core process, then N
API-server processes. All of them accept connections on the one listening socket (passed to each: the kernel hands
each new connection to one of the processes waiting in accept), and each has its own pair of IPC sockets to the
engine, which sends every output to the process that sent its request (OutputRouter in brisk/engine/process.py).
Each also listens on a private Unix socket, through which its siblings forward what concerns the background
Responses it runs (brisk/server/peers.py); stored Responses are one SQLite file for all; /metrics of any process
reads every process's metrics (brisk/server/metrics.py).

Signals: the API-server processes run in their own process group, so a Ctrl-C or a SIGTERM reaches the supervisor
alone, which passes each signal on once to every API-server process: the first drains them (brisk/server/
shutdown.py), a second stops them at once. Once all have exited it stops the engine (with tp_size > 1 by telling it
to, so that it stops its other ranks; else SIGKILL) and exits 0, or 1 if one failed.
The engine dying: every API-server process sees it within a liveness poll, answers 503 and exits 1, and so does
the supervisor. An API-server process that dies on its own drains the others and the supervisor exits 1. All of
them end with the supervisor if it is killed outright (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from brisk.config import ConfigError, EngineConfig, build_serve_configs
from brisk.distributed.launch import launcher_env, rank_place
from brisk.distributed.worker import run_worker
from brisk.engine.client import engine_process, make_ipc_dir, stop_engine_process
from brisk.engine.messages import EngineInfo
from brisk.engine.process import STARTUP_ERROR_EXIT, end_with_parent
from brisk.server.metrics import use_multiprocess_metrics
from brisk.server.peers import Peers
from brisk.server.serve import (
    DEMO_MODEL,
    announce_config,
    announce_ready,
    bind_socket,
    plan_serve,
    remove_unix_socket,
    serve,
    serve_api,
)
from brisk.server.shutdown import ABORT_GRACE_S
from brisk.server.tracing import configure_logging
from brisk.server_config import ServerConfig

logger = logging.getLogger("brisk.server")
ENGINE_DEATH_GRACE_S = 30.0  # after the engine died, how long the API-server processes get to notice and exit


def run(model: str | None, given: dict[str, Any]) -> int:
    """`brisk serve MODEL` with the options `given` (flags, as the option table's keys)."""
    # The flags' logging until the configs are built (their start-up notes are logged), then the configs'.
    configure_logging(given.get("log_format") or "text", str(given.get("log_level") or "info"))
    config, server = build_serve_configs(model, given, default_model=str(DEMO_MODEL))
    configure_logging(server.log_format, server.log_level, quiet_requests=server.disable_log_requests)
    if server.num_api_servers > 1:
        return serve_with_api_servers(model, config, server)
    return asyncio.run(serve(model, config, server))


def serve_with_api_servers(model: str | None, config: EngineConfig, server: ServerConfig) -> int:
    """Supervise the engine process and `server.num_api_servers` API-server processes until they end."""
    env = launcher_env()
    if env is not None and env["RANK"] > 0:  # torchrun: ranks > 0 hold model shards, rank 0 serves HTTP
        run_worker(config, rank_place(config, env))
        return 0
    plan = plan_serve(model, config, server, launched_externally=env is not None)  # fails before anything starts
    sock = bind_socket(server)
    announce_config(config, server)
    ipc_dir = make_ipc_dir()
    count = server.num_api_servers
    spawn = multiprocessing.get_context("spawn")
    engine = engine_process(config, ipc_dir, count)
    supervisor = Supervisor(engine, server.shutdown_timeout, ipc_dir, has_other_ranks=config.tp_size > 1)
    try:
        engine.start()
        assert engine.pid is not None  # started
        readiness: list[Connection] = []
        for index in range(count):
            receiver, sender = spawn.Pipe(duplex=False)
            child = spawn.Process(
                target=run_api_server,
                args=(model, config, server, Peers(ipc_dir, index, count), engine.pid, sock, sender, os.getpid()),
                name=f"brisk-api-server-{index}",
            )
            child.start()
            sender.close()
            supervisor.children.append(child)
            readiness.append(receiver)
        sock.close()  # the API-server processes hold it: once they have all closed it, the port is closed
        logger.info(
            "engine process %d; API-server processes %s (private sockets in %s)",
            engine.pid,
            " ".join(str(c.pid) for c in supervisor.children),
            ipc_dir,
        )
        previous = {sig: signal.signal(sig, supervisor.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            info = supervisor.wait_ready(readiness)
            if info is None:  # one ended before serving: the others stop too
                supervisor.signal_children()
            else:
                announce_ready(plan, info)
            return supervisor.supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        supervisor.stop_all()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        remove_unix_socket(server)


class Supervisor:
    def __init__(self, engine: BaseProcess, shutdown_timeout: float, ipc_dir: str, has_other_ranks: bool) -> None:
        self.engine = engine
        self.ipc_dir = ipc_dir
        self.has_other_ranks = has_other_ranks  # tp_size > 1: its ranks are stopped by the engine, not a SIGKILL
        self.children: list[BaseProcess] = []
        self.shutdown_timeout = shutdown_timeout
        self.num_signals = 0
        self.failed = False

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.num_signals += 1
        self.signal_children()

    def signal_children(self) -> None:
        for child in self.children:
            if child.pid is not None and child.exitcode is None:
                try:
                    os.kill(child.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def wait_ready(self, readiness: list[Connection]) -> EngineInfo | None:
        """The engine's facts once every API-server process serves; None if one ended first (a signal, a crash).
        ConfigError: the engine could not start, for the reason it gave."""
        info: EngineInfo | None = None
        waiting = list(readiness)
        while waiting:
            ready = wait([*waiting, *(c.sentinel for c in self.children)])
            for conn in waiting[:]:
                if conn not in ready:
                    continue
                waiting.remove(conn)
                try:
                    kind, value = conn.recv()
                except EOFError:  # it ended before it served
                    self._report_early_exits()
                    return None
                if kind == "error":
                    self.failed = True
                    raise ConfigError(value)
                info = value
            if any(c.exitcode is not None for c in self.children):
                self._report_early_exits()
                return None
        return info

    def _report_early_exits(self) -> None:
        self.failed = True
        for child in self.children:
            child.join(1.0)  # its pipe closed: it is exiting
            if child.exitcode is not None:
                logger.error("API-server process %d ended before serving (exit code %s)", child.pid, child.exitcode)

    def supervise(self) -> int:
        """Wait until every API-server process has exited; 0 when all ended well (a drain), else 1."""
        engine_died_at: float | None = None
        while True:
            # One look at each exit code: a child that ended between two looks would be neither waited for nor
            # seen as ended, leaving only the engine's sentinel to wait on, for ever.
            running = [c for c in self.children if c.exitcode is None]
            if not running:
                break
            timeout = None
            if engine_died_at is not None:
                timeout = max(0.0, engine_died_at + ENGINE_DEATH_GRACE_S - time.monotonic())
            watched = [c.sentinel for c in running]
            if engine_died_at is None:
                watched.append(self.engine.sentinel)
            if not wait(watched, timeout) and engine_died_at is not None:
                logger.error("the API-server processes did not exit after the engine died; stopping them")
                break
            if engine_died_at is None and not self.engine.is_alive():
                engine_died_at = time.monotonic()
                self.failed = True
                logger.error("the engine core process died (exit code %s)", self.engine.exitcode)
            for child in self.children:
                if child.exitcode not in (None, 0) and not self.failed:
                    self.failed = True
                    if not self.num_signals and engine_died_at is None:
                        logger.error(
                            "API-server process %d exited with %s: stopping the others", child.pid, child.exitcode
                        )
                        self.signal_children()
        return 1 if self.failed or any(c.exitcode != 0 for c in self.children if c.exitcode is not None) else 0

    def stop_all(self) -> None:
        """Whatever still runs: the API-server processes drained for a while, then killed; then the engine, told to
        stop its other ranks where it has some, else killed (it holds nothing to flush)."""
        self.signal_children()
        for child in self.children:
            child.join(self.shutdown_timeout + ABORT_GRACE_S + 5)
            if child.exitcode is None:
                child.kill()
                child.join()
        stop_engine_process(self.engine, self.ipc_dir, self.has_other_ranks)
        logger.info("the engine process ended (exit code %s)", self.engine.exitcode)


def run_api_server(
    model: str | None,
    config: EngineConfig,
    server: ServerConfig,
    peers: Peers,
    engine_pid: int,
    sock: socket.socket,
    ready: Connection,
    supervisor_pid: int,
) -> None:
    """One API-server process of several (its main): serves `sock` (and its private socket) until drained or the
    engine dies; tells the supervisor through `ready` when it serves, or why it could not start."""
    os.setpgid(0, 0)  # signals come from the supervisor, once each (a terminal's Ctrl-C goes to its group)
    faulthandler.enable()  # a crash in native code (tokenizers, ZMQ) says where, as the supervisor sees only its code
    end_with_parent(supervisor_pid)
    configure_logging(server.log_format, server.log_level, quiet_requests=server.disable_log_requests)
    use_multiprocess_metrics(peers.metrics_dir)
    private_path = peers.socket_path(os.getpid())
    private = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    private.bind(private_path)
    os.chmod(private_path, 0o600)
    code = 1
    try:
        plan = plan_serve(model, config, server, launched_externally=False, check_machine=False)
        code = asyncio.run(
            serve_api(plan, sock, peers, engine_pid, private, on_ready=lambda info: ready.send(("ready", info)))
        )
    except ConfigError as exc:
        ready.send(("error", str(exc)))
        code = STARTUP_ERROR_EXIT
    finally:
        if os.path.exists(private_path):
            os.unlink(private_path)
        ready.close()
    sys.exit(code)
