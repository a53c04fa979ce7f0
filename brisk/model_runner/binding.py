"""What the runner binds to a loaded model: brisk's CPU kernels, the attention and MoE backends, the GPU's norm.

Modules hold a reference to what computes them (`Attention.backend`, `FusedMoE.backend`, `cpu_kernels` on linears,
the LM head, norms, MoE layers and Llama MLPs; `RMSNorm.fused` on a GPU); the model is built with the reference ones and the runner binds the
configured ones here, once, before anything runs. A drafter with layers of its own (EAGLE3) binds the same ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from brisk.config import EngineConfig
from brisk.host import keep_freed_memory_in_the_heap
from brisk.kernels.cpu_kernels import CpuKernels, load_cpu_kernels
from brisk.layers.attention import Attention, AttentionBackend
from brisk.layers.backends import make_attention_backend, make_moe_backend
from brisk.layers.linear import prepack_weights
from brisk.layers.moe import FusedMoE, MoEBackend
from brisk.layers.norm import RMSNorm

logger = logging.getLogger(__name__)


@runtime_checkable
class UsesCpuKernels(Protocol):
    """A module that calls brisk's CPU kernels when the runner binds them (linears, LM head, norms, MoE, MLPs)."""

    cpu_kernels: CpuKernels | None


@dataclass(frozen=True)
class Kernels:
    """The compute bound to a model: one attention backend and one MoE backend for every layer, brisk's CPU
    kernels (None: the torch paths) and a one-launch RMSNorm (None: the torch path)."""

    attention: AttentionBackend
    moe: MoEBackend
    cpu: CpuKernels | None
    norm: Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor] | None = None

    @property
    def graph_safe(self) -> bool:
        """No host synchronisation in the forward: a CUDA graph can capture it (the Triton backends)."""
        return self.attention.graph_safe and self.moe.graph_safe


def make_kernels(config: EngineConfig, device: torch.device) -> Kernels:
    cpu = load_cpu_kernels(config.cpu_kernels) if device.type == "cpu" else None
    kernels = Kernels(
        make_attention_backend(config.attn_backend, device, cpu),
        make_moe_backend(config.moe_config.backend),
        cpu,
        _gpu_norm() if device.type == "cuda" else None,
    )
    if device.type == "cuda" and not kernels.graph_safe and "auto" in (config.attn_backend, config.moe_config.backend):
        logger.warning(
            "no Triton on this GPU (pip install 'brisk-llm[gpu]'): auto picked brisk's torch reference backends (%s "
            "attention, %s MoE), which wait for the GPU every layer and run without CUDA graphs: far from this "
            "GPU's speed",
            type(kernels.attention).__name__,
            type(kernels.moe).__name__,
        )
    return kernels


def _gpu_norm() -> Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor] | None:
    try:  # Triton is the GPU extra's: without it the norms stay on torch
        from brisk.kernels.triton_norm import rms_norm
    except ImportError:
        return None
    return rms_norm


def bind(model: nn.Module, kernels: Kernels) -> None:
    """Every attention layer, MoE layer, norm and CPU-kernel user of `model` computes with `kernels`."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = kernels.attention
        elif isinstance(module, FusedMoE):
            module.backend = kernels.moe
        elif isinstance(module, RMSNorm):
            module.fused = kernels.norm
        if kernels.cpu is not None and isinstance(module, UsesCpuKernels):
            module.cpu_kernels = kernels.cpu


def prepare_for_cpu(model: nn.Module, config: EngineConfig) -> None:
    """A CPU rank: the C heap keeps what steps free (host.py), bf16 weights in oneDNN's layout (cpu_weight_prepack)."""
    keep_freed_memory_in_the_heap()
    if config.cpu_weight_prepack:
        prepack_weights(model)
