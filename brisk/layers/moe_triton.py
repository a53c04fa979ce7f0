"""MoE backend running the fused Triton kernels of brisk.kernels.triton_moe (MXFP4 or bf16 experts)."""

from __future__ import annotations

import torch

from brisk.kernels import interpreting
from brisk.kernels.triton_moe import fused_experts, route_topk, tier_token_counts
from brisk.layers.moe import FusedMoE, MoEBackend, TorchMoEBackend


class TritonMoEBackend(MoEBackend):
    """Grouped-GEMM MoE: align slots by expert, gate_up + SwiGLU, down + routing weight, sum over k.

    The kernels need CUDA tensors, or TRITON_INTERPRET=1 (tests) for CPU ones. With torch_fallback (what
    moe_backend="auto" asks for) a layer on the CPU uses the torch reference instead of failing, so one process
    can hold CPU and GPU models.
    """

    name = "triton"
    graph_safe = True  # routing and alignment into fixed-size buffers on the device, no host synchronisation

    def __init__(self, torch_fallback: bool = False) -> None:
        self.torch_fallback = torch_fallback

    @classmethod
    def supports(cls) -> bool:
        return torch.cuda.is_available()

    @classmethod
    def create(cls, auto: bool) -> TritonMoEBackend:
        return cls(torch_fallback=auto)

    def variant_token_counts(self, layer: FusedMoE) -> list[int]:
        # each tile tier's largest batch (a tier's variants are one whatever its batch), as `forward` sizes tiles
        return tier_token_counts(layer.top_k, layer.num_experts)

    def route(self, layer: FusedMoE, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not router_logits.is_cuda and not interpreting():
            return super().route(layer, router_logits)  # forward's torch fallback (or its error) follows
        # one launch for torch.topk's two, the softmax and EP's local ids
        return route_topk(router_logits, layer.top_k, layer.first_expert, layer.num_local_experts)

    def forward(
        self, layer: FusedMoE, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if not hidden.is_cuda and not interpreting():
            if self.torch_fallback:
                return TorchMoEBackend().forward(layer, hidden, topk_ids, topk_weights)
            raise RuntimeError(
                f"moe backend 'triton' needs CUDA tensors, got {hidden.device} "
                "(set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
            )
        if layer.gate_up_halves:  # the kernels read gate and up columns interleaved, as checkpoints store them
            raise RuntimeError("moe backend 'triton' got a layer prepacked for the CPU kernels (gate_up as halves)")
        mxfp4 = layer.quantization == "mxfp4"
        return fused_experts(
            hidden,
            topk_ids,
            topk_weights,
            gate_up=layer.gate_up_proj_blocks if mxfp4 else layer.gate_up_proj,
            gate_up_scales=layer.gate_up_proj_scales if mxfp4 else None,
            gate_up_bias=layer.gate_up_proj_bias,
            down=layer.down_proj_blocks if mxfp4 else layer.down_proj,
            down_scales=layer.down_proj_scales if mxfp4 else None,
            # Partial outputs of MoE-TP ranks are summed: only moe_tp_rank 0 adds the down bias.
            down_bias=layer.down_proj_bias if layer.moe_tp_rank == 0 else None,
            swiglu_alpha=layer.swiglu_alpha,
            swiglu_limit=layer.swiglu_limit,
            unrouted_slots=layer.parallel.ep_size > 1,
            # under EP a rank's experts get 1 / ep_size of the slots: tiles sized by all experts, not its own
            num_routed_experts=layer.num_experts,
        )
