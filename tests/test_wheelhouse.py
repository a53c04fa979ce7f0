"""tools/wheelhouse.sh builds an offline wheelhouse from which brisk installs with `pip install --no-index`.

Cost: about 60-80 s on 2 cores: ~10 s to download ~55 MB of wheels (pip's HTTP cache makes repeats cheaper), 40-60 s
to install them into a fresh venv and run brisk there, ~10 s for a second, smaller build (--skip-file). Needs PyPI (or the configured index): skipped, with the reason,
where pip cannot reach it.

The fresh venv stands for the air-gapped GPU box, which has torch preinstalled and nothing else of brisk's: it sees
torch and triton through a .pth file naming a folder of links to this environment's torch, the packages torch itself
needs that brisk does not (sympy, mpmath, networkx), and triton, so the wheelhouse need not (and must not) hold
them, and every other
package brisk imports must come from the wheelhouse.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
import venv

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tools", "wheelhouse.sh")
# what the GPU box has: torch (with the packages it needs and brisk does not) and triton (xgrammar needs it)
TORCH_ONLY = ("torch", "functorch", "torchgen", "sympy", "mpmath", "networkx", "triton")
LIMIT_MB = 60


def _link_torch(into: str) -> None:
    site = sysconfig.get_paths()["purelib"]
    for pattern in TORCH_ONLY:
        for path in glob.glob(os.path.join(site, pattern)) + glob.glob(os.path.join(site, f"{pattern}-*.dist-info")):
            os.symlink(path, os.path.join(into, os.path.basename(path)))


def test_brisk_installs_offline_from_the_wheelhouse(tmp_path):
    wheels = tmp_path / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = dict(os.environ, PYTHON=sys.executable, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)  # the venv must find brisk where pip put it, not in this checkout
    built = subprocess.run(
        ["bash", SCRIPT, "--python", version, "--out", str(wheels)], capture_output=True, text=True, env=env
    )
    if built.returncode != 0 and any(
        s in built.stderr for s in ("Could not find a version", "Failed to establish", "NewConnectionError")
    ):
        pytest.skip(f"the package index is unreachable: {built.stderr.strip().splitlines()[-1]}")
    assert built.returncode == 0, built.stdout + built.stderr
    names = [os.path.basename(w) for w in glob.glob(str(wheels / "*.whl"))]
    assert not [n for n in names if n.startswith(("torch-", "triton-", "nvidia_"))], names
    assert any(n.startswith("transformers-") for n in names) and any(n.startswith("pytest-") for n in names)
    assert sum(os.path.getsize(wheels / n) for n in names) < LIMIT_MB * 1_000_000
    skipped = (wheels / "SKIPPED.txt").read_text()
    assert "torch" in skipped and "matplotlib" in skipped

    target = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(target)
    python = str(target / "bin" / "python")
    site = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    preinstalled = tmp_path / "preinstalled"
    preinstalled.mkdir()
    _link_torch(str(preinstalled))
    with open(os.path.join(site.decode().strip(), "gpu_box_torch.pth"), "w") as f:
        f.write(str(preinstalled) + "\n")

    # --no-build-isolation is not used: pip must build brisk in isolation from the wheelhouse's setuptools.
    install = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(wheels),
            "-r",
            str(wheels / "requirements.txt"),
            REPO,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    # brisk runs there: the offline API on the bundled demo model, and the server and benchmark modules import.
    check = (
        "import os, brisk, brisk.server.app, brisk.bench.client, pytest, hypothesis\n"
        "from brisk import LLM, SamplingParams\n"
        "llm = LLM(os.path.join(os.path.dirname(brisk.__file__), 'demo_model'), max_num_tokens=64)\n"
        "out = llm.generate(['hi'], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
        "print(brisk.__file__)\n"
    )
    ran = subprocess.run([python, "-c", check], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert str(target) in ran.stdout  # the installed copy, not this checkout

    # --skip-file: projects the target already has stay out (pip's cache makes this second build quick).
    have = tmp_path / "have.txt"
    have.write_text("Transformers==5.0.0\nhuggingface_hub==1.0\n")
    smaller = tmp_path / "smaller"
    built = subprocess.run(
        ["bash", SCRIPT, "--python", version, "--out", str(smaller), "--skip-file", str(have)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    kept = [os.path.basename(w) for w in glob.glob(str(smaller / "*.whl"))]
    assert not [n for n in kept if n.startswith(("transformers-", "huggingface_hub-"))]
    assert len(kept) == len(names) - 2
    assert "the target has transformers" in (smaller / "SKIPPED.txt").read_text()
