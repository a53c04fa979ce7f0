"""speculative_config in both dialects, and the errors that name the key."""

from __future__ import annotations

import pytest

from brisk.cli import build_parser
from brisk.config import OPTIONS, ConfigError, EngineConfig


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
        ({"decoding_type": "NGram", "max_draft_len": 2, "is_keep_all": True}, "is_keep_all"),
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
