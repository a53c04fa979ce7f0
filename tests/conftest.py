"""Test-session setup shared by every module."""

import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The variable is read when a kernel is
# defined, so it must be set before any module defines one, whichever test module imports it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
