"""The option table: every spelling resolves to its option, unknown keys fail with a "did you mean", docs/options.md
matches the code, and every option has a test of its effect (or of its documented no-effect): here, or in the
test named for it in OPTION_TESTS."""

from __future__ import annotations

import ast
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from brisk import LLM, SamplingParams
from brisk.cli import build_parser
from brisk.config import (
    OPTIONS,
    ConfigError,
    EngineConfig,
    build_serve_configs,
)
from brisk.kv_cache.config import KvCacheConfig
from brisk.option_groups import CudaGraphConfig
from brisk.options import OptionError
from brisk.peer_options import ANY, PEER_OPTIONS
from brisk.sampling_params import InvalidRequest
from brisk.server.protocol import ChatCompletionRequest, CompletionRequest
from brisk.server.serve import observability_for, response_store_for
from brisk.server_config import ServerConfig
from tests.test_kv_cache_config_fields import NO_EFFECT as KV_NO_EFFECT
from tests.test_kv_cache_config_fields import REFUSED as KV_REFUSED
from tools.options_doc import DOC, with_table

DEMO = str(Path(__file__).resolve().parents[1] / "brisk" / "demo_model")
TESTS = Path(__file__).resolve().parent


# ---- the table ---------------------------------------------------------------------------------------------------
def test_docs_options_md_matches_the_table():
    text = DOC.read_text()
    assert text == with_table(text), "docs/options.md is out of date: run .venv/bin/python tools/options_doc.py"
    for row in OPTIONS.rows:
        assert f"| `{row.path}` |" in text


def test_every_spelling_of_an_option_sets_it():
    for row in OPTIONS.rows:
        for alias in row.aliases:
            if alias.invert or alias.is_switch or "." in alias.name:
                continue
            for spelled in (alias.name, alias.name.replace("_", "-")):
                resolved = OPTIONS.resolve({spelled: "x"}, "test")[row.model]
                *parents, last = row.path.split(".")
                for part in parents:
                    resolved = resolved[part]
                assert resolved == {last: "x"}, (row.path, spelled)


def test_vllm_and_trtllm_spellings_mean_the_same_config():
    trtllm = EngineConfig.build(
        "m",
        max_batch_size=2,
        max_num_tokens=64,
        max_seq_len=256,
        tp_size=2,
        ep_size=2,
        kv_cache_config={"enable_block_reuse": False, "tokens_per_block": 16},
        disable_overlap_scheduler=False,
        cuda_graph_config=None,
        device="cpu",
    )
    vllm = EngineConfig.build(
        "m",
        max_num_seqs=2,
        max_num_batched_tokens=64,
        max_model_len="256",
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        enable_prefix_caching=False,
        block_size=16,
        async_scheduling=True,
        enforce_eager=True,
        device="cpu",
    )
    keys = ["max_batch_size", "max_num_tokens", "max_seq_len", "tp_size", "ep_size", "kv_cache_config"]
    keys += ["disable_overlap_scheduler", "cuda_graph_config"]
    assert {k: getattr(vllm, k) for k in keys} == {k: getattr(trtllm, k) for k in keys}
    assert EngineConfig.build("m", max_model_len="32k").max_seq_len == 32_000


def test_unknown_keys_name_themselves_with_the_closest_spellings(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown option 'max_num_seq'.*did you mean 'max_num_seqs'"):
        EngineConfig.build("m", max_num_seq=4)
    yaml_path = tmp_path / "o.yaml"
    yaml_path.write_text("kv_cache_config:\n  enable_block_reus: false\n")
    with pytest.raises(ConfigError, match=r"kv_cache_config.enable_block_reus' in .*did you mean 'enable_block_reuse'"):
        EngineConfig.build("m", yaml_path)
    with pytest.raises(ConfigError, match="'port' is an option of brisk serve"):
        EngineConfig.build("m", port=8000)
    with pytest.raises(ConfigError, match="both set option 'max_batch_size'"):
        EngineConfig.build("m", max_batch_size=2, max_num_seqs=3)


def test_unknown_flag_gets_a_did_you_mean(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--max-num-seq=2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "brisk serve: error: unrecognized arguments: --max-num-seq=2 (did you mean --max-num-seqs" in err
    assert err.count("\n") == 1
    with pytest.raises(SystemExit):  # no abbreviations: a typo is never taken for the option it is short of
        build_parser().parse_args(["serve", "--max-num-s", "2"])


def test_bad_value_names_the_option_and_its_spellings():
    with pytest.raises(ConfigError, match=r"option 'max_batch_size' \(max_num_seqs\): .*greater than or equal to 1"):
        EngineConfig.build("m", max_num_seqs=0)


def test_flags_and_files_precedence(tmp_path):
    """--config (vLLM's YAML of flags) < --extra_llm_api_options (trtllm's keys) < flags, option by option."""
    vllm_yaml = tmp_path / "vllm.yaml"
    vllm_yaml.write_text("max-num-seqs: 3\nblock-size: 16\nport: 9001\nenable-prefix-caching: false\n")
    trtllm_yaml = tmp_path / "trtllm.yaml"
    trtllm_yaml.write_text("max_batch_size: 5\nkv_cache_config:\n  max_blocks: 64\n")
    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(vllm_yaml),
            "--extra_llm_api_options",
            str(trtllm_yaml),
            "--max-num-batched-tokens",
            "99",
        ]
    )
    engine, server = build_serve_configs(None, OPTIONS.given(args), default_model=DEMO)
    assert (engine.max_batch_size, engine.max_num_tokens, engine.block_size, server.port) == (5, 99, 16, 9001)
    assert engine.kv_cache_config.max_blocks == 64 and not engine.enable_prefix_caching


def test_switches_and_inverted_spellings():
    parse = build_parser().parse_args
    given = OPTIONS.given(parse(["serve", "--enforce-eager", "--no-async-scheduling", "--no-enable-prefix-caching"]))
    engine, _ = build_serve_configs(None, given, default_model=DEMO)
    assert engine.cuda_graph_config is None and engine.disable_overlap_scheduler is True
    assert not engine.enable_prefix_caching
    engine, _ = build_serve_configs(None, OPTIONS.given(parse(["serve", "--async-scheduling"])), default_model=DEMO)
    assert engine.disable_overlap_scheduler is False and engine.cuda_graph_config is not None
    _, server = build_serve_configs(None, OPTIONS.given(parse(["serve", "--enable-log-requests"])), default_model=DEMO)
    assert server.disable_log_requests is False


def test_enable_and_disable_spell_each_other_as_in_vllm_0_33(tmp_path):
    """vLLM 0.33 pairs --enable-x with --disable-x (and still takes --no-enable-x): every switch of brisk's (and every
    peer switch it refuses or accepts) takes the inverse spelling too, on the command line and as a key of vLLM's
    --config file, unless that spelling is an option of its own."""
    parse = build_parser().parse_args
    flags = ["serve", "--disable-prefix-caching", "--disable-chunked-prefill", "--enable-fastapi-docs"]
    engine, server = build_serve_configs(None, OPTIONS.given(parse(flags)), default_model=DEMO)
    assert not engine.enable_prefix_caching and not engine.enable_chunked_prefill
    assert server.disable_fastapi_docs is False
    engine, server = build_serve_configs(
        None, OPTIONS.given(parse(["serve", "--enable-chunked-prefill", "--disable-fastapi-docs"])), default_model=DEMO
    )
    assert engine.enable_chunked_prefill and server.disable_fastapi_docs is True
    # --enable-log-requests has its own option (brisk's) and --disable-log-requests its own (vLLM's old flag)
    _, server = build_serve_configs(None, OPTIONS.given(parse(["serve", "--disable-log-requests"])), default_model=DEMO)
    assert server.disable_log_requests is True
    # a peer's switch: the false spelling is accepted, the true one refused with its reason
    build_serve_configs(None, OPTIONS.given(parse(["serve", "--disable-sleep-mode"])), default_model=DEMO)
    with pytest.raises(ConfigError, match="sleep mode"):
        build_serve_configs(None, OPTIONS.given(parse(["serve", "--enable-sleep-mode"])), default_model=DEMO)
    vllm_yaml = tmp_path / "vllm.yaml"
    vllm_yaml.write_text("disable-prefix-caching: true\nenable-fastapi-docs: false\n")
    engine, server = build_serve_configs(
        None, OPTIONS.given(parse(["serve", "--config", str(vllm_yaml)])), default_model=DEMO
    )
    assert not engine.enable_prefix_caching and server.disable_fastapi_docs is True


# ---- the peers' options: vLLM's and trtllm-serve's every flag is known -------------------------------------------
PEER_FLAGS = TESTS / "data" / "peer_flags"


def _serve_flags() -> set[str]:
    serve = build_parser()._subparser("serve")  # type: ignore[attr-defined]
    return {s for action in serve._actions for s in action.option_strings}


def test_every_flag_of_vllm_releases_since_gpt_oss_is_known():
    """A command line written for an earlier vLLM (0.10.1, gpt-oss's first, to 0.32) works unchanged: each flag
    those releases had and 0.33 dropped is known too (tools/peer_flags_releases.py lists them)."""
    known = _serve_flags()
    releases = json.loads((PEER_FLAGS / "vllm_serve_releases.json").read_text())
    assert releases["vllm"][0] == "0.10.1.1" and len(releases["vllm"]) > 20
    flags = [flag for spellings, _, _ in releases["flags"] for flag in spellings]
    assert len(flags) > 40 and "--swap-space" in flags
    assert [flag for flag in flags if flag not in known] == []
    # what each means here: no effect where vLLM's V1 engine ignored it too, the same option, or refused with a reason
    for argv, expect in (
        (["--swap-space", "16", "--disable-frontend-multiprocessing", "--max-seq-len-to-capture", "8192"], {}),
        (["--calculate-kv-scales", "--kv-cache-dtype", "fp8", "--num-lookahead-slots", "0"], {"kv_cache_dtype": "fp8"}),
        (["--guided-decoding-disable-any-whitespace"], {"disable_any_whitespace": True}),
        (["--guided-decoding-disable-fallback", "--guided-decoding-disable-additional-properties"], {}),
        (["--no-guided-decoding-disable-any-whitespace"], {"disable_any_whitespace": False}),
        (["--task", "generate", "--preemption-mode", "recompute", "--max-num-partial-prefills", "1"], {}),
        (["--preemption-mode", "swap"], "brisk preempts by recompute"),
        (["--task", "embed"], "generative models only"),
        (["--max-num-partial-prefills", "4"], "give that"),
        (["--enable-bf16x3-router-gemm"], "router multiplies in the model's dtype"),
        (["-O", '{"cudagraph_capture_sizes": [1, 2, 4]}'], {"graph_sizes": [1, 2, 4]}),  # <= 0.11: -O's JSON
        (["--rope-theta", "1e6"], "config.json as it is"),
    ):
        given = OPTIONS.given(build_parser().parse_args(["serve", *argv]))
        if isinstance(expect, str):
            with pytest.raises(ConfigError, match=re.escape(expect)):
                build_serve_configs(None, given, default_model=DEMO)
            continue
        engine, _ = build_serve_configs(None, given, default_model=DEMO)
        if "kv_cache_dtype" in expect:
            assert engine.kv_cache_config.dtype == expect["kv_cache_dtype"]
        if "disable_any_whitespace" in expect:
            assert engine.structured_outputs_config.disable_any_whitespace is expect["disable_any_whitespace"]
        if "graph_sizes" in expect:
            assert engine.cuda_graph_config is not None
            assert engine.cuda_graph_config.batch_sizes == expect["graph_sizes"]


def test_every_flag_of_vllm_serve_and_trtllm_serve_is_known():
    """Each flag is an option of brisk's or a peer's option it refuses with a reason: never "unrecognized"."""
    known = _serve_flags()
    vllm = json.loads((PEER_FLAGS / "vllm_serve.json").read_text())
    trtllm = [line.split() for line in (PEER_FLAGS / "trtllm_serve.txt").read_text().splitlines()]
    groups = vllm["flags"] + [group for group in trtllm if group and not group[0].startswith("#")]
    assert len(groups) > 300
    unknown = [flag for group in groups for flag in group if flag not in known]
    assert unknown == []  # every spelling: --no-enforce-eager, -sc, -ep, -dcp...


def test_a_command_line_stating_vllms_defaults_starts_brisk():
    """Launchers and deployment charts write every flag out: each of vLLM 0.33's flags at its default value
    (tools/peer_flags.py wrote them, each read back to the default by vLLM's own parser) is accepted, alone and all
    on one command line; where vLLM's default differs from brisk's, the option takes vLLM's value."""
    stated = json.loads((PEER_FLAGS / "vllm_serve_defaults.json").read_text())
    assert stated["vllm"] == "0.33.0" and len(stated["argv"]) > 150
    refused = {}
    for words in stated["argv"]:
        try:
            build_serve_configs(None, OPTIONS.given(build_parser().parse_args(["serve", *words])), default_model=DEMO)
        except ConfigError as error:
            refused[" ".join(words)] = str(error)
    assert refused == {}
    everything = [word for words in stated["argv"] for word in words]
    engine, server = build_serve_configs(
        None, OPTIONS.given(build_parser().parse_args(["serve", *everything])), default_model=DEMO
    )
    assert engine.seed == 0 and engine.max_logprobs == 20 and engine.kv_cache_config.dtype == "auto"
    assert server.port == 8000 and server.fingerprint_mode == "full" and server.reasoning_parser is None
    # vLLM's defaults where brisk's differ: the tools shown under tool_choice none, no prompt_tokens_details, no
    # drain at shutdown
    assert server.exclude_tools_when_tool_choice_none is False and server.enable_prompt_tokens_details is False
    assert server.shutdown_timeout == 0
    # the same values in a YAML file (--config), where a number may be written either way
    assert OPTIONS.resolve({"dp-supervisor-probe-interval-s": 5, "master_port": 29501}, "test")[EngineConfig] == {}
    with pytest.raises(OptionError, match="one node"):
        OPTIONS.resolve({"master-port": 29502}, "test")


def test_null_is_unset_as_the_peers_dumps_of_their_args_write_it(tmp_path):
    """TensorRT-LLM's LLM API and vLLM leave an option unset as null (a dump of TorchLlmArgs holds max_batch_size:
    null, kv_cache_config.free_gpu_memory_fraction: null): null for an option brisk's cannot be null is its default;
    a peer's option given null asks for nothing; a part of a group that is off, given null, sets nothing. Where null
    means something (max_seq_len: the model's), it keeps that meaning."""
    default = EngineConfig.build("m")
    nulls = {
        "max_batch_size": None,
        "max_num_tokens": None,
        "moe_expert_parallel_size": None,
        "backend": None,
        "kv_cache_config": {"free_gpu_memory_fraction": None, "enable_block_reuse": None},
        "max_beam_width": None,  # peers' options
        "lora_config": None,
        "enable_lora": None,
        "use_cuda_graph": False,  # TensorRT-LLM <= 1.0rc1: no graphs, and the other parts at their defaults
        "cuda_graph_batch_sizes": None,
        "cuda_graph_max_batch_size": 0,
        "cuda_graph_padding_enabled": False,
    }
    (tmp_path / "extra.yaml").write_text(yaml.safe_dump(nulls))
    for config in (EngineConfig.build("m", **nulls), EngineConfig.build("m", config=str(tmp_path / "extra.yaml"))):
        assert (config.max_batch_size, config.max_num_tokens) == (default.max_batch_size, default.max_num_tokens)
        assert (config.ep_size, config.backend) == (default.ep_size, default.backend)
        assert config.kv_cache_config == default.kv_cache_config and config.cuda_graph_config is None
    assert EngineConfig.build("m", max_seq_len=None).max_seq_len is None
    with pytest.raises(ConfigError, match="max_beam_width"):
        EngineConfig.build("m", max_beam_width=4)
    # The same keys with graphs off in the other order (the parts first) give the same config...
    assert EngineConfig.build("m", cuda_graph_max_batch_size=0, use_cuda_graph=False).cuda_graph_config is None
    # ... and a part that asks for something is refused in either order, never dropped.
    with pytest.raises(ConfigError, match="sets a part of 'cuda_graph_config', which is null there"):
        EngineConfig.build("m", use_cuda_graph=False, cuda_graph_max_batch_size=8)
    for options in (
        {"cuda_graph_max_batch_size": 8, "use_cuda_graph": False},
        {"max_cudagraph_capture_size": 8, "enforce_eager": True},
    ):
        first = next(iter(options))
        with pytest.raises(ConfigError, match=f"sets 'cuda_graph_config' to null, and '{first}' sets a part of it"):
            EngineConfig.build("m", **options)


def test_system_fingerprint_names_the_parallel_layout_and_hashes_the_options():
    from brisk.server.state import system_fingerprint

    layout = EngineConfig.build("m", tp_size=2, enable_expert_parallel=True)
    full = system_fingerprint(layout, ServerConfig())
    assert full is not None and re.fullmatch(r"brisk-[0-9.]+-tp2-ep-[0-9a-f]{8}", full)
    assert (
        system_fingerprint(layout, ServerConfig(fingerprint_mode="hash"))
        == f"{full.split('-')[0]}-{full.split('-')[1]}-{full[-8:]}"
    )
    plain = system_fingerprint(EngineConfig.build("m"), ServerConfig())
    assert plain == system_fingerprint(EngineConfig.build("m"), ServerConfig())  # the same on every start
    fp8 = system_fingerprint(EngineConfig.build("m", kv_cache_config={"dtype": "fp8"}), ServerConfig())
    assert len({full[-8:], plain, fp8}) == 3  # an option that changes tokens changes the hash
    assert system_fingerprint(layout, ServerConfig(fingerprint_mode="none")) is None
    custom = ServerConfig(fingerprint_mode="custom", fingerprint_value="fp_x")
    assert system_fingerprint(layout, custom) == "fp_x"
    for given in ({"fingerprint_mode": "custom"}, {"fingerprint_value": "fp_x"}):
        with pytest.raises(ConfigError, match="fingerprint_value goes with fingerprint_mode custom"):
            build_serve_configs(None, given, default_model=DEMO)


TRTLLM_CONFIGS = TESTS / "data" / "trtllm_gpt_oss_configs"


@pytest.mark.parametrize("name", sorted(p.name for p in TRTLLM_CONFIGS.glob("*.yaml")))
def test_trtllms_own_gpt_oss_configs_load(name, caplog):
    """TensorRT-LLM's curated and database gpt-oss-120b configs (verbatim) load; their TensorRT-LLM-only knobs are
    logged at start-up as having no effect."""
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        engine = EngineConfig.build("m", TRTLLM_CONFIGS / name, device="cpu")
    assert engine.stream_interval == 20 and engine.cuda_graph_config is not None
    if "attention_dp_config" in (TRTLLM_CONFIGS / name).read_text():
        assert engine.enable_attention_dp and "attention_dp_config" in caplog.text and "no effect" in caplog.text
    if "env_overrides" in (TRTLLM_CONFIGS / name).read_text():
        assert "env_overrides" in caplog.text and "no effect" in caplog.text
    if "num_postprocess_workers" in (TRTLLM_CONFIGS / name).read_text():  # a server option, offline: logged
        assert "num_postprocess_workers (from an options file): an option of brisk serve" in caplog.text
    with pytest.raises(ConfigError, match="HF_HOME: brisk reads no settings from environment variables"):
        EngineConfig.build("m", env_overrides={"HF_HOME": "/x", "TRTLLM_ENABLE_PDL": 1})


def test_every_key_of_trtllms_llm_api_is_known():
    """An extra_llm_api_options file may hold any key of TensorRT-LLM's TorchLlmArgs: each is an option, or a peer's
    option accepted with the value that means what brisk does and refused with its reason otherwise."""
    lines = (PEER_FLAGS / "trtllm_llm_args.txt").read_text().splitlines()
    keys = [line for line in lines if line and not line.startswith("#")]
    assert len(keys) > 100 and "kv_cache_config" in keys
    assert [key for key in keys if not OPTIONS.knows(key)] == ["model"]  # MODEL is brisk serve's argument
    with pytest.raises(OptionError, match="holds none back"):
        OPTIONS.resolve({"batch_wait_timeout_iters": 20}, "test")
    accepted = {"scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION"}, "enable_autotuner": False}
    assert OPTIONS.resolve(accepted, "test")[EngineConfig] == {}
    assert OPTIONS.resolve({"num_serve_frontends": 2}, "test")[ServerConfig] == {"api_server_count": 2}


TRTLLM_EARLIER = TESTS / "data" / "trtllm_earlier_configs"


def test_every_key_of_trtllms_earlier_releases_is_known():
    """An options file written for TensorRT-LLM 0.19 to 1.2 (pytorch_backend_config, the flat keys before
    cuda_graph_config and moe_config, their sampler switches...) loads: each key those releases had is known."""
    lines = (PEER_FLAGS / "trtllm_llm_args_releases.txt").read_text().splitlines()
    keys = [line for line in lines if line and not line.startswith("#")]
    assert len(keys) > 60 and "pytorch_backend_config.enable_overlap_scheduler" in keys
    # speculative_config's keys are its model's (tests/test_spec_decode_config.py); the others are the table's
    assert [k for k in keys if not k.startswith("speculative_config.") and not OPTIONS.knows(k)] == []
    assert not OPTIONS.knows("pytorch_backend_config.no_such_key") and not OPTIONS.knows("moe_config.no_such_key")


def test_trtllms_earlier_options_files_load_as_their_releases_meant(caplog):
    with caplog.at_level(logging.INFO, logger="brisk"):
        eagle = EngineConfig.build("m", TRTLLM_EARLIER / "gpt_oss_eagle3_trtllm_1.1.yaml", device="cpu")
        spec = eagle.speculative_config
        assert spec is not None and (spec.decoding_type, spec.max_draft_len) == ("Eagle3", 3)
        assert spec.speculative_model_dir == "/models/gpt-oss-120b-eagle3"
        assert eagle.cuda_graph_config is not None and eagle.cuda_graph_config.max_batch_size == 8
        assert eagle.enable_attention_dp and not eagle.enable_prefix_caching

        nested = EngineConfig.build("m", TRTLLM_EARLIER / "pytorch_backend_config_trtllm_0.20.yaml", device="cpu")
        assert nested.disable_overlap_scheduler is False  # enable_overlap_scheduler: true
        assert nested.cuda_graph_config == CudaGraphConfig(batch_sizes=[1, 2, 4, 8, 64], enable_padding=True)
        assert nested.kv_cache_config.dtype == "fp8" and nested.max_batch_size == 64

        caplog.clear()
        flat = EngineConfig.build("m", TRTLLM_EARLIER / "flat_keys_trtllm_1.0rc.yaml", device="cpu")
        assert flat.cuda_graph_config == CudaGraphConfig(max_batch_size=32, enable_padding=False)
        assert flat.disable_overlap_scheduler is True and flat.print_iter_log and flat.stream_interval == 4
        assert flat.enable_mixed_sampler and flat.moe_config.max_num_tokens == 8192
        assert "moe_config.max_num_tokens 8192: no effect" in caplog.text

        caplog.clear()
        switches = {"disable_finalize_fusion": True, "use_low_precision_moe_combine": True}
        assert EngineConfig.build("m", moe_config=switches).moe_config.use_low_precision_moe_combine
        assert "moe_config.disable_finalize_fusion true: no effect" in caplog.text
        assert "moe_config.use_low_precision_moe_combine true: no effect" in caplog.text
    # use_cuda_graph false is no graphs; a group's earlier key name; two spellings that disagree; refusals
    assert EngineConfig.build("m", use_cuda_graph=False).cuda_graph_config is None
    assert EngineConfig.build("m", use_cuda_graph=True).cuda_graph_config == CudaGraphConfig()
    padded = EngineConfig.build("m", cuda_graph_config={"padding_enabled": False}).cuda_graph_config
    assert padded is not None and padded.enable_padding is False
    for options, message in (
        (
            {"cuda_graph_max_batch_size": 8, "cuda_graph_config": {"max_batch_size": 16}},
            "both set option 'cuda_graph_config.max_batch_size'",
        ),
        (
            {"pytorch_backend_config": {"use_cuda_graph": False}, "cuda_graph_config": {"max_batch_size": 8}},
            "'pytorch_backend_config.use_cuda_graph' and 'cuda_graph_config' .* both set option 'cuda_graph_config'",
        ),
        ({"pytorch_backend_config": {"use_kv_cache": False}}, "pytorch_backend_config.use_kv_cache.*always keeps"),
        ({"pytorch_backend_config": {"no_such_key": 1}}, "unknown option 'pytorch_backend_config.no_such_key'"),
        ({"pytorch_backend_config": 3}, "holds options by name: give a mapping"),
        ({"moe_load_balancer": {"num_slots": 8}}, "places experts statically"),
        ({"backend": "trt"}, "brisk has no tensorrt engine"),
        ({"sampler_type": "TRTLLMSampler", "batching_type": "STATIC"}, "static batching is not available"),
        ({"quant_config": {"quant_algo": "FP8"}}, "quantization from the checkpoint"),
    ):
        with pytest.raises(ConfigError, match=message):
            EngineConfig.build("m", **options)


def test_a_peers_option_is_refused_with_its_reason_unless_it_means_what_brisk_does():
    for peer in PEER_OPTIONS:
        name = peer.names[0]
        if peer.accepted != ANY:
            with pytest.raises(OptionError, match=re.escape(peer.reason)):
                OPTIONS.resolve({name: "something else"}, "test")
        for value in peer.accepted if peer.accepted != ANY else ("anything",):
            given = value == "true" if value in ("true", "false") else value
            assert OPTIONS.resolve({name: given}, "test")[EngineConfig] == {}, name
    # on the command line: one line naming the reason, exit code 2 (a switch's --no- spelling is brisk's behaviour)
    for argv, fails in (
        (["serve", "--enable-lora"], True),
        (["serve", "--lora-modules", "sql=/adapters/sql", "--port", "8001"], True),
        (["serve", "-q", "fp8"], True),
        (["serve", "--tokenizer-mode", "mistral"], True),
        (["serve", "--no-enable-lora", "--tokenizer-mode", "auto", "-q", "mxfp4", "--use-tqdm-on-load"], False),
    ):
        given = OPTIONS.given(build_parser().parse_args(argv))
        if fails:
            with pytest.raises(ConfigError, match="brisk"):
                build_serve_configs(None, given, default_model=DEMO)
        else:
            build_serve_configs(None, given, default_model=DEMO)
    assert "--enable-lora" not in build_parser()._subparser("serve").format_help()  # type: ignore[attr-defined]


def test_peers_options_in_yaml_files_and_keyword_arguments(tmp_path):
    (tmp_path / "vllm.yaml").write_text("enable-sleep-mode: true\n")
    with pytest.raises(ConfigError, match="no sleep mode"):
        EngineConfig.build("m", config=str(tmp_path / "vllm.yaml"))
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        EngineConfig.build("m", enable_lora=True, max_loras=4)
    assert EngineConfig.build("m", enable_lora=False, scheduling_policy="fcfs").max_batch_size == 256
    # brisk orders waiting requests by (priority, arrival): vLLM's "priority" policy (its "fcfs" at priority 0)
    EngineConfig.build("m", scheduling_policy="priority")
    with pytest.raises(ConfigError, match=r"\(priority, arrival\)"):
        EngineConfig.build("m", scheduling_policy="round-robin")


def test_vllm_config_files_spell_a_switch_off_as_no_name(tmp_path):
    """vLLM's --config YAML holds flags by name: `no-enable-prefix-caching: true` is --no-enable-prefix-caching."""
    resolved = OPTIONS.resolve({"no-enable-prefix-caching": True, "no_async_scheduling": True}, "test")[EngineConfig]
    assert resolved == {"kv_cache_config": {"enable_block_reuse": False}, "disable_overlap_scheduler": True}
    assert OPTIONS.resolve({"no-enable-lora": True}, "test")[EngineConfig] == {}
    with pytest.raises(OptionError, match="no LoRA"):
        OPTIONS.resolve({"no-enable-lora": False}, "test")
    for key in ("no-max-num-seqs", "no-such-thing"):  # not a switch: an unknown key
        with pytest.raises(OptionError, match="unknown option"):
            OPTIONS.resolve({key: True}, "test")


def test_vllm_gpt_oss_recipe_files_resolve():
    """The vLLM gpt-oss recipe's YAML files (tests/data/vllm_gpt_oss_recipe/, verbatim) mean brisk's options."""
    recipe = TESTS / "data" / "vllm_gpt_oss_recipe"
    hopper = EngineConfig.build("m", config=str(recipe / "GPT-OSS_Hopper.yaml"))
    assert not hopper.enable_prefix_caching and hopper.max_num_tokens == 8192 and hopper.stream_interval == 20
    assert hopper.cuda_graph_config is not None and hopper.cuda_graph_config.max_batch_size == 2048
    assert EngineConfig.build("m", config=str(recipe / "GPT-OSS_Blackwell.yaml")).kv_cache_config.dtype == "fp8"
    older = EngineConfig.build("m", config=str(recipe / "GPT-OSS_Hopper_v0.10.yaml"))
    assert older.cuda_graph_config is not None and older.cuda_graph_config.max_batch_size == 2048
    assert older.compilation_config == {"cudagraph_mode": "PIECEWISE"} and older.max_seq_len == 10240
    assert older.disable_overlap_scheduler is False
    eagle = EngineConfig.build("m", config=str(recipe / "GPT-OSS_EAGLE3_Hopper.yaml"))
    spec = eagle.speculative_config
    assert spec is not None and (spec.decoding_type, spec.max_draft_len) == ("Eagle3", 3)
    assert spec.speculative_model_dir == "nvidia/gpt-oss-120b-Eagle3-v2"


def test_vllm_graph_options_set_the_captured_sizes(caplog):
    """compilation_config (its cudagraph_mode and sizes), cudagraph_capture_sizes, max_cudagraph_capture_size and the
    earlier cuda_graph_sizes set cuda_graph_config; on a CPU the padded static buffers take those sizes."""
    parse = build_parser().parse_args
    flags = OPTIONS.given(parse(["serve", "--cudagraph-capture-sizes", "1", "2", "4", "-cc", '{"mode": 3}', "-O3"]))
    engine, _ = build_serve_configs(None, flags, default_model=DEMO)
    assert engine.cuda_graph_config is not None and engine.cuda_graph_config.batch_sizes == [1, 2, 4]
    build = EngineConfig.build
    assert build("m", max_cudagraph_capture_size=64).cuda_graph_config.max_batch_size == 64  # type: ignore[union-attr]
    assert build("m", cuda_graph_sizes=[1, 3]).cuda_graph_config.batch_sizes == [1, 3]  # type: ignore[union-attr]
    assert build("m", cuda_graph_sizes=48).cuda_graph_config.max_batch_size == 48  # type: ignore[union-attr]
    assert build("m", compilation_config='{"cudagraph_mode": "NONE"}').cuda_graph_config is None
    sized = build("m", compilation_config={"cudagraph_capture_sizes": [2, 6], "max_cudagraph_capture_size": 6})
    assert sized.cuda_graph_config is not None and sized.cuda_graph_config.batch_sizes == [2, 6]
    with pytest.raises(ConfigError, match="give one of them"):
        build("m", compilation_config={"cudagraph_capture_sizes": [2]}, cudagraph_capture_sizes=[4])
    with pytest.raises(ConfigError, match="cudagraph_mode"):
        build("m", compilation_config={"cudagraph_mode": "SOMETIMES"})
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        EngineConfig.build(
            "m", compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "pass_config": {}}, device="cpu"
        )
    assert "cudagraph_mode FULL_DECODE_ONLY: brisk captures whole decode steps" in caplog.text
    assert "pass_config: no effect" in caplog.text
    with LLM(DEMO, max_seq_len=128, device="cpu", compilation_config={"cudagraph_capture_sizes": [1, 3]}) as llm:
        assert llm.engine.executor.runner.graphs.sizes == [1, 3]
        out = llm.generate(PROMPTS[:3], GREEDY)  # three requests: one padded step of 3 rows
    with LLM(DEMO, max_seq_len=128, device="cpu") as plain:
        assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], GREEDY)] == [
            o.outputs[0].token_ids for o in out
        ]


def test_vllm_dotted_json_flags():
    """vLLM's dotted form of a JSON option: each KEY VALUE (or KEY=VALUE) of one flag merged into its JSON."""
    args = [
        "serve",
        "--speculative-config.method",
        "ngram",
        "--speculative-config.num_speculative_tokens=3",
        "-cc.cudagraph_mode=NONE",
        "-cc.pass_config.fuse_rope_kvcache=True",
        "--max-model-len=2k",
    ]
    engine, _ = build_serve_configs(None, OPTIONS.given(build_parser().parse_args(args)), default_model=DEMO)
    assert engine.speculative_config is not None and engine.speculative_config.max_draft_len == 3
    assert engine.cuda_graph_config is None and engine.max_seq_len == 2000
    assert engine.compilation_config == {"cudagraph_mode": "NONE", "pass_config": {"fuse_rope_kvcache": "True"}}
    with pytest.raises(SystemExit, match="either as JSON or in its dotted form"):
        build_parser().parse_args(["serve", "-cc", "{}", "-cc.mode", "3"])


def test_vllm_human_readable_numbers():
    """vLLM's spellings: 32k is 32,000 and 32K is 32,768 (for --max-model-len and --kv-cache-memory-bytes)."""
    assert EngineConfig.build("m", max_model_len="32K").max_seq_len == 32_768
    assert EngineConfig.build("m", max_model_len="25.6k").max_seq_len == 25_600
    kv = EngineConfig.build("m", kv_cache_memory_bytes="1G").kv_cache_config
    assert kv.max_gpu_total_bytes == 2**30
    flags = OPTIONS.given(
        build_parser().parse_args(["serve", "--kv-cache-memory-bytes", "2g", "--max-model-len", "4K"])
    )
    engine, _ = build_serve_configs(None, flags, default_model=DEMO)
    assert (engine.kv_cache_config.max_gpu_total_bytes, engine.max_seq_len) == (2 * 10**9, 4096)
    with pytest.raises(ConfigError, match="max_seq_len"):
        EngineConfig.build("m", max_model_len="1.5K")


def test_vllm_attention_backends_and_block_count(caplog):
    def backend(name: str) -> str:  # as validated, before a CPU runs its own paths instead of triton (logged)
        return EngineConfig(
            model="m", **OPTIONS.resolve({"attention-backend": name}, "test")[EngineConfig]
        ).attn_backend

    assert [backend(n) for n in ("TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "CPU_ATTN")] == [
        "triton",
        "auto",
        "auto",
        "cpu",
    ]
    with LLM(DEMO, max_seq_len=128, device="cpu", attention_backend="TORCH_SDPA", num_gpu_blocks_override=24) as llm:
        assert type(llm.engine.executor.runner.kernels.attention).__name__ == "TorchAttentionBackend"
        assert llm.engine.num_kv_blocks == 24
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        EngineConfig.build("m", disable_log_stats=True, optimization_level="3", device="cpu")
    assert "disable_log_stats true: no effect" in caplog.text and "optimization_level 3: no effect" in caplog.text
    _, server = build_serve_configs(None, {"disable_uvicorn_access_log": True}, default_model=DEMO)
    assert server.disable_log_requests is True


# ---- effects: the engine (offline LLM on the demo model) -----------------------------------------------------
VLLM_OPTIONS = dict(
    max_num_seqs=2,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=16,
    enable_prefix_caching=False,
    max_logprobs=3,
    enable_logging_iteration_details=True,  # vLLM's spelling of print_iter_log
    enable_mixed_sampler=False,
    trust_remote_code=True,
    dtype="float",  # vLLM's name of float32
    device="cpu",
)


@pytest.fixture(scope="module")
def vllm_llm():
    with LLM(DEMO, **VLLM_OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def default_llm():
    with LLM(DEMO, max_seq_len=256, device="cpu", dtype="float32") as llm:
        yield llm


ITERATION = re.compile(r"iteration \d+: (\d+) tokens, (\d+) requests running, (\d+) waiting")


def _step_tokens(caplog) -> list[int]:
    return [int(m.group(1)) for m in (ITERATION.search(r.message) for r in caplog.records) if m]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["To be, or not to be", "Now is the winter of our discontent", "Friends, Romans", "O Romeo, Romeo"]


def test_max_num_seqs_batched_tokens_and_iteration_log(vllm_llm, caplog):
    with caplog.at_level(logging.INFO, logger="brisk.engine.core"):
        vllm_llm.generate(PROMPTS, GREEDY)
    steps = [tuple(map(int, m.groups())) for m in (ITERATION.search(r.message) for r in caplog.records) if m]
    assert steps, "print_iter_log logs a line per step"
    assert max(running for _, running, _ in steps) == 2  # 4 requests, at most 2 at once
    assert max(waiting for _, _, waiting in steps) >= 1
    assert max(tokens for tokens, _, _ in steps) <= 64


@pytest.mark.parametrize("chunked, first_step", [(True, 128), (False, 100)])
def test_chunked_prefill_switch(chunked, first_step, caplog):
    """Two 100-token prompts, a 128-token budget: chunked prefill fills the first step with a chunk of the second
    prompt; without it the second prompt waits for a step of its own."""
    options = dict(max_num_tokens=128, max_seq_len=128, enable_chunked_prefill=chunked, print_iter_log=True)
    with LLM(DEMO, device="cpu", **options) as llm, caplog.at_level(logging.INFO, logger="brisk.engine.core"):
        llm.generate([{"prompt_token_ids": [7] * 100}] * 2, SamplingParams(max_tokens=1))
    assert _step_tokens(caplog)[0] == first_step


def test_max_model_len_and_block_size(vllm_llm):
    assert vllm_llm.engine.max_seq_len == 256 and vllm_llm.engine.kv.block_size == 16
    with pytest.raises(InvalidRequest, match="maximum context length is 256 tokens"):
        vllm_llm.generate({"prompt_token_ids": [5] * 250}, SamplingParams(max_tokens=10))


def test_prefix_caching_off_gives_no_hits(vllm_llm, default_llm):
    prompt = " ".join(PROMPTS * 4)  # several blocks long
    for llm in (vllm_llm, default_llm):
        llm.generate([prompt], GREEDY)
        llm.generate([prompt], GREEDY)
    assert vllm_llm.engine.stats().prefix_hits == 0
    assert default_llm.engine.stats().prefix_hits > 0


def test_max_logprobs(vllm_llm):
    out = vllm_llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, logprobs=3))
    assert len(out[0].outputs[0].logprobs[0]) >= 3
    with pytest.raises(InvalidRequest, match="max_logprobs"):
        vllm_llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, logprobs=4))
    with pytest.raises(InvalidRequest, match="max_logprobs"):
        vllm_llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, prompt_logprobs=5))


def test_dtype_spelled_the_vllm_way(vllm_llm):
    assert vllm_llm.engine.model_config.dtype == torch.float32


def test_mixed_sampler_off_still_samples_each_request_with_its_own_parameters(vllm_llm, default_llm):
    """enable_mixed_sampler: false is documented as no effect: a greedy request batched with sampled ones gets
    the tokens it gets alone."""
    hot = SamplingParams(temperature=1.0, top_k=50, max_tokens=12, seed=3)
    mixed = vllm_llm.generate(PROMPTS[:3], [GREEDY, hot, hot])
    alone = default_llm.generate(PROMPTS[0], GREEDY)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids != mixed[0].outputs[0].token_ids


def test_no_effect_options_say_so_at_start_up(caplog):
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        EngineConfig.build("m", enable_mixed_sampler=False, trust_remote_code=True, device="cpu")
    assert "enable_mixed_sampler: brisk always samples each request with its own parameters" in caplog.text
    assert "trust_remote_code: brisk runs no code from checkpoints" in caplog.text


def test_seed_makes_a_fresh_engine_sample_the_same_tokens():
    hot = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)  # no seed of its own

    def sample(seed: int) -> list[int]:
        with LLM(DEMO, seed=seed, max_seq_len=128, device="cpu") as llm:
            return llm.generate(PROMPTS[1], hot)[0].outputs[0].token_ids

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


@pytest.mark.parametrize(
    "options, overlap",
    [({}, False), ({"async_scheduling": True}, True), ({"disable_overlap_scheduler": True}, False)],
)
def test_overlap_scheduling_spelled_either_way(options, overlap):
    with LLM(DEMO, max_seq_len=128, device="cpu", **options) as llm:
        assert llm.engine.overlap is overlap


def test_kv_memory_share_and_fixed_blocks(caplog):
    """On a CPU the KV cache takes kv_cache_free_gpu_memory_fraction of the available RAM, and vLLM's
    gpu_memory_utilization is that same share (the available RAM moves while other processes run: compared with
    the default share, not with each other)."""
    with LLM(DEMO, max_seq_len=2048, device="cpu") as full:
        default_blocks = full.engine.num_kv_blocks
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        for options in ({"kv_cache_free_gpu_memory_fraction": 1e-4}, {"gpu_memory_utilization": 1e-4}):
            with LLM(DEMO, max_seq_len=2048, device="cpu", **options) as small:
                assert small.engine.num_kv_blocks < default_blocks / 10, options
    assert "gpu_memory_utilization 0.0001 on a CPU" in caplog.text
    assert EngineConfig.build("m", device="cpu", gpu_memory_utilization=0.3).memory_fraction == 0.3
    with LLM(DEMO, max_seq_len=128, device="cpu", kv_cache_config={"max_blocks": 40}) as fixed:
        assert fixed.engine.num_kv_blocks == 40
    with pytest.raises(ConfigError, match="give one of them"):
        EngineConfig.build("m", gpu_memory_utilization=0.5, kv_cache_free_gpu_memory_fraction=0.5, device="cpu")


def test_gpu_memory_utilization_on_a_gpu_is_left_to_the_engine(monkeypatch):
    """On a GPU the config touches no GPU for it: a CUDA context in the API process would hold ~0.5 GiB of GPU 0
    for nothing. u goes to the engine, which sizes the pool by vLLM's rule from what it measures
    (tests/test_kv_memory.py)."""

    def no_cuda() -> None:
        raise AssertionError("the config initialised CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    on_gpu, notes = EngineConfig(model="m", gpu_memory_utilization=0.8).on_device("cuda")
    assert on_gpu.gpu_memory_utilization == 0.8
    assert on_gpu.memory_fraction == KvCacheConfig().free_gpu_memory_fraction  # not used: the engine sizes by u
    assert any(n.startswith("gpu_memory_utilization 0.8 (vLLM's sizing)") for n in notes)
    both = EngineConfig(model="m", gpu_memory_utilization=0.5, kv_cache_config={"free_gpu_memory_fraction": 0.5})
    with pytest.raises(ConfigError, match="give one of them"):
        both.on_device("cuda")


def test_kv_cache_dtype():
    assert EngineConfig.build("m", kv_cache_dtype="auto").kv_cache_config.dtype == "auto"
    for fp8 in ("fp8", "fp8_e4m3", "FP8"):
        kv = EngineConfig.build("m", kv_cache_dtype=fp8).kv_cache_config
        assert kv.fp8 and kv.dtype == fp8.lower()
    assert EngineConfig.build("m", kv_cache_config={"dtype": "fp8"}).kv_cache_config.fp8  # trtllm's spelling
    with pytest.raises(ConfigError, match="fp8_e5m2 is not supported: brisk stores .* E4M3"):
        EngineConfig.build("m", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ConfigError, match="kv_cache_config.dtype"):
        EngineConfig.build("m", kv_cache_config={"dtype": "int4"})
    for value, reason in (("nvfp4", "no FP4 KV cache"), ("fp8_inc", "Intel Gaudi"), ("fp8_ds_mla", "no MLA model")):
        with pytest.raises(ConfigError, match=f"{value} is not supported: .*{reason}"):
            EngineConfig.build("m", kv_cache_config={"dtype": value})
    skip = EngineConfig.build("m", kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["sliding_window"])
    assert skip.kv_cache_config.dtype_skip_layers == ["sliding_window"]
    with pytest.raises(ConfigError, match="single layers cannot be skipped"):
        EngineConfig.build("m", kv_cache_dtype_skip_layers=["0"])


def test_kv_cache_dtype_named_as_the_model_dtype():
    """vLLM's --kv-cache-dtype bfloat16: the unquantized cache, which brisk keeps in the model's compute dtype; a
    name other than that dtype is refused rather than ignored."""
    import torch

    from brisk.kv_cache.manager import KVGroupSpec
    from brisk.model_runner.kv_tensors import kv_group_dtypes

    groups = [KVGroupSpec((0,)), KVGroupSpec((1,), sliding_window=128)]
    kv = EngineConfig.build("m", kv_cache_dtype="bfloat16").kv_cache_config
    assert not kv.fp8 and kv_group_dtypes(kv, torch.bfloat16, groups) == (torch.bfloat16, torch.bfloat16)
    kv = EngineConfig.build("m", kv_cache_config={"dtype": "float16"}).kv_cache_config
    with pytest.raises(ConfigError, match="model's compute dtype .*bfloat16"):
        kv_group_dtypes(kv, torch.bfloat16, groups)


@pytest.mark.parametrize(
    "name, backend, note",
    [
        ("TRITON", "auto", "moe_config.backend 'triton' means nothing on a CPU"),
        ("CUTLASS", "auto", "moe_config.backend CUTLASS: the CPU MoE path runs"),
        ("TRTLLM", "auto", "moe_config.backend TRTLLM: the CPU MoE path runs"),
        ("WIDEEP", "auto", "moe_config.backend WIDEEP: the CPU MoE path runs"),
        ("VANILLA", "torch", "moe_config.backend VANILLA: brisk's torch reference MoE runs"),
        ("torch", "torch", None),
    ],
)
def test_moe_backend_names_of_trtllm(name, backend, note, caplog):
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        assert EngineConfig.build("m", moe_backend=name, device="cpu").moe_config.backend == backend
    if note:
        assert note in caplog.text


def test_moe_backend_on_a_gpu_names_the_triton_kernels():
    cfg = EngineConfig.build("m", moe_config={"backend": "CUTLASS"}, device="cpu")
    _, notes = cfg.on_device("cuda", "CUTLASS")
    assert "moe_config.backend CUTLASS: brisk's Triton MXFP4 grouped GEMM runs on this GPU" in notes


def test_device_picks_the_paths(vllm_llm):
    """device: which device runs the model, and so which paths (cpu: the CPU MoE / attention paths)."""
    assert vllm_llm.engine.device.type == "cpu"
    assert EngineConfig.build("m", device="cpu", moe_backend="triton").moe_config.backend == "auto"
    assert EngineConfig.build("m", device="cuda", moe_backend="triton").moe_config.backend == "triton"


def test_attention_backend_names_of_trtllm():
    assert EngineConfig.build("m", attn_backend="TRTLLM").attn_backend == "auto"
    assert EngineConfig.build("m", attn_backend="VANILLA").attn_backend == "torch"
    with LLM(DEMO, max_seq_len=128, device="cpu", attn_backend="VANILLA") as llm:
        assert type(llm.engine.executor.runner.kernels.attention).__name__ == "TorchAttentionBackend"


def test_cuda_graph_sizes_and_padding():
    """cuda_graph_config (on a CPU given explicitly: the padded static buffers, uncaptured): the decode batch sizes
    up to max_batch_size, padding to the next one or not."""
    with LLM(
        DEMO, max_seq_len=128, device="cpu", cuda_graph_config={"max_batch_size": 4, "enable_padding": False}
    ) as llm:
        graphs = llm.engine.executor.runner.graphs
        assert graphs.sizes == [1, 2, 4] and graphs.enable_padding is False
    with LLM(DEMO, max_seq_len=128, device="cpu", cuda_graph_config={"max_batch_size": 16}) as llm:
        graphs = llm.engine.executor.runner.graphs
        assert graphs.sizes == [1, 2, 4, 8, 16] and graphs.enable_padding is True
    with LLM(DEMO, max_seq_len=128, device="cpu", enforce_eager=True) as llm:
        assert llm.engine.executor.runner.graphs is None


def test_vllm_parallel_layout():
    dp = EngineConfig.build("m", data_parallel_size=4, enable_expert_parallel=True)
    assert (dp.tp_size, dp.enable_attention_dp, dp.ep_size) == (4, True, 4)
    again = EngineConfig.model_validate_json(dp.model_dump_json(exclude_unset=True))  # the engine process's copy
    assert (again.tp_size, again.enable_attention_dp, again.ep_size) == (4, True, 4)
    with pytest.raises(ConfigError, match="not both"):
        EngineConfig.build("m", data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="give one of them"):
        EngineConfig.build("m", tensor_parallel_size=4, enable_expert_parallel=True, ep_size=2)
    assert EngineConfig.build("m", pipeline_parallel_size=1).pp_size == 1
    with pytest.raises(ConfigError, match="pp_size"):
        EngineConfig.build("m", pipeline_parallel_size=2)


def test_backend():
    assert EngineConfig.build("m", backend="pytorch").backend == "pytorch"
    for other in ("tensorrt", "_autodeploy"):
        with pytest.raises(ConfigError, match=f"brisk has no {other} engine"):
            EngineConfig.build("m", backend=other)


# vLLM 0.33's StructuredOutputsConfig, each key with its default there
VLLM_STRUCTURED_OUTPUTS_CONFIG = {
    "backend": "auto",
    "disable_fallback": False,
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "reasoning_parser": "",
    "reasoning_parser_plugin": "",
    "enable_in_reasoning": False,
}


def test_structured_outputs_config_keys(caplog):
    cfg = EngineConfig.build("m", structured_outputs_config={"disable_any_whitespace": False, "backend": "xgrammar"})
    assert cfg.structured_outputs_config.disable_any_whitespace is False
    assert EngineConfig.build("m").structured_outputs_config.disable_any_whitespace is True
    with pytest.raises(ConfigError, match="run on xgrammar"):
        EngineConfig.build("m", structured_outputs_config={"backend": "guidance"})
    # every key of vLLM's, as a vLLM config gives it: the no-effect ones say so at start-up
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        EngineConfig.build("m", structured_outputs_config=VLLM_STRUCTURED_OUTPUTS_CONFIG)
    assert "structured_outputs_config.disable_fallback false: no effect" in caplog.text
    assert "structured_outputs_config.disable_additional_properties false: no effect" in caplog.text
    with pytest.raises(ConfigError, match="constrains its final answer"):
        EngineConfig.build("m", structured_outputs_config={"enable_in_reasoning": True})
    with pytest.raises(ConfigError, match="no reasoning-parser plugins"):
        EngineConfig.build("m", structured_outputs_config={"reasoning_parser_plugin": "my_parser.py"})
    # vLLM's --reasoning-parser lives in this group: given here, brisk serve's --reasoning-parser
    dotted = ["serve", "--structured-outputs-config.reasoning_parser", "openai_gptoss"]
    _, server = build_serve_configs(None, OPTIONS.given(build_parser().parse_args(dotted)), default_model=DEMO)
    assert server.reasoning_parser == "openai_gptoss"
    both = [*dotted, "--reasoning-parser", "gptoss"]
    with pytest.raises(ConfigError, match="give one"):
        build_serve_configs(None, OPTIONS.given(build_parser().parse_args(both)), default_model=DEMO)
    with pytest.raises(ConfigError, match="no reasoning parser 'deepseek_r1'"):
        build_serve_configs(None, {"structured_outputs_config": {"reasoning_parser": "deepseek_r1"}}, DEMO)


@pytest.fixture(scope="module")
def demo_copy(tmp_path_factory) -> Path:
    """The demo model's weights and config without its tokenizer, and with sampling defaults of its own."""
    path = tmp_path_factory.mktemp("demo-copy")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(DEMO) / name, path / name)
    gen = json.loads((Path(DEMO) / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.6, "top_p": 0.8}))
    return path


def test_tokenizer_and_generation_config(demo_copy, tmp_path):
    with pytest.raises(Exception):  # noqa: B017 (transformers' own error: no tokenizer in the folder)
        LLM(str(demo_copy), max_seq_len=128, device="cpu")
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    for generation_config, temperature, top_p in (("auto", 0.6, 0.8), ("vllm", 1.0, 1.0), (str(folder), 0.3, 1.0)):
        with LLM(
            str(demo_copy), tokenizer=DEMO, generation_config=generation_config, max_seq_len=128, device="cpu"
        ) as llm:
            defaults = llm.get_default_sampling_params()
            assert (defaults.temperature, defaults.top_p) == (temperature, top_p), generation_config
    with pytest.raises(ConfigError, match="no generation_config.json"):
        LLM(str(demo_copy), tokenizer=DEMO, generation_config=str(tmp_path), device="cpu")


def test_override_generation_config(demo_copy):
    """vLLM's --override-generation-config: sampling defaults over --generation-config's; max_new_tokens is every
    request's max_tokens at most, and its default."""
    override = {"temperature": 0.2, "presence_penalty": 0.5, "max_new_tokens": 7}
    for generation_config, top_p in (("auto", 0.8), ("vllm", 1.0)):
        with LLM(
            str(demo_copy), tokenizer=DEMO, generation_config=generation_config, override_generation_config=override
        ) as llm:
            defaults = llm.get_default_sampling_params()
            assert (defaults.temperature, defaults.top_p, defaults.presence_penalty) == (0.2, top_p, 0.5)
            assert defaults.max_tokens == 7
            assert len(llm.generate("Once upon a time")[0].outputs[0].token_ids) <= 7
    given = OPTIONS.given(build_parser().parse_args(["serve", "--override-generation-config", '{"top_k": 5}']))
    engine, _ = build_serve_configs(None, given, default_model=DEMO)
    assert engine.override_generation_config == {"top_k": 5}
    with pytest.raises(ConfigError, match="do_sample: brisk's default sampling parameters are temperature"):
        EngineConfig.build("m", override_generation_config={"do_sample": True, "temperature": 0.5})
    # a request's own values win, but max_tokens never exceeds the cap; unset penalties take the defaults
    defaults = {"max_tokens": 7, "frequency_penalty": 0.25}
    messages = [{"role": "user", "content": "hi"}]
    for asked, gets in ((None, 7), (3, 3), (50, 7)):
        request = ChatCompletionRequest(model="m", messages=messages, max_tokens=asked, frequency_penalty=None)
        params = request.to_sampling_params(defaults)
        assert (params.max_tokens, params.frequency_penalty, params.presence_penalty) == (gets, 0.25, 0.0)
    explicit = ChatCompletionRequest(model="m", messages=messages, frequency_penalty=-0.5)
    assert explicit.to_sampling_params(defaults).frequency_penalty == -0.5
    assert CompletionRequest(model="m", prompt="x").to_sampling_params(defaults).max_tokens == 7  # its 16, capped


def test_vllm_performance_mode():
    """vLLM's --performance-mode: throughput doubles the batch and step budget where not given; interactivity
    captures every decode batch size up to 32 (on a CPU given explicitly: the static buffers, uncaptured)."""
    default = EngineConfig.build("m")
    throughput = EngineConfig.build("m", performance_mode="throughput")
    assert (throughput.max_batch_size, throughput.max_num_tokens) == (
        2 * default.max_batch_size,
        2 * default.max_num_tokens,
    )
    assert EngineConfig.build("m", performance_mode="throughput", max_num_seqs=64).max_batch_size == 64
    given = OPTIONS.given(build_parser().parse_args(["serve", "--performance-mode", "interactivity"]))
    assert build_serve_configs(None, given, default_model=DEMO)[0].performance_mode == "interactivity"
    with pytest.raises(ConfigError, match="performance_mode"):
        EngineConfig.build("m", performance_mode="fast")
    graphs = {"max_batch_size": 40}
    with LLM(DEMO, max_seq_len=128, device="cpu", cuda_graph_config=graphs, performance_mode="interactivity") as llm:
        assert llm.engine.executor.runner.graphs.sizes == [*range(1, 33), 40]
    with LLM(DEMO, max_seq_len=128, device="cpu", cuda_graph_config=graphs, performance_mode="balanced") as llm:
        assert llm.engine.executor.runner.graphs.sizes == [1, 2, 4, 8, 16, 24, 32, 40]


def test_long_prefill_token_threshold_needs_chunked_prefill():
    assert EngineConfig.build("m", long_prefill_token_threshold=512).long_prefill_token_threshold == 512
    with pytest.raises(ConfigError, match="long_prefill_token_threshold 512 splits prompts into chunks"):
        EngineConfig.build("m", long_prefill_token_threshold=512, enable_chunked_prefill=False)


def test_chat_template(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    messages = [{"role": "user", "content": "Good morrow"}]
    with LLM(DEMO, chat_template=str(template), max_seq_len=128, device="cpu") as llm:
        assert llm.tokenizer.decode(llm.render_chat(messages)) == "[user] Good morrow\n"
    with LLM(DEMO, max_seq_len=128, device="cpu") as llm:
        assert "<|start|>user<|message|>Good morrow" in llm.tokenizer.decode(llm.render_chat(messages))
    with pytest.raises(ConfigError, match="no such file"):
        LLM(DEMO, chat_template=str(tmp_path / "nope.jinja"), device="cpu")


# ---- effects: server options that need no running server ----------------------------------------------------
def test_server_option_checks(caplog):
    assert ServerConfig(api_server_count=1, num_postprocess_workers=1).num_api_servers == 1
    assert ServerConfig(api_server_count=2).num_api_servers == 2
    with caplog.at_level(logging.INFO, logger="brisk.config"):
        _, server = build_serve_configs(None, {"num_postprocess_workers": 3}, default_model=DEMO)
    assert server.num_api_servers == 3  # trtllm's post-processing processes are brisk's API-server processes
    assert "num_postprocess_workers 3: brisk detokenizes in its API-server processes, so 3 of them run" in caplog.text
    with pytest.raises(ConfigError, match="api_server_count 2 and num_postprocess_workers 4 both set"):
        build_serve_configs(None, {"api_server_count": 2, "num_postprocess_workers": 4}, default_model=DEMO)
    for key, value, match in (
        ("tool_call_parser", "hermes", "no tool-call parser 'hermes'"),
        ("reasoning_parser", "deepseek_r1", "no reasoning parser 'deepseek_r1'"),
    ):
        with pytest.raises(ConfigError, match=match):
            build_serve_configs(None, {key: value}, default_model=DEMO)
    for spelled in ("openai_gptoss", "GptOss", "gpt-oss"):
        assert ServerConfig(reasoning_parser=spelled).reasoning_parser == spelled
    harmony_only = ServerConfig(
        tool_call_parser="openai", reasoning_parser="openai_gptoss", enable_auto_tool_choice=True
    )
    harmony_only.check_model(is_harmony=True)
    with pytest.raises(ConfigError, match="harmony models"):
        harmony_only.check_model(is_harmony=False)


def test_served_names_and_origins_in_either_form():
    assert ServerConfig(served_model_name="a").served_model_name == ["a"]
    parsed = build_parser().parse_args(["serve", "--served-model-name", "a", "b", "--allowed-origins", '["https://x"]'])
    _, server = build_serve_configs(None, OPTIONS.given(parsed), default_model=DEMO)
    assert server.served_model_name == ["a", "b"] and server.allowed_origins == ["https://x"]
    assert ServerConfig(allowed_origins="https://x, https://y").allowed_origins == ["https://x", "https://y"]


def test_response_store_options(tmp_path):
    store = response_store_for(ServerConfig(state_dir=str(tmp_path), response_ttl=60, max_stored_responses=2))
    try:
        assert (store.ttl_s, store.max_responses) == (60, 2)
        assert Path(store.path).parent == tmp_path
    finally:
        store.close()


def test_observability_options(tmp_path):
    server = ServerConfig(otlp_traces_endpoint="http://127.0.0.1:4318", log_format="json", profile_dir=str(tmp_path))
    observability = observability_for(server)
    try:
        exporter = observability.tracer_provider._active_span_processor._span_processors[0].span_exporter
        assert exporter._endpoint == "http://127.0.0.1:4318/v1/traces"
        assert (observability.log_format, observability.profile_dir) == ("json", str(tmp_path))
    finally:
        observability.tracer_provider.shutdown()
    assert observability_for(ServerConfig()).tracer_provider is None


def test_log_levels():
    assert ServerConfig(log_level="verbose").log_level == "debug"  # trtllm's names
    assert ServerConfig(log_level="INTERNAL_ERROR").log_level == "error"
    assert ServerConfig(uvicorn_log_level="warning").uvicorn_log_level == "warning"


# ---- every option has a test of its effect ------------------------------------------------------------------
HERE = "tests/test_options.py"
DROPIN = "tests/test_dropin.py"
FP8 = "tests/test_kv_fp8_models.py"
KV_FIELDS = "tests/test_kv_cache_config_fields.py"
OPTION_TESTS: dict[str, list[str]] = {
    "config": [f"{HERE}::test_flags_and_files_precedence"],
    "extra_llm_api_options": [f"{HERE}::test_flags_and_files_precedence", f"{DROPIN}::test_the_guides_commands"],
    "host": [f"{DROPIN}::test_the_guides_commands"],
    "port": [f"{DROPIN}::test_the_guides_commands", f"{DROPIN}::test_port_in_use_is_one_line"],
    "served_model_name": [
        f"{DROPIN}::test_vllm_command_serves",
        f"{HERE}::test_served_names_and_origins_in_either_form",
    ],
    "api_key": ["tests/test_security.py::test_every_route_but_health_needs_the_key"],
    "api_key_file": ["tests/test_security.py::test_api_key_sources"],
    "max_request_body_size": ["tests/test_hostile_input.py::test_body_over_the_limit_is_413"],
    "allowed_origins": ["tests/test_security.py::test_cors_allows_only_the_configured_origin"],
    "log_prompts": ["tests/test_security.py::test_log_prompts_flag"],
    "request_timeout": ["tests/test_security.py::test_server_request_timeout_caps_every_request"],
    "shutdown_timeout": [
        "tests/test_reliability.py::test_sigterm_drains_then_exits_zero",
        "tests/test_security.py::test_a_shutdown_timeout_of_0_aborts_the_requests_in_flight_at_once",
    ],
    "enable_prompt_tokens_details": ["tests/test_server.py::test_fingerprint_modes_and_prompt_tokens_details_off"],
    "fingerprint_mode": [
        "tests/test_server.py::test_fingerprint_modes_and_prompt_tokens_details_off",
        "tests/test_options.py::test_system_fingerprint_names_the_parallel_layout_and_hashes_the_options",
    ],
    "fingerprint_value": ["tests/test_server.py::test_fingerprint_modes_and_prompt_tokens_details_off"],
    "exclude_tools_when_tool_choice_none": [
        "tests/test_server_chat.py::test_tool_choice_none_shows_the_tools_only_when_asked"
    ],
    "otlp_traces_endpoint": [f"{HERE}::test_observability_options"],
    "log_format": [
        f"{HERE}::test_observability_options",
        "tests/test_tracing.py::test_json_log_has_one_line_per_request_with_id_and_timings",
    ],
    "log_level": [f"{DROPIN}::test_start_up_errors_are_one_line", f"{HERE}::test_log_levels"],
    "uvicorn_log_level": [f"{DROPIN}::test_vllm_command_serves"],
    "disable_log_requests": [f"{DROPIN}::test_vllm_command_serves", f"{HERE}::test_switches_and_inverted_spellings"],
    "profile_dir": [
        f"{HERE}::test_observability_options",
        "tests/test_tracing.py::test_profiling_endpoints_are_off_without_profile_dir",
    ],
    "state_dir": [f"{HERE}::test_response_store_options"],
    "response_ttl": [f"{HERE}::test_response_store_options"],
    "max_stored_responses": [f"{HERE}::test_response_store_options"],
    "api_server_count": [
        f"{HERE}::test_server_option_checks",
        f"{DROPIN}::test_vllm_command_serves",
        "tests/test_api_servers.py::test_two_api_servers_serve_every_api",
    ],
    **{
        name: ["tests/test_api_servers.py::test_https_on_the_port_and_between_the_processes"]
        for name in ("ssl_certfile", "ssl_keyfile")
    },
    **{
        name: ["tests/test_api_servers.py::test_https_client_certificates_and_ciphers"]
        for name in ("ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers")
    },
    **{
        name: ["tests/test_security.py::test_cors_methods_headers_and_credentials_as_configured"]
        for name in ("allowed_methods", "allowed_headers", "allow_credentials")
    },
    "root_path": ["tests/test_security.py::test_docs_root_path_and_their_switch_off"],
    "disable_fastapi_docs": ["tests/test_security.py::test_docs_root_path_and_their_switch_off"],
    "max_log_len": ["tests/test_security.py::test_logged_prompts_are_cut_to_max_log_len"],
    "log_outputs": ["tests/test_security.py::test_log_outputs_flag"],
    "enable_request_id_headers": ["tests/test_security.py::test_request_id_headers_when_asked_for"],
    "num_postprocess_workers": [
        f"{HERE}::test_server_option_checks",
        "tests/test_api_servers.py::test_engine_death_stops_every_api_server",
    ],
    "default_chat_template_kwargs": [f"{DROPIN}::test_vllm_command_serves"],
    "reasoning_effort_map": [f"{DROPIN}::test_vllm_command_serves"],
    "enable_tokenizer_info_endpoint": [
        f"{DROPIN}::test_vllm_command_serves",
        "tests/test_server.py::test_models_and_tokenize",
    ],
    "enable_force_include_usage": [f"{DROPIN}::test_vllm_command_serves"],
    "uds": ["tests/test_api_servers.py::test_uds_serves_on_a_unix_socket"],
    "sse_keep_alive_interval": [
        f"{DROPIN}::test_vllm_command_serves",
        "tests/test_stream_path.py::test_keep_alive_comments_fill_a_silent_stream_and_a_hang_up_closes_it",
    ],
    "return_tokens_as_token_ids": [
        f"{DROPIN}::test_vllm_command_serves",
        "tests/test_server.py::test_logprobs_name_tokens_by_id",
    ],
    "tool_call_parser": [f"{HERE}::test_server_option_checks", f"{DROPIN}::test_vllm_command_serves"],
    "reasoning_parser": [f"{HERE}::test_server_option_checks", f"{DROPIN}::test_vllm_command_serves"],
    "enable_auto_tool_choice": [f"{HERE}::test_server_option_checks", f"{DROPIN}::test_vllm_command_serves"],
    "tokenizer": [f"{HERE}::test_tokenizer_and_generation_config"],
    "revision": [f"{DROPIN}::test_model_id_from_the_hf_cache_without_the_hub"],
    **{
        name: [f"{HERE}::test_hub_download_options_reach_huggingface_hub"]
        for name in ("download_dir", "hf_token", "tokenizer_revision")
    },
    "load_format": ["tests/test_loader.py::test_dummy_weights_run_on_cpu"],
    "dtype": [f"{HERE}::test_dtype_spelled_the_vllm_way"],
    "device": [f"{HERE}::test_device_picks_the_paths"],
    "seed": [f"{HERE}::test_seed_makes_a_fresh_engine_sample_the_same_tokens"],
    "trust_remote_code": [f"{HERE}::test_no_effect_options_say_so_at_start_up"],
    "backend": [f"{HERE}::test_backend", f"{DROPIN}::test_the_guides_commands"],
    "max_batch_size": [
        f"{HERE}::test_max_num_seqs_batched_tokens_and_iteration_log",
        f"{DROPIN}::test_vllm_command_serves",
    ],
    "max_num_tokens": [f"{HERE}::test_max_num_seqs_batched_tokens_and_iteration_log"],
    "max_seq_len": [f"{HERE}::test_max_model_len_and_block_size", f"{DROPIN}::test_vllm_command_serves"],
    "max_num_waiting": ["tests/test_server.py::test_api_key_queue_limit_and_stream_interval"],
    "enable_chunked_prefill": [f"{HERE}::test_chunked_prefill_switch"],
    "kv_cache_config": [f"{HERE}::test_flags_and_files_precedence"],
    "kv_cache_config.enable_block_reuse": [
        f"{HERE}::test_prefix_caching_off_gives_no_hits",
        f"{DROPIN}::test_vllm_command_serves",
    ],
    "kv_cache_config.tokens_per_block": [f"{HERE}::test_max_model_len_and_block_size"],
    "kv_cache_config.host_cache_size": [
        "tests/test_kv_host_tier.py::test_host_tier_options",
        "tests/test_kv_host_tier.py::test_multi_turn_beyond_the_device_pool_is_served_from_the_host_tier",
    ],
    "kv_offloading_size": ["tests/test_kv_host_tier.py::test_host_tier_options"],
    "kv_offloading_backend": ["tests/test_kv_host_tier.py::test_host_tier_options"],
    "kv_cache_config.free_gpu_memory_fraction": [f"{HERE}::test_kv_memory_share_and_fixed_blocks"],
    "kv_cache_config.max_blocks": [f"{HERE}::test_kv_memory_share_and_fixed_blocks"],
    "kv_cache_config.dtype": [
        f"{HERE}::test_kv_cache_dtype",
        f"{FP8}::test_the_engine_stores_fp8_and_logs_the_capacity",
    ],
    "kv_cache_config.dtype_skip_layers": [
        f"{HERE}::test_kv_cache_dtype",
        f"{FP8}::test_the_engine_stores_fp8_and_logs_the_capacity",
    ],
    "kv_cache_config.max_tokens": [f"{KV_FIELDS}::test_max_tokens_and_max_gpu_total_bytes_bound_the_pool"],
    "kv_cache_config.max_gpu_total_bytes": [f"{KV_FIELDS}::test_max_tokens_and_max_gpu_total_bytes_bound_the_pool"],
    "kv_cache_config.secondary_offload_min_priority": [
        f"{KV_FIELDS}::test_secondary_offload_min_priority_decides_what_goes_to_the_host_tier"
    ],
    "kv_cache_config.onboard_blocks": [f"{KV_FIELDS}::test_onboard_blocks"],
    **{f"kv_cache_config.{name}": [f"{KV_FIELDS}::test_refused_fields_say_why"] for name in KV_REFUSED},
    "kv_cache_config.block_reuse_config.policy": [f"{KV_FIELDS}::test_refused_fields_say_why"],
    "kv_cache_config.block_reuse_config.max_num_turns": [f"{KV_FIELDS}::test_no_effect_fields_are_accepted_and_logged"],
    **{
        f"kv_cache_config.{name}": [
            f"{KV_FIELDS}::test_no_effect_fields_are_accepted_and_logged",
            f"{KV_FIELDS}::test_a_trtllm_kv_cache_config_serves",
        ]
        for name in KV_NO_EFFECT
    },
    "gpu_memory_utilization": [
        f"{HERE}::test_kv_memory_share_and_fixed_blocks",
        f"{HERE}::test_gpu_memory_utilization_on_a_gpu_is_left_to_the_engine",
        "tests/test_kv_memory.py::test_gpu_memory_utilization_sizes_the_pool_by_vllms_rule",
    ],
    "cuda_graph_config": [
        "tests/test_engine_process_config.py::test_engine_process_config_keeps_what_was_given",
        f"{HERE}::test_switches_and_inverted_spellings",
    ],
    "cuda_graph_config.max_batch_size": [
        f"{HERE}::test_cuda_graph_sizes_and_padding",
        f"{HERE}::test_vllm_graph_options_set_the_captured_sizes",
    ],
    "cuda_graph_config.enable_padding": [
        f"{HERE}::test_cuda_graph_sizes_and_padding",
        "tests/test_engine_loop.py::test_padding_rows_never_write_a_requests_blocks",
    ],
    "cuda_graph_config.batch_sizes": [
        "tests/test_engine_process_config.py::test_engine_process_config_keeps_what_was_given",
        f"{HERE}::test_vllm_graph_options_set_the_captured_sizes",
    ],
    "compilation_config": [f"{HERE}::test_vllm_graph_options_set_the_captured_sizes"],
    "cuda_graph_sizes": [f"{HERE}::test_vllm_graph_options_set_the_captured_sizes"],
    "optimization_level": [f"{HERE}::test_vllm_attention_backends_and_block_count"],
    "disable_log_stats": [f"{HERE}::test_vllm_attention_backends_and_block_count"],
    "disable_overlap_scheduler": [f"{HERE}::test_overlap_scheduling_spelled_either_way"],
    "moe_config": [f"{HERE}::test_moe_backend_names_of_trtllm"],
    **{
        f"moe_config.{name}": [f"{HERE}::test_trtllms_earlier_options_files_load_as_their_releases_meant"]
        for name in ("max_num_tokens", "load_balancer", "disable_finalize_fusion", "use_low_precision_moe_combine")
    },
    "moe_config.backend": [
        f"{HERE}::test_moe_backend_names_of_trtllm",
        f"{HERE}::test_moe_backend_on_a_gpu_names_the_triton_kernels",
    ],
    "attn_backend": [f"{HERE}::test_attention_backend_names_of_trtllm"],
    "check_kv_invariants": ["tests/test_engine_loop.py::test_every_loop_generates_what_the_plain_loop_does"],
    "stream_interval": ["tests/test_server.py::test_api_key_queue_limit_and_stream_interval"],
    "grammar_compile_timeout_s": ["tests/test_structured_engine.py::test_compile_timeout"],
    "grammar_max_json_whitespace": ["tests/test_structured_whitespace.py::test_whitespace_allowed_is_bounded"],
    "structured_outputs_config": [f"{HERE}::test_structured_outputs_config_keys"],
    "structured_outputs_config.disable_any_whitespace": [
        "tests/test_structured_whitespace.py::test_compact_by_default_whitespace_on_request",
        f"{DROPIN}::test_vllm_command_serves",
    ],
    **{
        f"structured_outputs_config.{name}": [f"{HERE}::test_structured_outputs_config_keys"]
        for name in (
            "backend",
            "disable_fallback",
            "disable_additional_properties",
            "reasoning_parser",
            "reasoning_parser_plugin",
            "enable_in_reasoning",
        )
    },
    "long_prefill_token_threshold": [
        "tests/test_scheduler.py::test_long_prefill_token_threshold_shares_a_step_among_prompts",
        "tests/test_engine_e2e.py::test_chunked_prefill_matches",
        f"{HERE}::test_long_prefill_token_threshold_needs_chunked_prefill",
    ],
    "performance_mode": [f"{HERE}::test_vllm_performance_mode"],
    "override_generation_config": [f"{HERE}::test_override_generation_config"],
    "num_cpu_threads": ["tests/test_host.py::test_cpu_threads_leave_one_core_to_the_api_server"],
    "cpu_weight_prepack": [
        "tests/test_engine_e2e.py::test_bf16_prepacked_weights_generate_what_plain_matmuls_generate"
    ],
    "cpu_kernels": ["tests/test_cli.py::test_cpu_kernels_flag_picks_the_kernel_build"],
    "enable_attention_dp": ["tests/test_parallel.py::test_attention_dp_reports_every_ranks_logprobs"],
    "speculative_config": ["tests/test_spec_decode_config.py::test_trtllm_and_vllm_dialects_mean_the_same"],
    "tp_size": ["tests/test_parallel.py::test_greedy_tokens_match_single_rank", f"{DROPIN}::test_the_guides_commands"],
    "ep_size": ["tests/test_parallel.py::test_greedy_tokens_match_single_rank"],
    "pp_size": [f"{HERE}::test_vllm_parallel_layout"],
    "data_parallel_size": [f"{HERE}::test_vllm_parallel_layout"],
    "enable_expert_parallel": [
        f"{HERE}::test_vllm_parallel_layout",
        f"{HERE}::test_vllm_and_trtllm_spellings_mean_the_same_config",
    ],
    "attention_dp_config": [f"{HERE}::test_trtllms_own_gpt_oss_configs_load"],
    "env_overrides": [f"{HERE}::test_trtllms_own_gpt_oss_configs_load"],
    "enable_mixed_sampler": [f"{HERE}::test_mixed_sampler_off_still_samples_each_request_with_its_own_parameters"],
    "print_iter_log": [f"{HERE}::test_max_num_seqs_batched_tokens_and_iteration_log"],
    "max_logprobs": [f"{HERE}::test_max_logprobs", f"{DROPIN}::test_vllm_command_serves"],
    "generation_config": [f"{HERE}::test_tokenizer_and_generation_config"],
    "chat_template": [f"{HERE}::test_chat_template"],
}


def test_every_option_has_a_test_of_its_effect():
    assert sorted(OPTION_TESTS) == sorted(row.path for row in OPTIONS.rows), "an option without an effect test"
    for path, tests in OPTION_TESTS.items():
        row = OPTIONS.by_path[path]
        names = {row.name, row.path, *(a.name for a in row.aliases)}
        for node in tests:
            file, _, function = node.partition("::")
            source = (TESTS.parent / file).read_text()
            defined = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
            assert function in defined, f"{path}: {node} does not exist"
            spelled = {n for name in names for n in (name, name.replace("_", "-"))}
            assert any(s in source for s in spelled), f"{path}: {file} never names the option"


def test_hub_download_options_reach_huggingface_hub(monkeypatch, tmp_path, capsys):
    """vLLM's --download-dir, --hf-token and --tokenizer-revision: MODEL and --tokenizer given as Hub ids are
    fetched with them; the token is never shown (the configuration in effect masks it); --hf-token without a value
    (vLLM's) leaves huggingface_hub's own token."""
    import huggingface_hub

    from brisk.server.serve import announce_config

    calls = []

    def snapshot_download(repo_id, revision=None, cache_dir=None, token=None, **_):
        calls.append((repo_id, revision, cache_dir, token))
        return DEMO

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    parse = build_parser().parse_args
    flags = ["serve", "org/model", "--revision", "r1", "--tokenizer", "org/tok", "--tokenizer-revision", "v2"]
    flags += ["--download-dir", str(tmp_path), "--hf-token", "hf_secret"]
    engine, server = build_serve_configs("org/model", OPTIONS.given(parse(flags)), default_model=DEMO)
    assert calls == [("org/model", "r1", str(tmp_path), "hf_secret"), ("org/tok", "v2", str(tmp_path), "hf_secret")]
    assert engine.model == engine.tokenizer == DEMO
    announce_config(engine, server)
    assert "hf_secret" not in capsys.readouterr().out
    calls.clear()
    given = OPTIONS.given(parse(["serve", "org/model", "--hf-token"]))
    build_serve_configs("org/model", given, default_model=DEMO)
    assert calls == [("org/model", None, None, None)]
