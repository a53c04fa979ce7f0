"""EngineConfig: trtllm-serve option names, YAML merging, and errors that name the key."""

from __future__ import annotations

import json

import pytest

from brisk.config import ConfigError, EngineConfig
from brisk.model_config import ModelConfig, ParallelConfig


def _write(tmp_path, text):
    p = tmp_path / "opts.yaml"
    p.write_text(text)
    return p


def test_yaml_options_with_trtllm_names(tmp_path):
    yaml_path = _write(
        tmp_path,
        """
max_batch_size: 16
max_num_tokens: 2048
kv_cache_free_gpu_memory_fraction: 0.8
enable_chunked_prefill: false
kv_cache_config:
  enable_block_reuse: false
  tokens_per_block: 64
cuda_graph_config:
  max_batch_size: 8
  enable_padding: true
moe_config:
  backend: torch
stream_interval: 4
enable_attention_dp: false
""",
    )
    cfg = EngineConfig.build("m", yaml_path)
    assert (cfg.max_batch_size, cfg.max_num_tokens, cfg.stream_interval) == (16, 2048, 4)
    assert cfg.block_size == 64 and not cfg.enable_prefix_caching and not cfg.enable_chunked_prefill
    assert cfg.cuda_graph_config.max_batch_size == 8 and cfg.moe_config.backend == "torch"
    assert cfg.memory_fraction == 0.8


def test_cli_options_override_yaml_and_accept_dashes(tmp_path):
    yaml_path = _write(tmp_path, "max_batch_size: 16\n")
    cfg = EngineConfig.build("m", yaml_path, **{"max-batch-size": 4, "tokens_per_block": 16})
    assert cfg.max_batch_size == 4 and cfg.block_size == 16


@pytest.mark.parametrize(
    "text, key",
    [
        ("max_batch_sise: 4\n", "max_batch_sise"),
        ("kv_cache_config:\n  enable_block_reus: true\n", "kv_cache_config.enable_block_reus"),
        ("max_batch_size: many\n", "max_batch_size"),
        ("moe_config:\n  backend: cutlass-ish\n", "moe_config.backend"),
        ("kv_cache_free_gpu_memory_fraction: 1.5\n", "kv_cache_free_gpu_memory_fraction"),
        ("cuda_graph_config:\n  enable_padding: maybe\n", "cuda_graph_config.enable_padding"),
    ],
)
def test_bad_options_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        EngineConfig.build("m", _write(tmp_path, text))


def test_yaml_that_is_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        EngineConfig.build("m", _write(tmp_path, "- a\n- b\n"))


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        EngineConfig.build("m", tmp_path / "nope.yaml")


def test_parallel_options_and_their_validation():
    cfg = EngineConfig.build("m", tp_size=8, ep_size=4, enable_attention_dp=True)
    assert (cfg.tp_size, cfg.ep_size, cfg.enable_attention_dp) == (8, 4, True)
    with pytest.raises(ConfigError, match=r"ep_size \(3\) must divide tp_size \(4\)"):
        EngineConfig.build("m", tp_size=4, ep_size=3)
    with pytest.raises(ConfigError, match="tp_size"):
        EngineConfig.build("m", tp_size=0)


def test_parallel_layout_of_each_rank():
    # tp 4, ep 2: attention split 4 ways, experts 2 ways, each expert's intermediate 2 ways.
    layouts = [ParallelConfig.for_rank(r, 4, ep_size=2) for r in range(4)]
    assert [(p.tp_rank, p.ep_rank, p.moe_tp_rank) for p in layouts] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert all(p.world_size == 4 and p.rank == r and p.dp_size == 1 for r, p in enumerate(layouts))
    dp = [ParallelConfig.for_rank(r, 4, ep_size=4, attention_dp=True) for r in range(4)]
    assert [(p.tp_size, p.dp_rank, p.ep_rank, p.moe_tp_size) for p in dp] == [(1, r, r, 1) for r in range(4)]
    assert all(p.world_size == 4 and p.rank == r for r, p in enumerate(dp))


def test_model_config_defaults_from_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 100,
                "max_position_embeddings": 512,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [5, 6], "temperature": 0.6, "top_p": 0.9})
    )
    mc = ModelConfig.from_pretrained(str(tmp_path))
    assert mc.architecture == "LlamaForCausalLM" and mc.head_dim == 16 and mc.num_kv_heads == 2
    assert mc.eos_token_ids == [5, 6] and mc.max_position_embeddings == 512
    assert mc.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert mc.sliding_window is None and mc.layer_types == ["full_attention"] * 2


def test_gpt_oss_config_layer_types():
    from pathlib import Path

    shared = Path(__file__).resolve().parents[2] / "shared" / "models" / "gpt-oss-120b"
    mc = ModelConfig.from_pretrained(str(shared))
    assert mc.architecture == "GptOssForCausalLM" and mc.num_layers == 36
    assert mc.layer_types[0] == "sliding_attention" and mc.layer_types[1] == "full_attention"
    assert mc.sliding_window == 128 and mc.vocab_size == 201088
    assert 200002 in mc.eos_token_ids


@pytest.mark.parametrize("native_bf16", [True, False])
def test_cpu_dtype_is_bf16_where_native_and_big_enough(tmp_path, monkeypatch, native_bf16):
    import torch

    import brisk.model_config

    monkeypatch.setattr(brisk.model_config, "cpu_has_native_bf16", lambda: native_bf16)
    for declared, hidden, expected in (
        ("bfloat16", 512, torch.bfloat16 if native_bf16 else torch.float32),
        ("bfloat16", 64, torch.float32),  # too small for bf16 to pay on CPU
        ("float32", 128, torch.bfloat16 if native_bf16 else torch.float32),
        ("float32", 64, torch.float32),
    ):
        (tmp_path / "config.json").write_text(
            json.dumps(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": hidden,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "vocab_size": 16,
                    "dtype": declared,
                }
            )
        )
        assert ModelConfig.from_pretrained(str(tmp_path), "auto", "cpu").dtype == expected
        assert ModelConfig.from_pretrained(str(tmp_path), "auto", "cuda").dtype == torch.bfloat16
        assert ModelConfig.from_pretrained(str(tmp_path), "float32", "cpu").dtype == torch.float32


def test_a_gpu_the_machine_does_not_have_is_refused_before_anything_starts(monkeypatch, tmp_path):
    import torch

    from brisk.config import check_fits_machine
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "m", seed=0)
    model_config = ModelConfig.from_pretrained(str(path), dtype="float32")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_fits_machine(EngineConfig(model=str(path), device="cuda:1"), model_config, launched_externally=False)
    with pytest.raises(ConfigError, match=r"device cuda:3 does not exist: this machine has 2 GPUs"):
        check_fits_machine(EngineConfig(model=str(path), device="cuda:3"), model_config, launched_externally=False)
    # the default device on a CUDA machine ("auto": the first run on an H100 found it unchecked) and a bare "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device in ("auto", "cuda"):
        check_fits_machine(EngineConfig(model=str(path), device=device), model_config, launched_externally=False)
