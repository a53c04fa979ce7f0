"""`brisk serve`: start the engine-core process, then the HTTP server; exit non-zero if the engine dies."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import uvicorn
from transformers import AutoTokenizer

from brisk.config import ConfigError, EngineConfig, ModelConfig
from brisk.distributed.launch import launcher_env, rank_place
from brisk.distributed.worker import run_worker
from brisk.engine.client import AsyncEngineClient, EngineDeadError
from brisk.harmony.chat import is_harmony_model
from brisk.model_runner.loader import resolve_model_path
from brisk.server.app import build_app
from brisk.server.response_store import DEFAULT_MAX_RESPONSES, DEFAULT_TTL_S, ResponseStore
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


async def serve(
    model: str | None,
    *,
    host: str,
    port: int,
    served_model_name: str | None,
    api_key: str | None,
    extra_llm_api_options: str | None,
    max_request_body_size: int,
    api_key_file: str | None = None,
    allowed_origins: list[str] | None = None,
    log_prompts: bool = False,
    request_timeout: float | None = None,
    shutdown_timeout: float = 30.0,
    otlp_traces_endpoint: str | None = None,
    log_format: str = "text",
    profile_dir: str | None = None,
    state_dir: str | None = None,
    response_ttl: float = DEFAULT_TTL_S,
    max_stored_responses: int = DEFAULT_MAX_RESPONSES,
    **engine_options,
) -> int:
    api_key = resolve_api_key(api_key, api_key_file)
    observability = ObservabilityConfig(
        otlp_traces_endpoint,
        "json" if log_format == "json" else "text",
        profile_dir,
        make_tracer_provider(otlp_traces_endpoint) if otlp_traces_endpoint else None,
    )
    path = resolve_model_path(model) if model else str(DEMO_MODEL)
    config = EngineConfig.build(path, extra_llm_api_options, **engine_options)
    env = launcher_env()
    if env is not None and env["RANK"] > 0:  # torchrun: ranks > 0 hold model shards, rank 0 serves HTTP
        run_worker(config, rank_place(config, env))
        return 0
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or path)
    model_config = ModelConfig.from_pretrained(path)
    is_harmony = is_harmony_model(model_config.hf_config.model_type, tokenizer)
    name = served_model_name or (model or "brisk-demo")
    if log_format == "json":  # every line of a JSON log is one JSON object
        logger.info("configuration in effect", extra={"brisk": {"config": config.model_dump(mode="json")}})
    else:
        print("brisk serve: configuration in effect:\n" + json.dumps(config.model_dump(), indent=2), flush=True)

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
        return 1
    state = ServerState(
        client,
        tokenizer,
        config,
        name,
        model_config.generation_defaults,
        is_harmony,
        api_key,
        max_request_body_size,
        request_timeout,
        log_prompts,
        list(allowed_origins or []),
        response_store=ResponseStore(state_dir or default_state_dir(), response_ttl, max_stored_responses),
        observability=observability,
    )
    app = build_app(state)
    # access_log off: the guard middleware logs each request (method, path, status, time; never the body)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
            # uvicorn annotates this int | None but only passes it to asyncio.wait_for, which takes a float
            timeout_graceful_shutdown=ABORT_GRACE_S,  # type: ignore[arg-type]
            log_config=None,  # uvicorn's records go through the root handler (text or JSON, --log-format)
        ),
        state,
        shutdown_timeout,
    )
    server_box["server"] = server
    ready = (
        f"brisk serve: ready: '{name}' ({info.architecture}, max_seq_len {info.max_seq_len}, "
        f"{info.num_kv_blocks} KV blocks of {info.block_size} tokens) on http://{host}:{port}"
    )
    if log_format == "json":
        logger.info(ready)
    else:
        print(ready, flush=True)
    try:
        await server.serve()
    finally:
        await client.shutdown()
        if observability.tracer_provider is not None:
            observability.tracer_provider.shutdown()  # flushes the spans still batched
        if state.response_store is not None:
            state.response_store.close()
    return exit_code["value"]


def default_state_dir() -> Path:
    """Where stored Responses live unless --state-dir says otherwise (XDG's state folder)."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "brisk"


def run(model: str | None, **kwargs) -> int:
    configure_logging(kwargs.get("log_format") or "text")
    return asyncio.run(serve(model, **kwargs))
