"""Test-session setup shared by every module."""

import os
import shutil

import pytest
import torch

from brisk.config import EngineConfig
from brisk.host import CPU_KERNEL_CHOICES, check_cpu_kernels_choice, cpu_kernel_isas
from tests.triton_interpreter import skip_nested_language_patches

# Without a GPU the Triton kernels run in Triton's interpreter. The variable is read when a kernel is
# defined, so it must be set before any module defines one, whichever test module imports it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    skip_nested_language_patches()

# brisk's CPU kernels are C built at first use: where there is no compiler, brisk (and these tests) run the
# PyTorch paths, and the kernel tests skip.
HAVE_C_COMPILER = shutil.which(os.environ.get("CC", "cc")) is not None


def pytest_addoption(parser):
    # Sizes of the load and fuzz tests: CI runs the defaults; a release check runs them large, e.g.
    # `pytest tests/test_reliability.py -k concurrent --load-streams 1024`.
    parser.addoption("--load-streams", type=int, default=256, help="concurrent streams in the load test")
    parser.addoption("--fuzz-examples", type=int, default=25, help="schemathesis examples per operation and mode")
    # `pytest --cpu-kernels avx2 tests/` runs the suite as on a CPU whose best kernels are the AVX2 build (torch: as
    # on one with no C compiler): engines built by the tests default to it and the kernel tests test only it.
    parser.addoption(
        "--cpu-kernels",
        choices=CPU_KERNEL_CHOICES,
        default="auto",
        help="the cpu_kernels default of this run (auto: every instruction set this CPU runs is tested)",
    )


def pytest_configure(config):
    choice = config.getoption("--cpu-kernels")
    try:
        check_cpu_kernels_choice(choice)
    except ValueError as exc:
        raise pytest.UsageError(f"--cpu-kernels {exc}") from None
    if choice != "auto":  # the field's default, for every EngineConfig this session builds
        EngineConfig.model_fields["cpu_kernels"].default = choice
        EngineConfig.model_rebuild(force=True)


def cpu_kernel_isas_under_test(config) -> tuple[str, ...]:
    """The kernel builds this run tests: all this CPU runs, or the one --cpu-kernels names (none for torch)."""
    if not HAVE_C_COMPILER:
        return ()
    choice = config.getoption("--cpu-kernels")
    return cpu_kernel_isas() if choice == "auto" else () if choice == "torch" else (choice,)


def skip_unless_isa_under_test(config, isa: str) -> None:
    if isa not in cpu_kernel_isas_under_test(config):
        why = (
            "no C compiler on this machine"
            if not HAVE_C_COMPILER
            else f"this CPU does not run the {isa} build"
            if isa not in cpu_kernel_isas()
            else f"this run tests --cpu-kernels {config.getoption('--cpu-kernels')} only"
        )
        pytest.skip(f"{isa} CPU kernels: {why}")


@pytest.fixture(scope="session")
def default_cpu_kernels(pytestconfig) -> str:
    """The cpu_kernels choice this run's engines default to (--cpu-kernels)."""
    return pytestconfig.getoption("--cpu-kernels")
