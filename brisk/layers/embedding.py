"""Vocab-parallel token embedding and LM head.

The vocabulary is split into tp_size contiguous ranges of ceil(vocab / tp_size) rows; the last rank's
range is padded with zero rows. At tp_size 1 the layers are a plain embedding / linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from brisk.distributed.comm import all_gather_last_dim
from brisk.kernels.cpu_kernels import CpuKernels
from brisk.layers.linear import all_reduce_across_tp, copy_checked, linear, prepack_cpu_weight, set_weight_loader
from brisk.model_config import ParallelConfig


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelConfig = ParallelConfig()) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"{type(self).__name__}: checkpoint has {loaded_weight.shape[0]} rows, "
                f"config vocab_size is {self.num_embeddings}"
            )
        n_rows = self.vocab_end - self.vocab_start
        if param.device.type != "meta":
            param.data[n_rows:].zero_()  # padding rows of the last rank
        copy_checked(param.data[:n_rows], loaded_weight.narrow(0, self.vocab_start, n_rows), type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids owned by other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = F.embedding(torch.where(local, input_ids - self.vocab_start, 0), self.weight)
        out = out * local.unsqueeze(-1).to(out.dtype)
        return all_reduce_across_tp(out, self.parallel)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [N, H] -> logits [N, vocab]; each rank computes its vocab shard, then they are gathered."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelConfig = ParallelConfig()) -> None:
        super().__init__(num_embeddings, embedding_dim, parallel)
        self.packed_weight: torch.Tensor | None = None
        self.cpu_kernels: CpuKernels | None = None  # bound by the CPU model runner (cpu_kernels: true)

    def prepack(self) -> int:  # not where the kernels are bound: see prepack_cpu_weight
        self.packed_weight = None if self.cpu_kernels is not None else prepack_cpu_weight(self.weight)
        return self.packed_weight is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.packed_weight, self.cpu_kernels)
        if self.parallel.tp_size > 1:
            logits = all_gather_last_dim(logits, self.parallel.tp_size)
        return logits[..., : self.num_embeddings]
