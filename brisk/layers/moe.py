"""Mixture-of-experts for gpt-oss style experts, with a pluggable compute backend (the registry: layers/backends.py;
the runner binds one to every layer, as it binds attention's).

Expert layout inside brisk (one layout for both weight formats, rows = output features like nn.Linear):
    MXFP4 packed:  gate_up_proj_blocks uint8 [E, 2I, H/32, 16], gate_up_proj_scales uint8 [E, 2I, H/32]
                   down_proj_blocks    uint8 [E, H, I/32, 16],  down_proj_scales    uint8 [E, H, I/32]
    unquantized:   gate_up_proj [E, 2I, H], down_proj [E, H, I]  (HF stores these transposed: [E, H, 2I], [E, I, H])
    always:        gate_up_proj_bias [E, 2I], down_proj_bias [E, H]
gate_up rows interleave gate (even) and up (odd). Packed tensors stay packed: backends dequantize (or
consume them directly, for GPU kernels) at forward time.

Parallelism (see ParallelConfig): expert parallelism gives rank ep_rank the experts
[E/ep * ep_rank, E/ep * (ep_rank+1)); tokens routed elsewhere contribute nothing here (their slot is -1).
MoE tensor parallelism splits the intermediate dim I: moe_tp_rank r holds gate_up rows [2I/tp * r, 2I/tp * (r+1))
(whole gate/up pairs) and the matching down_proj input columns; MXFP4 shards must be whole 32-value blocks, so I
is zero-padded up to a multiple of 32 * moe_tp_size (a zero gate/up pair yields a zero activation). Each rank's
output is a partial sum, reduced over the world; down_proj_bias is added on moe_tp_rank 0 only. With attention
data parallelism the ranks hold different tokens: they are gathered before the experts and the sums scattered
back after them.
"""

from __future__ import annotations

import itertools
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from brisk.distributed.comm import all_gather_rows, all_reduce, reduce_scatter_rows
from brisk.kernels.cpu_kernels import MXFP4_DIRECT_MAX_ROWS, CpuKernels
from brisk.layers.linear import copy_checked, linear, prepack_cpu_weight, set_weight_loader
from brisk.layers.mxfp4 import MXFP4_BLOCK_SIZE, dequantize_mxfp4
from brisk.model_config import ParallelConfig

# Rows of an MXFP4 projection the torch ops dequantize at once into a buffer (FusedMoE._dequantized).
DEQUANTIZE_ROWS = 256


def select_experts(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: top-k logits, then softmax over those k (in the logits dtype, as HF does)."""
    top_values, topk_ids = torch.topk(router_logits, top_k, dim=-1)
    topk_weights = torch.softmax(top_values, dim=-1, dtype=top_values.dtype)
    return topk_ids, topk_weights


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float, halves: bool = False) -> torch.Tensor:
    """gpt-oss activation on interleaved [gate0, up0, gate1, up1, ...] columns (the checkpoint's order), or,
    with `halves`, on [gate0, gate1, ..., up0, up1, ...] (contiguous halves: faster elementwise ops on CPU)."""
    if halves:
        gate, up = gate_up.chunk(2, dim=-1)
    else:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MoEBackend:
    """Computes sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for this rank's weights."""

    name = "base"
    graph_safe = False  # the torch path sizes its work from the routing on the host (.tolist())

    @classmethod
    def supports(cls) -> bool:
        """Whether this process can run the backend (auto picks the first registered one that can)."""
        return True

    @classmethod
    def create(cls, auto: bool) -> MoEBackend:
        return cls()

    def route(self, layer: FusedMoE, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top_k experts as this rank's local ids (-1: another EP rank's expert) and their weights
        (0 for -1)."""
        topk_ids, topk_weights = select_experts(router_logits, layer.top_k)
        if layer.parallel.ep_size > 1:
            local = topk_ids - layer.first_expert
            here = (local >= 0) & (local < layer.num_local_experts)
            topk_ids = torch.where(here, local, -1)
            topk_weights = topk_weights * here
        return topk_ids, topk_weights

    def forward(
        self, layer: FusedMoE, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """topk_ids are local expert indices; -1 marks a slot routed to another rank's expert."""
        raise NotImplementedError

    def variant_token_counts(self, layer: FusedMoE) -> list[int]:
        """Batch sizes (tokens) that together run every kernel variant this backend picks by batch size, for the
        start-up warm-up (JIT-compiled kernels); none where nothing is compiled at run time."""
        return []


class TorchMoEBackend(MoEBackend):
    """Reference, and the CPU path: the (token, k) slots sorted by expert, one matmul pair per expert that
    was picked, the activation and the weighting done once over all slots. MXFP4 experts are dequantized
    on the fly (FusedMoE.expert_linear); bf16 experts on CPU use their prepacked weights (FusedMoE.prepack). Where
    brisk's CPU kernels are bound, a decode step's tokens are one C call (the same computation), MXFP4 experts read
    in place, 4.25 bits a weight."""

    name = "torch"

    def __init__(self) -> None:
        # Kept from step to step: where every layer's prompt experts are dequantized (FusedMoE.dequantize_buffer).
        self.dequantized: torch.Tensor | None = None

    def forward(self, layer, hidden, topk_ids, topk_weights):
        kernels = layer.cpu_kernels
        if (
            kernels is not None
            and layer.quantization == "mxfp4"
            and kernels.moe_mxfp4_accepts(hidden, layer.gate_up_proj_blocks)
        ):
            return kernels.moe_experts_mxfp4(
                hidden,
                topk_ids,
                topk_weights,
                (layer.gate_up_proj_blocks, layer.gate_up_proj_scales),
                layer.gate_up_proj_bias,
                (layer.down_proj_blocks, layer.down_proj_scales),
                layer.down_proj_bias if layer.moe_tp_rank == 0 else None,
                layer.gate_up_halves,
                layer.swiglu_alpha,
                layer.swiglu_limit,
            )
        if kernels is not None and layer.quantization is None and kernels.moe_accepts(hidden, layer.gate_up_proj):
            return kernels.moe_experts(
                hidden,
                topk_ids,
                topk_weights,
                layer.gate_up_proj,
                layer.gate_up_proj_bias,
                layer.down_proj,
                layer.down_proj_bias if layer.moe_tp_rank == 0 else None,
                layer.gate_up_halves,
                layer.swiglu_alpha,
                layer.swiglu_limit,
            )
        t, k = topk_ids.shape
        if t == 1:  # one sequence decoding: its k experts are distinct, no sorting or scattering needed
            experts = topk_ids[0].tolist()
            if min(experts) >= 0:
                return self._one_token(layer, hidden, experts, topk_weights)
        flat_ids = topk_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert, the -1 ones (other ranks) first
        counts = torch.bincount(flat_ids + 1, minlength=layer.num_local_experts + 1).tolist()
        x = hidden[order // k]  # each slot's token, in expert order
        bounds = list(itertools.accumulate(counts))  # slots [bounds[e], bounds[e + 1]) go to expert e
        picked = [e for e in range(layer.num_local_experts) if counts[e + 1]]
        if not picked:  # no tokens, or all of them routed to other ranks' experts
            return torch.zeros_like(hidden)
        buffer = self.dequantized = layer.dequantize_buffer(hidden.dtype, self.dequantized)
        gate_up = torch.cat([layer.expert_linear(e, "gate_up", x[bounds[e] : bounds[e + 1]], buffer) for e in picked])
        act = layer.activation(gate_up, layer.gate_up_halves)
        act_bounds = [0, *itertools.accumulate(counts[e + 1] for e in picked)]
        ys = [hidden.new_zeros(counts[0], hidden.shape[1])]  # other ranks' experts contribute nothing here
        ys += [layer.expert_linear(e, "down", act[a:b], buffer) for e, a, b in zip(picked, act_bounds, act_bounds[1:])]
        y = torch.empty_like(x)
        y[order] = torch.cat(ys).to(y.dtype)  # back to (token, k) order
        return (y.view(t, k, -1) * topk_weights[..., None].to(y.dtype)).sum(dim=1)

    @staticmethod
    def _one_token(layer, hidden, experts: list[int], topk_weights):
        """The same computation for one token whose k slots all go to this rank's experts, in slot order."""
        gate_up = torch.cat([layer.expert_linear(e, "gate_up", hidden) for e in experts])
        act = layer.activation(gate_up, layer.gate_up_halves)
        y = torch.cat([layer.expert_linear(e, "down", a) for e, a in zip(experts, act.split(1))])
        return (y.view(1, len(experts), -1) * topk_weights[..., None].to(y.dtype)).sum(dim=1)


class FusedMoE(nn.Module):
    # Parameters registered by `_add` (by name, so nn.Module's __getattr__ finds them): declared for type checkers.
    # Unquantized experts:
    gate_up_proj: nn.Parameter  # [E, 2I, H]
    down_proj: nn.Parameter  # [E, H, I]
    # MXFP4 experts (quantization="mxfp4"): packed blocks of two 4-bit values a byte, and their scales
    gate_up_proj_blocks: nn.Parameter  # [E, 2I, H / 32, 16] uint8
    gate_up_proj_scales: nn.Parameter  # [E, 2I, H / 32] uint8
    down_proj_blocks: nn.Parameter  # [E, H, I / 32, 16] uint8
    down_proj_scales: nn.Parameter  # [E, H, I / 32] uint8
    # Both:
    gate_up_proj_bias: nn.Parameter  # [E, 2I]
    down_proj_bias: nn.Parameter  # [E, H]

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        quantization: str | None = None,
        parallel: ParallelConfig = ParallelConfig(),
    ) -> None:
        super().__init__()
        if quantization not in (None, "mxfp4"):
            raise ValueError(f"unsupported MoE quantization '{quantization}' (supported: mxfp4)")
        if num_experts % parallel.ep_size:
            raise ValueError(f"num_local_experts ({num_experts}) is not divisible by ep_size ({parallel.ep_size})")
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // parallel.ep_size
        self.first_expert = parallel.ep_rank * self.num_local_experts
        self.hidden_size = hidden_size
        moe_tp = parallel.moe_tp_size
        if quantization == "mxfp4":
            padded = -(-intermediate_size // (MXFP4_BLOCK_SIZE * moe_tp)) * MXFP4_BLOCK_SIZE * moe_tp
        elif intermediate_size % moe_tp:
            raise ValueError(
                f"moe intermediate_size ({intermediate_size}) is not divisible by the MoE "
                f"tensor-parallel size ({moe_tp} = tp_size / ep_size)"
            )
        else:
            padded = intermediate_size
        self.intermediate_size = padded // moe_tp
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.quantization = quantization
        self.parallel = parallel
        self.moe_tp_rank = parallel.moe_tp_rank
        self.backend: MoEBackend = TorchMoEBackend()  # the runner binds the configured one (layers/backends.py)
        self.packed_experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # see prepack
        self.gate_up_halves = False  # gate_up rows regrouped as [gates; ups] (prepack), else interleaved
        self.cpu_kernels: CpuKernels | None = None  # bound by the CPU model runner (cpu_kernels: true)

        e, h, i = self.num_local_experts, hidden_size, self.intermediate_size
        if quantization == "mxfp4":
            if h % MXFP4_BLOCK_SIZE:
                raise ValueError(f"MXFP4 needs hidden_size ({h}) divisible by {MXFP4_BLOCK_SIZE}")
            half = MXFP4_BLOCK_SIZE // 2
            self._add("gate_up_proj_blocks", (e, 2 * i, h // MXFP4_BLOCK_SIZE, half), 1, torch.uint8)
            self._add("gate_up_proj_scales", (e, 2 * i, h // MXFP4_BLOCK_SIZE), 1, torch.uint8)
            self._add("down_proj_blocks", (e, h, i // MXFP4_BLOCK_SIZE, half), 2, torch.uint8)
            self._add("down_proj_scales", (e, h, i // MXFP4_BLOCK_SIZE), 2, torch.uint8)
        else:
            # Checkpoints (HF layout) are [E, in, out]: transposed on load.
            self._add("gate_up_proj", (e, 2 * i, h), 1, None, transpose=True)
            self._add("down_proj", (e, h, i), 2, None, transpose=True)
        self._add("gate_up_proj_bias", (e, 2 * i), 1, None)
        self._add("down_proj_bias", (e, h), None, None)

    def _add(
        self, name: str, shape: tuple[int, ...], tp_dim: int | None, dtype: torch.dtype | None, transpose: bool = False
    ) -> None:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        set_weight_loader(param, partial(self._load, name=name, tp_dim=tp_dim, transpose=transpose))
        self.register_parameter(name, param)

    def _load(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        shard_id: object = None,
        *,
        name: str,
        tp_dim: int | None,
        transpose: bool,
    ) -> None:
        if loaded_weight.shape[0] != self.num_experts:
            raise ValueError(
                f"FusedMoE.{name}: checkpoint has {loaded_weight.shape[0]} experts, "
                f"config num_local_experts is {self.num_experts}"
            )
        loaded_weight = loaded_weight.narrow(0, self.first_expert, self.num_local_experts)
        if transpose:
            loaded_weight = loaded_weight.transpose(1, 2)
        if tp_dim is not None:
            # This rank's rows, then zeros for those past the stored ones (MXFP4 intermediate padding): padding the
            # whole tensor first would copy every local expert (a checkpoint tensor is a view of the file's pages,
            # read only where touched).
            size, stored = param.shape[tp_dim], loaded_weight.shape[tp_dim]
            start = min(self.moe_tp_rank * size, stored)
            real = min(size, stored - start)
            loaded_weight = loaded_weight.narrow(tp_dim, start, real)
            if real < size:
                loaded_weight = F.pad(loaded_weight, [0, 0] * (loaded_weight.dim() - 1 - tp_dim) + [0, size - real])
        copy_checked(param.data, loaded_weight, f"FusedMoE.{name}")

    def expert_weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert in `dtype`, dequantized if stored packed."""
        if self.quantization == "mxfp4":
            return self._dequantized(expert, "gate_up", dtype), self._dequantized(expert, "down", dtype)
        return self.gate_up_proj[expert].to(dtype), self.down_proj[expert].to(dtype)

    def _mxfp4(self, expert: int, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, scales) of one expert's gate_up or down projection."""
        if which == "down":
            return self.down_proj_blocks[expert], self.down_proj_scales[expert]
        return self.gate_up_proj_blocks[expert], self.gate_up_proj_scales[expert]

    def _dequantized(
        self, expert: int, which: str, dtype: torch.dtype, buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One MXFP4 projection in `dtype`: one C pass where brisk's CPU kernels are bound, else torch ops; into
        `buffer` (a view of it) if given, the torch ops then DEQUANTIZE_ROWS rows at a time (their fp32 and int64
        temporaries are ~12x the result's bytes)."""
        blocks, scales = self._mxfp4(expert, which)
        if self.cpu_kernels is not None and blocks.device.type == "cpu":
            return self.cpu_kernels.dequantize_mxfp4(blocks, scales, dtype, buffer)
        if buffer is None:
            return dequantize_mxfp4(blocks, scales, dtype)
        out = buffer[: blocks.numel() * 2].view(*scales.shape[:-1], -1)
        for row in range(0, out.shape[0], DEQUANTIZE_ROWS):
            rows = slice(row, row + DEQUANTIZE_ROWS)
            out[rows] = dequantize_mxfp4(blocks[rows], scales[rows], dtype)
        return out

    def dequantize_buffer(self, dtype: torch.dtype, buffer: torch.Tensor | None) -> torch.Tensor | None:
        """Where a prompt's MXFP4 experts are dequantized one after the other on a CPU: `buffer` if it holds the
        biggest projection in `dtype`, else a new one (None for other experts and devices). One buffer for all of
        them, because the C heap keeps what a step frees (host.py): a new [2I, H] weight per expert, each freed
        around the small outputs kept beside it, left a hole of 33 MB per expert and layer in gpt-oss-20b's heap,
        ~1 GB of resident memory after a 512-token prompt (docs/performance.md)."""
        blocks = self.gate_up_proj_blocks if self.quantization == "mxfp4" else None
        if blocks is None or blocks.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return None
        size = 2 * self.intermediate_size * self.hidden_size
        if buffer is not None and buffer.dtype == dtype and buffer.numel() >= size:
            return buffer
        return torch.empty(size, dtype=dtype)

    def expert_linear(
        self, expert: int, which: str, x: torch.Tensor, buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One expert's gate_up (with bias) or down projection (bias on moe_tp_rank 0) of x [n, in]; `buffer`: see
        dequantize_buffer."""
        down = which == "down"
        if down:
            bias = self.down_proj_bias[expert] if self.moe_tp_rank == 0 else None
        else:
            bias = self.gate_up_proj_bias[expert]
        if self.quantization is None and (self.packed_experts is not None or self.cpu_kernels is not None):
            packed = None if self.packed_experts is None else self.packed_experts[expert][down]
            return linear(x, (self.down_proj if down else self.gate_up_proj)[expert], bias, packed, self.cpu_kernels)
        if self.quantization == "mxfp4":
            kernels = self.cpu_kernels
            blocks, scales = self._mxfp4(expert, which)
            if (
                kernels is not None
                and x.shape[0] <= MXFP4_DIRECT_MAX_ROWS
                and kernels.mxfp4_linear_accepts(x, blocks, bias)
            ):
                return kernels.mxfp4_linear(x, blocks, scales, bias)
            return linear(x, self._dequantized(expert, which, x.dtype, buffer), bias)
        return linear(x, self.expert_weights(expert, x.dtype)[down], bias)

    def activation(self, gate_up: torch.Tensor, halves: bool) -> torch.Tensor:
        """clamped_swiglu of gate_up rows: one C call on CPU where brisk's kernels are bound, else torch ops."""
        if self.cpu_kernels is not None and self.cpu_kernels.swiglu_accepts(gate_up):
            return self.cpu_kernels.clamped_swiglu(gate_up, self.swiglu_alpha, self.swiglu_limit, halves)
        return clamped_swiglu(gate_up, self.swiglu_alpha, self.swiglu_limit, halves=halves)

    def prepack(self) -> int:
        """bf16 experts on CPU: every expert's weights in oneDNN's layout (see prepack_cpu_weight), gate_up's rows
        regrouped as [all gate rows; all up rows] so the activation reads two contiguous halves. The plain weights
        and biases are regrouped the same way (the CPU matmul and MoE kernels read them)."""
        if self.quantization is not None:
            return 0
        rows = 2 * self.intermediate_size
        halves = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)]).to(self.gate_up_proj.device)
        packed: list[tuple[torch.Tensor, torch.Tensor]] = []
        for e in range(self.num_local_experts):
            gate_up = prepack_cpu_weight(self.gate_up_proj[e][halves])
            down = prepack_cpu_weight(self.down_proj[e])
            if gate_up is None or down is None:
                return 0  # not a bf16 CPU weight, or no oneDNN: the same for every expert
            packed.append((gate_up, down))
        self.packed_experts = packed
        self.gate_up_proj.data = self.gate_up_proj.data[:, halves].contiguous()
        self.gate_up_proj_bias.data = self.gate_up_proj_bias.data[:, halves].contiguous()
        self.gate_up_halves = True
        return 2 * len(packed)

    def forward(
        self, hidden: torch.Tensor, router_logits: torch.Tensor, dp_num_tokens: list[int] | None = None
    ) -> torch.Tensor:
        """hidden [T, H], router_logits [T, E] -> [T, H]. dp_num_tokens: every DP rank's T (attention DP)."""
        p = self.parallel
        dp_tokens = None  # every DP rank's T when this layer gathers their tokens (attention DP)
        if p.dp_size > 1:
            assert dp_num_tokens is not None  # the model passes it whenever dp_size > 1
            dp_tokens = dp_num_tokens
            if router_logits.dtype == hidden.dtype:  # one collective a layer: the two side by side
                both = all_gather_rows(torch.cat((hidden, router_logits), dim=-1), dp_tokens)
                hidden, router_logits = both.split([hidden.shape[-1], router_logits.shape[-1]], dim=-1)
                hidden = hidden.contiguous()  # the backends read whole rows
            else:
                hidden = all_gather_rows(hidden, dp_tokens)
                router_logits = all_gather_rows(router_logits, dp_tokens)
        topk_ids, topk_weights = self.backend.route(self, router_logits)
        out = self.backend.forward(self, hidden, topk_ids, topk_weights)
        if dp_tokens is not None:
            return reduce_scatter_rows(out, dp_tokens, p.dp_rank)
        return all_reduce(out) if p.world_size > 1 else out
