"""tools/wheelhouse.sh builds an offline wheelhouse from which brisk installs with `pip install --no-index`.

Cost: about 60-90 s on 2 cores: two builds (a few `pip download --no-deps` calls each, ~40 MB then ~12 MB; pip's
HTTP cache makes repeats cheaper), two installs into fresh venvs, brisk run in each. Needs PyPI (or the configured
index): skipped, with the reason, where pip cannot reach it.

Each fresh venv stands for an air-gapped machine. For the full wheelhouse it has torch preinstalled and nothing else
of brisk's: torch and triton come through a .pth file naming a folder of links to this environment's torch, the
packages torch itself needs that brisk does not (sympy, mpmath, networkx), and triton. For `--have
tools/gpu_image_packages.txt` it has, the same way, every project of that list this environment holds (with what they
need here), as the lent GPU machines' image does, and the wheelhouse installs beside it with `--no-deps --target`,
as benchmarks/gpu_window.sh does there. Every other package brisk imports must come from the wheelhouse.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tools", "wheelhouse.sh")
GPU_IMAGE = os.path.join(REPO, "tools", "gpu_image_packages.txt")
# what every target has: torch (with the packages it needs and brisk does not) and triton (xgrammar needs it)
TORCH_ONLY = ("torch", "sympy", "mpmath", "networkx", "triton")
LIMIT_MB = 64  # tools/wheelhouse.sh --max-mb
GPU_IMAGE_LIMIT_MB = 20  # beside a checkout of a few MB, well under the device tool's 64 MiB
# brisk on the target: the offline API on the bundled demo model, and the server and benchmark modules import
RUN_BRISK = (
    "import os, brisk, brisk.server.app, brisk.bench.client, pytest, hypothesis\n"
    "from brisk import LLM, SamplingParams\n"
    "llm = LLM(os.path.join(os.path.dirname(brisk.__file__), 'demo_model'), max_num_tokens=64)\n"
    "out = llm.generate(['hi'], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))\n"
    "assert len(out[0].outputs[0].token_ids) == 4\n"
    "print(brisk.__file__)\n"
)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)  # the target finds only what it has and what was installed
    return env


def build(out: Path, *args: str) -> list[str]:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run(
        ["bash", SCRIPT, "--python", version, "--out", str(out), *args], capture_output=True, text=True, env=_env()
    )
    if built.returncode != 0 and any(
        s in built.stderr for s in ("Could not find a version", "Failed to establish", "NewConnectionError")
    ):
        pytest.skip(f"the package index is unreachable: {built.stderr.strip().splitlines()[-1]}")
    assert built.returncode == 0, built.stdout + built.stderr
    return sorted(os.path.basename(w) for w in glob.glob(str(out / "*.whl")))


def project(wheel: str) -> str:
    return re.sub(r"[-_.]+", "-", wheel.split("-")[0]).lower()


def target_with(tmp_path: Path, distributions: set[str]) -> str:
    """A fresh venv that sees, through a .pth file, links to these distributions of this environment."""
    target = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(target)
    python = str(target / "bin" / "python")
    site = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    image = tmp_path / "image"
    image.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for name in sorted(distributions):
        dist = importlib.metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            if (here / top).exists() and not (image / top).exists():
                os.symlink(here / top, image / top)
    with open(os.path.join(site.decode().strip(), "gpu_box_image.pth"), "w") as f:
        f.write(str(image) + "\n")
    return python


def installed_closure(names: set[str], leave_out: set[str]) -> set[str]:
    """These projects as installed here and what they need here, recursively, but never the `leave_out` ones."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if key in found or key in leave_out:
            continue
        found.add(key)
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0])
    return found


def test_brisk_installs_offline_from_the_wheelhouse(tmp_path):
    wheels = tmp_path / "wheels"
    names = build(wheels)
    assert not [n for n in names if n.startswith(("torch-", "triton-", "nvidia_", "sympy-", "networkx-"))], names
    assert any(n.startswith("transformers-") for n in names) and any(n.startswith("pytest-") for n in names)
    assert sum(os.path.getsize(wheels / n) for n in names) < LIMIT_MB * 1_000_000
    skipped = (wheels / "SKIPPED.txt").read_text()
    assert "torch" in skipped and "matplotlib" in skipped

    python = target_with(tmp_path, set(TORCH_ONLY))
    # --no-build-isolation is not used: pip must build brisk in isolation from the wheelhouse's setuptools.
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels)]
        + ["-r", str(wheels / "requirements.txt"), REPO],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    ran = subprocess.run([python, "-c", RUN_BRISK], capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert str(tmp_path / "venv") in ran.stdout  # the installed copy, not this checkout


def test_gpu_image_wheelhouse_holds_only_what_the_image_lacks_and_runs_beside_it(tmp_path):
    """`--have tools/gpu_image_packages.txt`: a few MB of wheels (none of a project the image has), installed with
    `pip install --no-index --no-deps --target` as gpu_window.sh does, run with brisk from the checkout; every
    range of brisk's and the suite's requirements holds there (the suite's env step, as on the GPU box)."""
    wheels = tmp_path / "wheels"
    names = build(wheels, "--have", GPU_IMAGE)
    have = {re.split(r"[\s=]", line, maxsplit=1)[0].lower() for line in open(GPU_IMAGE) if line[:1].isalnum()}
    assert not [n for n in names if project(n) in have], names
    assert {"pydantic", "fastapi", "xgrammar", "openai-harmony", "msgspec", "pyzmq", "jsonschema"} <= {
        project(n) for n in names
    }
    assert sum(os.path.getsize(wheels / n) for n in names) < GPU_IMAGE_LIMIT_MB * 1_000_000
    skipped = (wheels / "SKIPPED.txt").read_text()
    assert re.search(
        r"^transformers<6,>=4\.56  <- brisk \(pyproject\.toml\): the target has it \(5\.17\.0\)$", skipped, re.M
    )
    assert "WARNING" not in skipped

    image = installed_closure(have | set(TORCH_ONLY), leave_out={project(n) for n in names})
    python = target_with(tmp_path, image)
    site = tmp_path / "brisk-site"
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
        + [str(wheels / n) for n in names],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert install.returncode == 0, install.stdout + install.stderr
    env = dict(_env(), PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    check = (
        RUN_BRISK + "import sys; sys.path.insert(0, 'benchmarks')\n"
        "from suite_phases import package_rows\n"
        "bad = [r for r in package_rows() if r['ok'] != 'yes']\n"
        "assert not bad, bad\n"
    )
    ran = subprocess.run([python, "-c", check], capture_output=True, text=True, env=env, cwd=REPO)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert os.path.join(REPO, "brisk") in ran.stdout  # brisk from the checkout, as on the GPU box
    # Every test the quick plan names collects there (a module skipped at import, for a package the box lacks,
    # would make pytest refuse the step's whole command line).
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        from suite_quick import E2E_TESTS, KERNEL_TESTS
    finally:
        sys.path.pop(0)
    collect = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS, *E2E_TESTS]
    listed = subprocess.run(collect, capture_output=True, text=True, env=env, cwd=REPO)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
