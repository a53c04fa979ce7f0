"""The deployment presets (examples/*.yaml, TensorRT-LLM's keys) start `brisk serve` on a CPU and answer a request;
their GPU-only keys are logged as meaning nothing on a CPU, not rejected."""

from __future__ import annotations

import logging
import os

import httpx
import pytest

from brisk.config import EngineConfig
from tests.server_utils import RunningServer
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
PRESETS = ("low_latency.yaml", "max_throughput.yaml")
TRTLLM_KEYS = {"enable_attention_dp", "cuda_graph_config", "moe_config", "stream_interval", "kv_cache_config"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = make_tiny_model("gpt_oss", tmp_path_factory.mktemp("preset_model"), seed=0)
    make_tiny_tokenizer(path)
    return path


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_holds_trtllm_keys_and_validates(preset, caplog):
    import yaml

    with open(os.path.join(EXAMPLES, preset)) as f:
        keys = set(yaml.safe_load(f))
    assert TRTLLM_KEYS <= keys
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        cfg = EngineConfig.build("/model", os.path.join(EXAMPLES, preset), device="cpu")
    assert cfg.moe_config.backend == "auto"  # TRITON written in the file; on a CPU the CPU path runs
    assert cfg.kv_cache_config.fp8 == (preset == "max_throughput.yaml")
    logged = caplog.text
    assert "cuda_graph_config on a CPU: decode steps run on the padded static buffers" in logged
    assert "moe_config.backend 'triton' means nothing on a CPU" in logged


def test_preset_keeps_triton_on_a_gpu():
    cfg = EngineConfig.build("/model", os.path.join(EXAMPLES, "low_latency.yaml"), device="cuda")
    assert cfg.moe_config.backend == "triton" and cfg.cuda_graph_config.max_batch_size == 16


@pytest.mark.parametrize("preset", PRESETS)
def test_brisk_serve_with_preset_answers(model_path, preset):
    server = RunningServer(model_path, "--extra_llm_api_options", os.path.join(EXAMPLES, preset))
    try:
        response = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": model_path, "prompt": "hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 6
        streamed = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": model_path, "prompt": "hello", "max_tokens": 9, "stream": True, "ignore_eos": True},
            timeout=60,
        )
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        log = server.log()
    finally:
        server.stop()
    assert "means nothing on a CPU" in log
    if preset == "max_throughput.yaml":  # FP8 KV (through the padded static-buffer decode steps on a CPU)
        assert "stored as full float8_e4m3fn (32 tokens a block), sliding float8_e4m3fn (32" in log, log
        assert "4.00x the model dtype's" in log
