"""Tensor-parallel-ready linear layers (vLLM style).

Weights are stored like `nn.Linear`: [out_features, in_features]. Each parameter carries a
`weight_loader(param, loaded_weight, shard_id=None)` that copies this rank's slice of a full checkpoint
tensor into it, so checkpoints are loaded the same way whatever `tp_size` is.

- ColumnParallelLinear shards the output dim; its output stays sharded (no communication).
- RowParallelLinear shards the input dim; partial outputs are summed by an all-reduce.
- Merged / QKV variants fuse several checkpoint tensors (gate+up, q+k+v) into one matmul.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from brisk.distributed.comm import all_reduce
from brisk.kernels.cpu_kernels import CpuKernels
from brisk.model_config import ParallelConfig


class WeightLoader(Protocol):
    """Copies this rank's part of a full checkpoint tensor into `param`; `shard_id` names the part of a fused
    parameter (0/1 for gate/up, "q"/"k"/"v"), None for an unfused one."""

    def __call__(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None: ...


# The attribute a parameter carries its loader in (vLLM's name). torch has no typed slot for it, hence the
# two accessors below rather than `param.weight_loader`.
WEIGHT_LOADER_ATTR = "weight_loader"


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    setattr(param, WEIGHT_LOADER_ATTR, loader)


def get_weight_loader(param: nn.Parameter) -> WeightLoader:
    """The loader `set_weight_loader` attached (AttributeError for a parameter that has none)."""
    loader: WeightLoader = getattr(param, WEIGHT_LOADER_ATTR)
    return loader


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """Copy `loaded` into `param` (any dtype/device), refusing shape mismatches."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    if param.device.type == "meta":
        return
    with torch.no_grad():
        param.copy_(loaded)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Whole-tensor copy, for replicated parameters (norms, sinks, router...)."""
    copy_checked(param.data, loaded_weight, "weight")


def prepack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's own (blocked) layout of a bf16 CPU weight [out, in], made once after loading; None where it
    does not apply. A bf16 matmul on a prepacked weight skips the per-call reorder: 1.3-2.5x faster than
    F.linear at 1-32 rows on an AVX512-BF16 CPU, with bit-identical results (docs/performance.md). Dense layers
    with brisk's CPU kernels bound skip it: their decode steps take the kernels on the plain weight, and at prompt
    sizes the reorder is lost in the matmul (2880 x 5120 at 128 / 512 rows: 7.3 / 19.7 ms plain, 7.0 / 23.7
    packed), so the copy would only cost memory (gpt-oss-20b: 2.4 GB of attention and LM head)."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.bfloat16
        or not torch.backends.mkldnn.is_available()
        or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


ONEDNN_EXACT_ROWS = 16  # up to this many rows a half-precision CPU matmul runs at its own size (decode batches)
ONEDNN_SIZES_AN_OCTAVE = 8  # above it, one of 8 sizes between each power of two and the next: at most 1/8 more rows


def onednn_rows(x: torch.Tensor) -> int:
    """The rows a matmul of x [rows, in] runs at. oneDNN, which computes torch's bf16 / fp16 matmuls on CPUs, makes
    and keeps a kernel for every shape it meets (~0.5 ms to make, 0.5-1.3 MB kept, up to 1024 shapes): a server's
    steps, each of its own token count, and each expert's share of them, made new kernels for minutes and held
    1.1 GB more after a minute of load on the 6 MB demo model. Rounding the rows up to a few sizes bounds both
    (docs/performance.md); fp32 (MKL) and other devices run at the rows given."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2:
        return rows
    if rows <= ONEDNN_EXACT_ROWS:
        return rows
    octave = rows.bit_length() - 1  # 2**octave <= rows < 2**(octave + 1)
    step = (1 << octave) // ONEDNN_SIZES_AN_OCTAVE
    return -(-rows // step) * step


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None = None,
    cpu_kernels: CpuKernels | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias: a decode-sized x through brisk's CPU kernel when bound (it streams the weight at memory
    speed), else through the prepacked weight when there is one, else F.linear; a CPU matmul in half precision at
    `onednn_rows` rows (zero rows added, their results dropped: each row's result is its own)."""
    if cpu_kernels is not None and cpu_kernels.linear_accepts(x, weight, bias):
        return cpu_kernels.linear(x, weight, bias)
    rows, padded = x.shape[0], onednn_rows(x)
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    if packed is not None and rows > 0:
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    else:
        out = F.linear(x, weight, bias)
    return out if padded == rows else out[:rows]


@runtime_checkable
class Prepackable(Protocol):
    """A layer whose weights can be prepacked after loading (see prepack_cpu_weight)."""

    def prepack(self) -> int: ...


def prepack_weights(model: nn.Module) -> int:
    """Prepack every layer's weights that can be (see prepack_cpu_weight); returns how many were."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, Prepackable))


def all_reduce_across_tp(x: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """Sum partial results over the tensor-parallel ranks (the whole world when tp_size > 1)."""
    return x if parallel.tp_size == 1 else all_reduce(x)


class LinearBase(nn.Module):
    """Holds weight [out_local, in_local] and optional bias [out_local] in the default dtype/device."""

    def __init__(self, in_local: int, out_local: int, bias: bool, parallel: ParallelConfig) -> None:
        super().__init__()
        self.parallel = parallel
        self.tp_rank, self.tp_size = parallel.tp_rank, parallel.tp_size
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None
        self.cpu_kernels: CpuKernels | None = None  # bound by the CPU model runner (cpu_kernels: true)

    def prepack(self) -> int:
        self.packed_weight = None if self.cpu_kernels is not None else prepack_cpu_weight(self.weight)
        return self.packed_weight is not None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight, self.cpu_kernels)


class ReplicatedLinear(LinearBase):
    """Every rank holds the full weight (small layers such as the MoE router)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, parallel: ParallelConfig = ParallelConfig()
    ) -> None:
        super().__init__(input_size, output_size, bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        copy_checked(param.data, loaded_weight, type(self).__name__)


class ColumnParallelLinear(LinearBase):
    """Output features split into tp_size contiguous chunks; rank r holds chunk r."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, parallel: ParallelConfig = ParallelConfig()
    ) -> None:
        self.output_size_per_rank = divide(output_size, parallel.tp_size, "output_size")
        super().__init__(input_size, self.output_size_per_rank, bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        size = param.shape[0]
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        copy_checked(param.data, shard, type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul, e.g. gate_up = [gate_proj; up_proj].

    Each rank stores [gate shard r; up shard r], so the local output splits cleanly in half.
    `shard_id` is the index into `output_sizes` of the checkpoint tensor being loaded.
    """

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, parallel: ParallelConfig = ParallelConfig()
    ) -> None:
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, parallel.tp_size, "merged output size")
        super().__init__(input_size, sum(self.output_sizes), bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"MergedColumnParallelLinear needs shard_id in 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = loaded_weight.narrow(0, self.tp_rank * size, size)
        copy_checked(param.data.narrow(0, offset, size), shard, f"{type(self).__name__}[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused. Heads are split across ranks; when tp_size > num_kv_heads each KV
    head is replicated on tp_size / num_kv_heads consecutive ranks (each rank holds one KV head)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        parallel: ParallelConfig = ParallelConfig(),
    ) -> None:
        tp = parallel.tp_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_heads")
        if tp >= num_kv_heads:
            divide(tp, num_kv_heads, "tp_size (as a multiple of num_kv_heads)")
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp // num_kv_heads
        else:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_kv_heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias, parallel)

    @property
    def first_kv_head(self) -> int:
        """This rank's first KV head among the model's."""
        return self.tp_rank // self.num_kv_head_replicas * self.num_kv_heads

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, rank = self.kv_size, self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKVParallelLinear needs shard_id 'q', 'k' or 'v', got {shard_id!r}")
        shard = loaded_weight.narrow(0, rank * size, size)
        copy_checked(param.data.narrow(0, offset, size), shard, f"{type(self).__name__}[{shard_id}]")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; each rank computes a partial output, summed by all-reduce.
    The bias is full-size on every rank but added on rank 0 only, so the sum counts it once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        parallel: ParallelConfig = ParallelConfig(),
        reduce_results: bool = True,
    ) -> None:
        self.input_size_per_rank = divide(input_size, parallel.tp_size, "input_size")
        self.reduce_results = reduce_results
        super().__init__(self.input_size_per_rank, output_size, bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 2:
            size = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * size, size)
        copy_checked(param.data, loaded_weight, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = linear(x, self.weight, bias, self.packed_weight, self.cpu_kernels)
        if self.reduce_results:
            out = all_reduce_across_tp(out, self.parallel)
        return out
