"""The registries of compute backends, in auto's order of preference: attention (layers/attention.py's interface)
and MoE experts (layers/moe.py's). The runner makes one of each and binds it to every layer
(model_runner/binding.py). The Triton backends are imported only where triton is installed (a GPU extra)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from brisk.layers.attention import AttentionBackend, TorchAttentionBackend
from brisk.layers.attention_cpu import CpuAttentionBackend
from brisk.layers.moe import MoEBackend, TorchMoEBackend

if TYPE_CHECKING:
    from brisk.kernels.cpu_kernels import CpuKernels


def _attention_backends() -> dict[str, type[AttentionBackend]]:
    """The attention registry, in auto's order of preference."""
    backends: dict[str, type[AttentionBackend]] = {}
    try:
        from brisk.layers.attention_triton import TritonAttentionBackend

        backends["triton"] = TritonAttentionBackend
    except ImportError:  # no triton: the GPU backend is not there
        pass
    backends["cpu"] = CpuAttentionBackend
    backends["torch"] = TorchAttentionBackend
    return backends


def make_attention_backend(name: str, device: torch.device, cpu_kernels: CpuKernels | None = None) -> AttentionBackend:
    """'torch': the reference; 'triton': the GPU kernels; 'cpu': the C decode kernel (layers/attention_cpu.py, needs
    `cpu_kernels`); 'auto': the first of triton, cpu, torch whose `supports(device, cpu_kernels)` holds.

    One instance serves every layer; its per-step metadata is built once per step by `prepare`.
    """
    backends = _attention_backends()
    if name == "auto":
        name = next(n for n, cls in backends.items() if cls.supports(device, cpu_kernels))
    cls = backends.get(name)
    if cls is None:
        known = ", ".join(["auto", *sorted(backends)])
        raise ValueError(f"unknown or unavailable attention backend '{name}'; choose one of: {known}")
    if name == "cpu" and not cls.supports(device, cpu_kernels):
        raise ValueError(
            "attention backend 'cpu' needs a CPU device and brisk's CPU kernels (cpu_kernels: auto, avx512 "
            "or avx2, a CPU that runs them and a C compiler: see the log)"
        )
    return cls.create(cpu_kernels)


def _moe_backends() -> dict[str, type[MoEBackend]]:
    """The MoE registry, in auto's order of preference."""
    backends: dict[str, type[MoEBackend]] = {}
    if importlib.util.find_spec("triton") is not None:
        from brisk.layers.moe_triton import TritonMoEBackend  # lazy: triton is an optional (GPU) dependency

        backends["triton"] = TritonMoEBackend
    backends["torch"] = TorchMoEBackend
    return backends


def make_moe_backend(name: str) -> MoEBackend:
    """'torch': the reference; 'triton': the fused GPU kernels; 'auto': the first registered backend whose
    `supports()` holds (triton where CUDA and triton are there; its layers left on a CPU fall back to torch)."""
    backends = _moe_backends()
    auto = name == "auto"
    if auto:
        name = next(n for n, cls in backends.items() if cls.supports())
    cls = backends.get(name)
    if cls is None:
        known = ", ".join(["auto", *sorted(backends)])
        raise ValueError(f"unknown or unavailable moe backend '{name}'; choose one of: {known}")
    return cls.create(auto=auto)
