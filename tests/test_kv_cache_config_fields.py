"""trtllm's KvCacheConfig keys (tensorrt_llm/llmapi/llm_args.py): each one is implemented, accepted with its
documented no-effect (logged at start-up), or refused with the reason, never "unknown option"; through a YAML file
(`brisk serve --config` / `--extra_llm_api_options`) and through `LLM(...)` alike. The implemented ones change what
runs: max_tokens and max_gpu_total_bytes bound the pool, secondary_offload_min_priority decides whether evicted
blocks go to the host tier, onboard_blocks false is refused beside a host tier."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import yaml

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.config import OPTIONS, ConfigError, EngineConfig, build_serve_configs
from brisk.kv_cache.config import DEFAULT_RETENTION_PRIORITY
from brisk.kv_cache.manager import cdiv
from tests.server_utils import RunningServer

DEMO = str(Path(__file__).resolve().parents[1] / "brisk" / "demo_model")

# Every field of trtllm's KvCacheConfig (its LLM API, the PyTorch backend's pure-Python ones included).
TRTLLM_KV_CACHE_CONFIG_FIELDS = (
    "enable_block_reuse",
    "max_tokens",
    "max_attention_window",
    "sink_token_length",
    "free_gpu_memory_fraction",
    "host_cache_size",
    "disk_cache_size",
    "disk_cache_path",
    "onboard_blocks",
    "cross_kv_cache_fraction",
    "secondary_offload_min_priority",
    "event_buffer_max_size",
    "attention_dp_events_gather_period_ms",
    "kv_events_config",
    "enable_partial_reuse",
    "copy_on_partial_reuse",
    "use_uvm",
    "max_gpu_total_bytes",
    "iteration_stats_interval",
    "dtype",
    "mamba_ssm_cache_dtype",
    "mamba_ssm_stochastic_rounding",
    "mamba_ssm_philox_rounds",
    "tokens_per_block",
    "mamba_state_cache_interval",
    "mamba_state_config",
    "use_kv_cache_manager_v2",
    "enable_swa_scratch_reuse",
    "kv_cache_event_hash_algo",
    "max_util_for_resume",
    "enable_kv_pool_rebalance",
    "kv_pool_rebalance_min_sampled_kv_caches",
    "kv_pool_rebalance_cooldown_secs",
    "kv_pool_rebalance_target_ratio_update_interval",
    "kv_pool_rebalance_ratio_threshold",
    "kv_pool_rebalance_moving_average_decay",
    "kv_pool_rebalance_check_interval",
    "disk_prefetch_num_reqs",
    "fp8_context_mla_kv_len_cap",
    "pool_ratio",
    "avg_seq_len",
    "block_reuse_config",
)
# Accepted, doing nothing in brisk: a value a trtllm config might hold (not the default), and the start-up line.
NO_EFFECT = {
    "sink_token_length": (4, "StreamingLLM sink tokens"),
    "disk_cache_path": ("/tmp/kv", "no disk KV tier"),
    "attention_dp_events_gather_period_ms": (10, "does not publish"),
    "enable_partial_reuse": (False, "whole matching blocks only"),
    "copy_on_partial_reuse": (False, "no partially matched block"),
    "iteration_stats_interval": (4, "every step"),
    "mamba_ssm_cache_dtype": ("float16", "Mamba"),
    "mamba_ssm_stochastic_rounding": (True, "Mamba"),
    "mamba_ssm_philox_rounds": (5, "Mamba"),
    "mamba_state_cache_interval": (256, "Mamba"),
    "mamba_state_config": ({"periodic_snapshot_interval": 256}, "Mamba"),
    "use_kv_cache_manager_v2": (True, "brisk has one"),
    "enable_swa_scratch_reuse": (True, "as the window passes"),
    "kv_cache_event_hash_algo": ("v2_sha256", "does not publish"),
    "max_util_for_resume": (0.9, "once its blocks fit"),
    "enable_kv_pool_rebalance": (True, "no pool ratios"),
    "kv_pool_rebalance_min_sampled_kv_caches": (100, "enable_kv_pool_rebalance"),
    "kv_pool_rebalance_cooldown_secs": (10.0, "enable_kv_pool_rebalance"),
    "kv_pool_rebalance_target_ratio_update_interval": (10, "enable_kv_pool_rebalance"),
    "kv_pool_rebalance_ratio_threshold": (1.5, "enable_kv_pool_rebalance"),
    "kv_pool_rebalance_moving_average_decay": (0.99, "enable_kv_pool_rebalance"),
    "kv_pool_rebalance_check_interval": (5, "enable_kv_pool_rebalance"),
    "disk_prefetch_num_reqs": (2, "to prefetch from"),
    "fp8_context_mla_kv_len_cap": (4096, "latent attention"),
    "pool_ratio": ([0.5, 0.5], "share one block pool"),
    "avg_seq_len": (1024, "share one pool"),
}
# Refused with the reason, never as unknown: a value brisk does not have, and words of the reason.
REFUSED = {
    "max_attention_window": ([128, 4096], "each layer's own window"),
    "cross_kv_cache_fraction": (0.5, "decoder-only"),
    "use_uvm": (True, "unified memory"),
    "event_buffer_max_size": (1024, "no KV cache events"),
    "disk_cache_size": (1 << 30, "no disk KV tier"),
    "kv_events_config": ({"enable_kv_cache_events": True}, "no KV cache events"),
    "block_reuse_config": ({"policy": "per_conversation"}, "per_conversation policies"),
}
# Accepted with the default value of the refused ones: what brisk does.
REFUSED_DEFAULTS = {
    "max_attention_window": None,
    "cross_kv_cache_fraction": None,
    "use_uvm": False,
    "event_buffer_max_size": 0,
    "disk_cache_size": 0,
    "kv_events_config": {"enable_kv_cache_events": False, "endpoint": "tcp://*:5557"},
    "block_reuse_config": {"policy": "all_reusable"},
}
# Implemented (here and in other tests: the table in test_options.py names them).
IMPLEMENTED = {
    "enable_block_reuse",
    "max_tokens",
    "free_gpu_memory_fraction",
    "host_cache_size",
    "onboard_blocks",
    "secondary_offload_min_priority",
    "max_gpu_total_bytes",
    "dtype",
    "tokens_per_block",
}


def test_every_trtllm_field_is_an_option_with_a_verdict():
    for field in TRTLLM_KV_CACHE_CONFIG_FIELDS:
        row = OPTIONS.by_path[f"kv_cache_config.{field}"]
        assert f"kv_cache_config.{field}" in {a.name for a in row.aliases}, field  # listed as trtllm's spelling
        verdicts = [field in NO_EFFECT, field in REFUSED, field in IMPLEMENTED]
        assert sum(verdicts) == 1, field
        assert row.spellings.no_effect == (field in NO_EFFECT) or row.group, field
        if field in NO_EFFECT:
            assert row.help.startswith("no effect: ")


def _through_yaml(tmp_path, kv: dict, option_file: str):
    path = tmp_path / "kv.yaml"
    path.write_text(yaml.safe_dump({"kv_cache_config": kv}))
    engine, _ = build_serve_configs(None, {option_file: str(path), "device": "cpu"}, default_model=DEMO)
    return engine.kv_cache_config


@pytest.mark.parametrize("option_file", ["config", "extra_llm_api_options"])
def test_no_effect_fields_are_accepted_and_logged(option_file, tmp_path, caplog):
    kv = {field: value for field, (value, _) in NO_EFFECT.items()}
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        from_file = _through_yaml(tmp_path, kv, option_file)
        from_kwargs = EngineConfig.build(DEMO, device="cpu", kv_cache_config=kv).kv_cache_config
    for field, (value, reason) in NO_EFFECT.items():
        assert getattr(from_file, field) == getattr(from_kwargs, field) == value
        assert reason in OPTIONS.by_path[f"kv_cache_config.{field}"].help
        assert f"kv_cache_config.{field} " in caplog.text, field
    assert EngineConfig.build(DEMO, kv_cache_config={"block_reuse_config": {"max_num_turns": 4}})


def test_refused_fields_say_why(tmp_path, capsys):
    for field, (value, reason) in REFUSED.items():
        for build in (
            lambda kv: _through_yaml(tmp_path, kv, "config"),
            lambda kv: EngineConfig.build(DEMO, kv_cache_config=kv),
            lambda kv: LLM(DEMO, device="cpu", kv_cache_config=kv),
        ):
            with pytest.raises(ConfigError, match=f"kv_cache_config.{field}") as err:
                build({field: value})
            assert reason in str(err.value) and "unknown" not in str(err.value), field
        # the value that means what brisk does is accepted
        assert _through_yaml(tmp_path, {field: REFUSED_DEFAULTS[field]}, "config")
    # `brisk serve --config FILE`: one line on stderr, exit code 2
    path = tmp_path / "uvm.yaml"
    path.write_text("kv_cache_config:\n  use_uvm: true\n")
    assert main(["serve", DEMO, "--config", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("brisk serve: error:") and "unified memory" in err and len(err.splitlines()) == 1


def test_max_tokens_and_max_gpu_total_bytes_bound_the_pool():
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(20, 120))
    with LLM(DEMO, device="cpu", max_seq_len=256, kv_cache_config={"max_blocks": 64}) as big:
        groups, block = big.engine.num_kv_groups, big.engine.kv.block_size
        per_block = big.engine.executor.runner.kv_layout.bytes_per_block
        expected = big.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        assert big.engine.num_kv_blocks == 64
    # max_tokens in every group plus the null block; the smaller bound wins over max_blocks
    with LLM(DEMO, device="cpu", max_seq_len=256, kv_cache_config={"max_blocks": 64, "max_tokens": 256}) as llm:
        assert llm.engine.num_kv_blocks == groups * cdiv(256, block) + 1 < 64
        assert llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids == expected
    with LLM(DEMO, device="cpu", max_seq_len=256, kv_cache_config={"max_gpu_total_bytes": 30 * per_block + 7}) as llm:
        assert llm.engine.num_kv_blocks == 30
        assert llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids == expected
    kv = EngineConfig.build(DEMO, kv_cache_config={"max_tokens": 100, "max_gpu_total_bytes": 10 * per_block})
    assert kv.kv_cache_config.block_limit(per_block, (32, 32)) == 9  # 2 * cdiv(100, 32) + 1, under the byte budget's 10
    with pytest.raises(ConfigError, match="kv_cache_config.max_tokens"):
        EngineConfig.build(DEMO, kv_cache_config={"max_tokens": 0})


def _host_hits(priority: int | None) -> tuple[int, list[list[int]], bool]:
    """Three 96-token prompts through a pool that holds one at a time, then the first again: the host tier's hit
    tokens, the outputs, and whether the engine has a host tier at all."""
    kv = {"max_blocks": 10, "host_cache_size": 1 << 20, "secondary_offload_min_priority": priority}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[10 + (7 * i + j) % 3000 for j in range(96)] for i in range(3)] + [None]
    prompts[3] = prompts[0]
    with LLM(DEMO, device="cpu", max_seq_len=128, max_batch_size=1, kv_cache_config=kv) as llm:
        outputs = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
        return llm.engine.stats().host_hits, outputs, llm.engine.kv.host_tier is not None


def test_secondary_offload_min_priority_decides_what_goes_to_the_host_tier(caplog):
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        below = _host_hits(DEFAULT_RETENTION_PRIORITY - 1)
        at = _host_hits(DEFAULT_RETENTION_PRIORITY)
    unset = _host_hits(None)
    assert below[2] and unset[2] and not at[2]  # from the default priority up, no host tier
    assert below[0] > 0 and below[0] == unset[0]  # the first prompt came back from the host tier
    assert at[0] == 0
    assert below[1] == at[1] == unset[1]  # the same tokens either way
    assert f"secondary_offload_min_priority {DEFAULT_RETENTION_PRIORITY}: " in caplog.text
    assert "none may go to the host tier: it is off" in caplog.text


def test_onboard_blocks(caplog):
    with pytest.raises(ConfigError, match="always copied back"):
        EngineConfig.build(DEMO, kv_cache_config={"onboard_blocks": False, "host_cache_size": 1 << 20})
    with pytest.raises(ConfigError, match="always copied back"):
        EngineConfig.build(DEMO, kv_offloading_size=0.5, kv_cache_config={"onboard_blocks": False})
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        assert not EngineConfig.build(
            DEMO, device="cpu", kv_cache_config={"onboard_blocks": False}
        ).kv_cache_config.onboard_blocks
    assert "onboard_blocks false: there is no host KV tier" in caplog.text


def test_a_trtllm_kv_cache_config_serves(tmp_path):
    """`brisk serve --extra_llm_api_options` with every no-effect key and the implemented ones: it starts, says
    what each does at start-up, and answers."""
    kv = {field: value for field, (value, _) in NO_EFFECT.items()}
    kv.update(max_tokens=512, secondary_offload_min_priority=0, host_cache_size=1 << 20, onboard_blocks=True)
    path = tmp_path / "trtllm.yaml"
    path.write_text(yaml.safe_dump({"kv_cache_config": kv}))
    server = RunningServer(DEMO, "--extra_llm_api_options", str(path), "--max_seq_len", "256")
    try:
        body = {"model": DEMO, "prompt": "hello there", "max_tokens": 4}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    log = Path(server.log_path).read_text()
    for field in NO_EFFECT:
        assert f"kv_cache_config.{field} " in log, field
    assert "secondary_offload_min_priority 0: every evicted block may go to the host tier" in log
