"""`brisk serve`: check the configs against the machine, bind the port, start the engine-core process, then the HTTP
server; exit non-zero if the engine dies. A start-up error a user can act on is a ConfigError (brisk/cli.py prints
it as one line)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import uvicorn
from transformers import AutoTokenizer

from brisk.config import (
    ConfigError,
    EngineConfig,
    ModelConfig,
    ServerConfig,
    build_serve_configs,
    check_fits_machine,
    generation_defaults,
    load_chat_template,
)
from brisk.distributed.launch import launcher_env, rank_place
from brisk.distributed.worker import run_worker
from brisk.engine.client import AsyncEngineClient, EngineDeadError
from brisk.harmony.chat import is_harmony_model
from brisk.server.app import build_app
from brisk.server.response_store import ResponseStore
from brisk.server.shutdown import ABORT_GRACE_S, DrainingServer
from brisk.server.state import ServerState
from brisk.server.tracing import ObservabilityConfig, configure_logging, make_tracer_provider

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


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine starts: a port in use is a start-up error naming --port,
    not a failure minutes later once the model has loaded. uvicorn serves on it."""
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


async def serve(model: str | None, config: EngineConfig, server: ServerConfig) -> int:
    """Serve `config`'s model (MODEL as given: `model`, the default API name) as `server` says."""
    api_key = resolve_api_key(server.api_key, server.api_key_file)
    observability = observability_for(server)
    env = launcher_env()
    if env is not None and env["RANK"] > 0:  # torchrun: ranks > 0 hold model shards, rank 0 serves HTTP
        run_worker(config, rank_place(config, env))
        return 0
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    chat_template = load_chat_template(config)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model_config = ModelConfig.from_pretrained(config.model)
    check_fits_machine(config, model_config, launched_externally=env is not None)
    is_harmony = is_harmony_model(model_config.hf_config.model_type, tokenizer)
    server.check_model(is_harmony)
    names = server.served_model_name or [model or "brisk-demo"]
    sock = bind_socket(server.host, server.port)
    in_effect = {
        "engine": config.model_dump(mode="json"),
        "server": server.model_dump(mode="json", exclude={"api_key"}),
    }
    if server.log_format == "json":  # every line of a JSON log is one JSON object
        logger.info("configuration in effect", extra={"brisk": {"config": in_effect}})
    else:
        print("brisk serve: configuration in effect:\n" + json.dumps(in_effect, indent=2), flush=True)

    exit_code = {"value": 0}
    server_box: dict[str, uvicorn.Server] = {}

    def on_engine_death() -> None:
        exit_code["value"] = 1
        if "server" in server_box:
            server_box["server"].should_exit = True

    client = AsyncEngineClient(config, tokenizer, on_engine_death)
    try:
        info = await client.start()
    except EngineDeadError as exc:
        logger.error("%s", exc)
        await client.shutdown()
        sock.close()
        return 1
    except BaseException:  # a start-up error the engine reported (ConfigError): the caller prints it
        await client.shutdown()
        sock.close()
        raise
    state = ServerState(
        client,
        tokenizer,
        config,
        names[0],
        generation_defaults(config, model_config),
        is_harmony,
        server=server,
        api_key=api_key,
        model_aliases=tuple(names[1:]),
        response_store=response_store_for(server),
        observability=observability,
    )
    app = build_app(state)
    # access_log off: the guard middleware logs each request (method, path, status, time; never the body)
    http = DrainingServer(
        uvicorn.Config(
            app,
            host=server.host,
            port=server.port,
            log_level=server.uvicorn_log_level,
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
            # uvicorn annotates this int | None but only passes it to asyncio.wait_for, which takes a float
            timeout_graceful_shutdown=ABORT_GRACE_S,  # type: ignore[arg-type]
            log_config=None,  # uvicorn's records go through the root handler (text or JSON, --log-format)
        ),
        state,
        server.shutdown_timeout,
    )
    server_box["server"] = http
    ready = (
        f"brisk serve: ready: '{names[0]}' ({info.architecture}, max_seq_len {info.max_seq_len}, "
        f"{info.num_kv_blocks} KV blocks of {info.block_size} tokens) on http://{server.host}:{server.port}"
    )
    if server.log_format == "json":
        logger.info(ready)
    else:
        print(ready, flush=True)
    try:
        await http.serve(sockets=[sock])
    finally:
        await client.shutdown()
        if observability.tracer_provider is not None:
            observability.tracer_provider.shutdown()  # flushes the spans still batched
        if state.response_store is not None:
            state.response_store.close()
    return exit_code["value"]


def observability_for(server: ServerConfig) -> ObservabilityConfig:
    """Traces (--otlp-traces-endpoint), log format and profiling (--profile-dir) of a server."""
    provider = make_tracer_provider(server.otlp_traces_endpoint) if server.otlp_traces_endpoint else None
    return ObservabilityConfig(server.otlp_traces_endpoint, server.log_format, server.profile_dir, provider)


def response_store_for(server: ServerConfig) -> ResponseStore:
    """The stored Responses of a server: under --state-dir, kept --response-ttl seconds, --max-stored-responses."""
    return ResponseStore(server.state_dir or default_state_dir(), server.response_ttl, server.max_stored_responses)


def default_state_dir() -> Path:
    """Where stored Responses live unless --state-dir says otherwise (XDG's state folder)."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "brisk"


def run(model: str | None, given: dict[str, Any]) -> int:
    """`brisk serve MODEL` with the options `given` (flags, as the option table's keys)."""
    # The flags' logging until the configs are built (their start-up notes are logged), then the configs'.
    configure_logging(given.get("log_format") or "text", str(given.get("log_level") or "info"))
    config, server = build_serve_configs(model, given, default_model=str(DEMO_MODEL))
    configure_logging(server.log_format, server.log_level, quiet_requests=server.disable_log_requests)
    return asyncio.run(serve(model, config, server))
