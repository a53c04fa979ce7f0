"""`brisk` command-line flags reach the engine config."""

from __future__ import annotations

import logging

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
    # the value is checked before the model is looked for: one line naming the option, exit code 2
    assert cli.main(["generate", "m", "--prompt", "x", "--cpu-kernels", "sse2"]) == 2
    err = capsys.readouterr().err
    assert "option 'cpu_kernels'" in err and "'sse2'" in err and err.count("\n") == 1
