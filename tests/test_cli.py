"""`brisk` command-line flags reach the engine config."""

from __future__ import annotations

import logging

import pytest

from brisk import cli
from tests.tiny_models import make_tiny_llama_with_tokenizer


def test_cpu_kernels_flag_picks_the_kernel_build(tmp_path, caplog, capsys):
    # `--cpu_kernels torch` (what `pytest --cpu-kernels torch` hands a `brisk serve` subprocess): PyTorch ops only
    path = make_tiny_llama_with_tokenizer(tmp_path / "m")
    with caplog.at_level(logging.INFO, logger="brisk"):
        assert cli.main(["generate", path, "--prompt", "hello", "--max_tokens", "2", "--cpu_kernels", "torch"]) == 0
    assert "CPU kernels: PyTorch ops" in caplog.text
    assert capsys.readouterr().out.strip()


def test_cpu_kernels_flag_rejects_unknown_builds(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "m", "--prompt", "x", "--cpu-kernels", "sse2"])
    assert exc.value.code == 2
    assert "invalid choice: 'sse2'" in capsys.readouterr().err
