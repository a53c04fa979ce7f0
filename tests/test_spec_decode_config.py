"""speculative_config in both dialects, and the errors that name the key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from brisk.cli import build_parser
from brisk.config import OPTIONS, ConfigError, EngineConfig
from brisk.spec_decode.config import SpeculativeConfig


def test_trtllm_and_vllm_dialects_mean_the_same(tmp_path):
    yaml_path = tmp_path / "opts.yaml"
    yaml_path.write_text(
        "speculative_config:\n  decoding_type: NGram\n  max_draft_len: 4\n  max_matching_ngram_size: 5\n"
        "  prompt_lookup_min: 2\n  draft_len_after_rejection: 2\n"
    )
    trt = EngineConfig.build("m", yaml_path=yaml_path).speculative_config
    vllm = EngineConfig.build(
        "m",
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 5,
            "prompt_lookup_min": 2,
            "draft_len_after_rejection": 2,
        },
    ).speculative_config
    assert trt == vllm
    assert trt is not None and (trt.decoding_type, trt.max_draft_len, trt.max_matching_ngram_size) == ("NGram", 4, 5)
    assert trt.draft_len_after_rejection == 2
    eagle = EngineConfig.build("m", speculative_config={"method": "eagle3", "num_speculative_tokens": 3, "model": "/d"})
    assert eagle.speculative_config is not None
    assert (eagle.speculative_config.decoding_type, eagle.speculative_config.speculative_model_dir) == ("Eagle3", "/d")
    trt_eagle = EngineConfig.build(
        "m", speculative_config={"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model_dir": "/d"}
    )
    assert trt_eagle.speculative_config == eagle.speculative_config
    # the JSON the engine process receives parses back to the same config
    dumped = EngineConfig.model_validate_json(eagle.model_dump_json())
    assert dumped.speculative_config == eagle.speculative_config


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"decoding_type": "Eagle3", "max_draft_len": 3}, "speculative_model_dir"),
        ({"decoding_type": "NGram", "max_draft_len": 3, "speculative_model_dir": "/d"}, "speculative_model_dir"),
        ({"decoding_type": "NGram", "max_draft_len": 0}, "max_draft_len"),
        ({"decoding_type": "Medusa", "max_draft_len": 2}, "decoding_type"),
        ({"decoding_type": "NGram", "max_draft_len": 2, "use_dynamic_tree": True}, "use_dynamic_tree"),
        (
            {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model_dir": "/d", "eagle_choices": [[0]]},
            "trees",
        ),
        ({"decoding_type": "MTP", "num_nextn_predict_layers": 1}, "MTP, Medusa"),
        ({"decoding_type": "NGram", "max_draft_len": 2, "max_concurrency": 0}, "max_concurrency"),
        ({"decoding_type": "NGram", "max_draft_len": 2, "prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),
        ({"decoding_type": "NGram", "max_draft_len": 2, "load_format": "dummy"}, "load_format"),
        ({"decoding_type": "NGram", "max_draft_len": 2, "prompt_lookup_min": 4}, "prompt_lookup_min"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "max_draft_len": 2}, "max_draft_len"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "speculative_model_dir"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_len_after_rejection": 3}, "draft_len_after_rejection"),
    ],
)
def test_invalid_combinations_name_the_key(spec, message):
    with pytest.raises(ConfigError, match=message) as info:
        EngineConfig.build("m", speculative_config=spec)
    assert "speculative_config" in str(info.value)


def test_cli_takes_vllm_json(capsys):
    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    assert OPTIONS.given(args)["speculative_config"]["method"] == "ngram"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "{method: ngram}"])
    assert "not valid JSON" in capsys.readouterr().err


def test_trtllms_earlier_spellings(caplog):
    """The keys of trtllm's releases since 0.19 (tests/data/peer_flags/trtllm_llm_args_releases.txt): old names of
    today's, no-effect pool policies (logged), max_concurrency, and chains described as trees."""
    eagle = {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model_dir": "/d"}
    for spec in (
        {"decoding_type": "Eagle", "max_draft_len": 3, "pytorch_weights_path": "/d"},
        {"decoding_type": "Eagle3", "max_draft_len": 3, "pytorch_eagle_weights_path": "/d", "eagle3_one_model": True},
        {**eagle, "num_eagle_layers": 3, "max_total_draft_tokens": 3, "use_dynamic_tree": False, "load_format": "auto"},
    ):
        assert EngineConfig.build("m", speculative_config=spec).speculative_config == SpeculativeConfig(**eagle)
    ngram = {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2, "disable_by_batch_size": 9}
    pools = {"is_keep_all": True, "is_use_oldest": True, "is_public_pool": False}
    with caplog.at_level(logging.INFO, logger="brisk"):
        old = {"decoding_type": "NGram", "prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 2, **pools}
        built = EngineConfig.build("m", speculative_config={**old, "max_concurrency": 8}).speculative_config
    assert built == SpeculativeConfig(**ngram)  # drafts while at most 8 requests run: none from 9 on
    assert "is_keep_all, is_use_oldest, is_public_pool: no effect" in caplog.text
    with pytest.raises(ConfigError, match="max_concurrency and disable_by_batch_size"):
        EngineConfig.build("m", speculative_config={**ngram, "max_concurrency": 4})
    txt = (Path(__file__).parent / "data" / "peer_flags" / "trtllm_llm_args_releases.txt").read_text()
    listed = {line.split(".", 1)[1] for line in txt.splitlines() if line.startswith("speculative_config.")}
    tried = {"pytorch_weights_path", "pytorch_eagle_weights_path", "prompt_lookup_num_tokens", "max_concurrency"}
    tried |= {*pools, "eagle3_one_model", "load_format", "num_eagle_layers", "max_total_draft_tokens"}
    assert listed <= tried, "a key of the list this test does not try"
