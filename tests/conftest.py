"""Test-session setup shared by every module."""

import os
import shutil

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The variable is read when a kernel is
# defined, so it must be set before any module defines one, whichever test module imports it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# brisk's CPU kernels are C built at first use: where there is no compiler, brisk (and these tests) run the
# PyTorch paths, and the kernel tests skip.
HAVE_C_COMPILER = shutil.which(os.environ.get("CC", "cc")) is not None


def pytest_addoption(parser):
    # Sizes of the load and fuzz tests: CI runs the defaults; a release check runs them large, e.g.
    # `pytest tests/test_reliability.py -k concurrent --load-streams 1024`.
    parser.addoption("--load-streams", type=int, default=256, help="concurrent streams in the load test")
    parser.addoption("--fuzz-examples", type=int, default=25, help="schemathesis examples per operation and mode")
