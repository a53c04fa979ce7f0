"""`brisk serve`: check the configs against the machine, bind the port, start the engine-core process, then the HTTP
server; exit non-zero if the engine dies. A start-up error a user can act on is a ConfigError (brisk/cli.py prints
it as one line)."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import socket
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from transformers import AutoTokenizer

from brisk.config import (
    OPTIONS,
    ConfigError,
    EngineConfig,
    check_fits_machine,
    generation_defaults,
    load_chat_template,
)
from brisk.distributed.launch import launcher_env, rank_place
from brisk.distributed.worker import run_worker
from brisk.engine.client import AsyncEngineClient, EngineDeadError, EngineLink
from brisk.engine.messages import EngineInfo, shown_block_sizes
from brisk.harmony.chat import is_harmony_model
from brisk.model_config import ModelConfig
from brisk.server.app import build_app
from brisk.server.peers import Peers
from brisk.server.response_store import ResponseStore
from brisk.server.shutdown import ABORT_GRACE_S, DrainingServer
from brisk.server.state import ServerState
from brisk.server.streaming import with_server_send
from brisk.server.tracing import ObservabilityConfig, make_tracer_provider
from brisk.server_config import ServerConfig

logger = logging.getLogger("brisk.server")
DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo_model"
API_KEY_ENV = "BRISK_API_KEY"
# Idle keep-alive connections are closed after this long. It must exceed the idle timeout of whatever
# pools connections in front of us (load balancers: 60 s; HTTP client pools): if the server closes
# first, a request sent on the closing connection fails as a connection error (uvicorn's default is 5 s).
KEEP_ALIVE_TIMEOUT_S = 75


def resolve_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """--api-key, else the first line of --api-key-file, else $BRISK_API_KEY; None: no auth.

    A file or the environment keep the key out of the process list (`ps` shows command lines).
    """
    if api_key is not None and api_key_file is not None:
        raise ConfigError("give either --api-key or --api-key-file, not both")
    if api_key_file is not None:
        try:
            with open(api_key_file) as f:
                api_key = f.readline().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --api-key-file {api_key_file}: {exc.strerror}") from None
        if not api_key:
            raise ConfigError(f"--api-key-file {api_key_file} is empty")
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    return api_key


def bind_socket(server: ServerConfig) -> socket.socket:
    """The listening socket, bound before the engine starts: a port in use is a start-up error naming --port,
    not a failure minutes later once the model has loaded. uvicorn serves on it."""
    if server.uds is not None:
        return _bind_unix_socket(server.uds)
    host, port = server.host, server.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port left in TIME_WAIT is free
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is in use by another process: stop it, or pass --port with a free port"
            ) from None
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}): check --host and --port") from None
    return sock


def _bind_unix_socket(path: str) -> socket.socket:
    """--uds: a socket file left by a server that is gone is replaced; one a server accepts on is a start-up error."""
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:  # nobody listens there: a stale file
            with contextlib.suppress(OSError):
                os.unlink(path)
        else:
            raise ConfigError(f"--uds {path}: another server listens on it; stop it, or pass another path")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on --uds {path} ({exc.strerror})") from None
    return sock


def remove_unix_socket(server: ServerConfig) -> None:
    """--uds: the socket's file goes with the server."""
    if server.uds is not None:
        with contextlib.suppress(OSError):
            os.unlink(server.uds)


@dataclass
class ServePlan:
    """What `brisk serve` checked and loaded before serving; each API-server process serves from one."""

    model: str | None  # MODEL as given
    config: EngineConfig
    server: ServerConfig
    api_key: str | None
    tokenizer: Any
    generation_defaults: dict[str, Any]
    is_harmony: bool
    names: list[str]  # the served model names, the reported one first


def plan_serve(
    model: str | None, config: EngineConfig, server: ServerConfig, launched_externally: bool, check_machine: bool = True
) -> ServePlan:
    """The API key, tokenizer and chat template, and the checks of the configs against the model and the machine."""
    api_key = resolve_api_key(server.api_key, server.api_key_file)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    chat_template = load_chat_template(config)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model_config = ModelConfig.from_pretrained(config.model)
    if check_machine:
        check_fits_machine(config, model_config, launched_externally=launched_externally)
    is_harmony = is_harmony_model(model_config.hf_config.model_type, tokenizer)
    server.check_model(is_harmony)
    names = server.served_model_name or [model or "brisk-demo"]
    return ServePlan(
        model, config, server, api_key, tokenizer, generation_defaults(config, model_config), is_harmony, names
    )


def announce_config(config: EngineConfig, server: ServerConfig) -> None:
    """The configuration in effect, on stdout (or one JSON log line); the options that have no effect in brisk are
    left out (their start-up notes say so where they were given)."""
    in_effect = {
        "engine": config.model_dump(mode="json", exclude=OPTIONS.no_effect_fields(EngineConfig)),
        "server": server.model_dump(mode="json", exclude={"api_key"}),
    }
    if server.log_format == "json":  # every line of a JSON log is one JSON object
        logger.info("configuration in effect", extra={"brisk": {"config": in_effect}})
    else:
        print("brisk serve: configuration in effect:\n" + json.dumps(in_effect, indent=2), flush=True)


def announce_ready(plan: ServePlan, info: EngineInfo) -> None:
    server = plan.server
    processes = f", {server.num_api_servers} API-server processes" if server.num_api_servers > 1 else ""
    ready = (
        f"brisk serve: ready: '{plan.names[0]}' ({info.architecture}, max_seq_len {info.max_seq_len}, "
        f"{info.num_kv_blocks} KV blocks of {shown_block_sizes(info.block_sizes)} tokens{processes}) on {server.address}"
    )
    if server.log_format == "json":
        logger.info(ready)
    else:
        print(ready, flush=True)


def http_config(app: Any, server: ServerConfig) -> uvicorn.Config:
    """The HTTP server's (uvicorn's) settings from the server options."""
    return uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level=server.uvicorn_log_level,
        access_log=False,  # the guard middleware logs each request (method, path, status, time; never the body)
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
        root_path=server.root_path,
        # HTTPS where a certificate is given: on the private socket too, where a sibling forwards to it
        ssl_certfile=server.ssl_certfile,
        ssl_keyfile=server.ssl_keyfile,
        ssl_ca_certs=server.ssl_ca_certs,
        ssl_cert_reqs=server.ssl_cert_reqs,
        ssl_ciphers=server.ssl_ciphers,
        # uvicorn annotates this int | None but only passes it to asyncio.wait_for, which takes a float
        timeout_graceful_shutdown=ABORT_GRACE_S,  # type: ignore[arg-type]
        log_config=None,  # uvicorn's records go through the root handler (text or JSON, --log-format)
    )


async def serve(model: str | None, config: EngineConfig, server: ServerConfig) -> int:
    """Serve `config`'s model (MODEL as given: `model`, the default API name) as `server` says, in this process."""
    env = launcher_env()
    if env is not None and env["RANK"] > 0:  # torchrun: ranks > 0 hold model shards, rank 0 serves HTTP
        run_worker(config, rank_place(config, env))
        return 0
    plan = plan_serve(model, config, server, launched_externally=env is not None)
    sock = bind_socket(server)
    announce_config(config, server)
    try:
        return await serve_api(plan, sock)
    finally:
        remove_unix_socket(server)


async def serve_api(
    plan: ServePlan,
    sock: socket.socket,
    peers: Peers | None = None,
    engine_pid: int | None = None,
    private_sock: socket.socket | None = None,
    on_ready: Callable[[EngineInfo], None] | None = None,
) -> int:
    """One API-server process serving on `sock`: with its own engine process, or (`peers`, `engine_pid`) one of
        several attached to the supervisor's (then also on its `private_sock`). `on_ready` (default: print the ready line)
    is told once it accepts connections."""
    config, server = plan.config, plan.server
    observability = observability_for(server)
    exit_code = {"value": 0}
    server_box: dict[str, uvicorn.Server] = {}

    def on_engine_death() -> None:
        exit_code["value"] = 1
        if "server" in server_box:
            server_box["server"].should_exit = True

    store = response_store_for(server)  # before the engine: a --state-dir that cannot serve fails at once
    link = None if peers is None or engine_pid is None else EngineLink(peers.ipc_dir, peers.index, engine_pid)
    client = AsyncEngineClient(config, plan.tokenizer, on_engine_death, link)
    # Once started, the engine runs (on a GPU, holding it): whatever fails from here ends it, not only a served life.
    try:
        try:
            info = await client.start()
        except EngineDeadError as exc:
            logger.error("%s", exc)
            sock.close()
            return 1
        except BaseException:  # a start-up error the engine reported (ConfigError): the caller prints it
            sock.close()
            raise
        state = ServerState(
            client,
            plan.tokenizer,
            config,
            plan.names[0],
            plan.generation_defaults,
            plan.is_harmony,
            server=server,
            api_key=plan.api_key,
            model_aliases=tuple(plan.names[1:]),
            response_store=store,
            observability=observability,
            peers=peers,
        )
        app = build_app(state)
        http = DrainingServer(
            http_config(with_server_send(app), server),
            state,
            server.shutdown_timeout,
            on_listening=functools.partial(on_ready or functools.partial(announce_ready, plan), info),
        )
        server_box["server"] = http
        await http.serve(sockets=[sock] if private_sock is None else [sock, private_sock])
    finally:
        await client.shutdown()
        if observability.tracer_provider is not None:
            observability.tracer_provider.shutdown()  # flushes the spans still batched
        store.close()
    return exit_code["value"]


def observability_for(server: ServerConfig) -> ObservabilityConfig:
    """Traces (--otlp-traces-endpoint), log format and profiling (--profile-dir) of a server."""
    provider = make_tracer_provider(server.otlp_traces_endpoint) if server.otlp_traces_endpoint else None
    return ObservabilityConfig(server.otlp_traces_endpoint, server.log_format, server.profile_dir, provider)


def response_store_for(server: ServerConfig) -> ResponseStore:
    """The stored Responses of a server: under --state-dir, kept --response-ttl seconds, --max-stored-responses."""
    where = server.state_dir or default_state_dir()
    try:
        return ResponseStore(where, server.response_ttl, server.max_stored_responses)
    except (OSError, sqlite3.Error) as exc:
        raise ConfigError(f"--state-dir {where}: stored Responses cannot be kept there ({exc})") from None


def default_state_dir() -> Path:
    """Where stored Responses live unless --state-dir says otherwise (XDG's state folder)."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "brisk"
