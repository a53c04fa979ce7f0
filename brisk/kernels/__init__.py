"""brisk's own kernels: C for CPUs (cpu_kernels), Triton for GPUs (triton_attention, triton_moe)."""

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
