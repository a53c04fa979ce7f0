"""`brisk serve`: start the engine-core process, then the HTTP server; exit non-zero if the engine dies."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import uvicorn
from transformers import AutoTokenizer

from brisk.config import EngineConfig, ModelConfig
from brisk.engine.client import AsyncEngineClient, EngineDeadError
from brisk.model_runner.loader import resolve_model_path
from brisk.server.app import ServerState, build_app

logger = logging.getLogger("brisk.server")
DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo_model"


async def serve(model: str | None, *, host: str, port: int, served_model_name: str | None, api_key: str | None,
                extra_llm_api_options: str | None, max_request_body_size: int, **engine_options) -> int:
    path = resolve_model_path(model) if model else str(DEMO_MODEL)
    config = EngineConfig.build(path, extra_llm_api_options, **engine_options)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or path)
    model_config = ModelConfig.from_pretrained(path)
    is_harmony = model_config.hf_config.model_type == "gpt_oss" and "<|channel|>" in tokenizer.get_vocab()
    name = served_model_name or (model or "brisk-demo")
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
    state = ServerState(client, tokenizer, config, name, model_config.generation_defaults, is_harmony, api_key,
                        max_request_body_size)
    app = build_app(state)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False))
    server_box["server"] = server
    print(f"brisk serve: ready: '{name}' ({info.architecture}, max_seq_len {info.max_seq_len}, "
          f"{info.num_kv_blocks} KV blocks of {info.block_size} tokens) on http://{host}:{port}", flush=True)
    try:
        await server.serve()
    finally:
        await client.shutdown()
    return exit_code["value"]


def run(model: str | None, **kwargs) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(model, **kwargs))
