"""The KV cache tensors of one rank: their layout, their size in blocks, and their allocation (the one place).

Layers are grouped by attention type (interface.kv_groups_for). Slot tensor j holds the KV of the j-th layer of
every group, so one block id means the same memory in all groups and all groups share one `BlockPool`: a block's
bytes are `num_slots * 2 * block_size * kv_heads * head_dim * dtype`, plus a drafter's own KV (EAGLE3) in the
same blocks. `allocate_kv_cache` binds the tensors to the attention layers (and the drafter's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.config import EngineConfig
from brisk.kv_cache.manager import KVGroupSpec, cdiv
from brisk.layers.attention import Attention
from brisk.model_runner.memory import available_host_memory
from brisk.spec_decode.proposer import Proposer

CPU_KV_CACHE_CAP_BYTES = 2 << 30  # a CPU box runs small models; never take more than this by default


@dataclass(frozen=True)
class KVTensorLayout:
    groups: list[KVGroupSpec]
    block_size: int
    num_kv_heads: int  # held by this rank (a share of them under TP, one when they are replicated)
    head_dim: int
    dtype: torch.dtype
    draft_bytes_per_block: int = 0  # a drafter's own KV in the same blocks

    @property
    def num_slots(self) -> int:
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def kv_dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.dtype,) * len(self.groups)

    @property
    def bytes_per_block(self) -> int:
        elt = torch.empty((), dtype=self.dtype).element_size()
        return (
            self.num_slots * 2 * self.block_size * self.num_kv_heads * self.head_dim * elt + self.draft_bytes_per_block
        )

    def most_useful_blocks(self, max_seq_len: int, max_batch_size: int) -> int:
        """More blocks than a full batch of max-length requests could ever hold is wasted memory."""
        return len(self.groups) * cdiv(max_seq_len, self.block_size) * max_batch_size + 1


def num_kv_blocks_in_budget(
    config: EngineConfig, layout: KVTensorLayout, device: torch.device, max_seq_len: int
) -> int:
    """The pool without profiling: kv_cache_config.max_blocks, else memory_fraction of the free memory (on a CPU at
    most CPU_KV_CACHE_CAP_BYTES), never more than is useful."""
    if config.kv_cache_config.max_blocks is not None:
        return config.kv_cache_config.max_blocks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * config.memory_fraction
    else:
        budget = min(available_host_memory() * config.memory_fraction, CPU_KV_CACHE_CAP_BYTES)
    useful = layout.most_useful_blocks(max_seq_len, config.max_batch_size)
    return max(2, min(int(budget // layout.bytes_per_block), useful))


def allocate_kv_cache(
    layout: KVTensorLayout,
    num_blocks: int,
    attn_layers: list[Attention],
    device: torch.device,
    proposer: Proposer | None = None,
) -> None:
    """Zeroed KV tensors of `num_blocks` blocks, bound to every attention layer (and the drafter's KV)."""
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    slots = [
        (
            torch.zeros(shape, dtype=layout.dtype, device=device),
            torch.zeros(shape, dtype=layout.dtype, device=device),
        )
        for _ in range(layout.num_slots)
    ]
    for g, group in enumerate(layout.groups):
        for j, layer_id in enumerate(group.layer_ids):
            layer = attn_layers[layer_id]
            layer.k_cache, layer.v_cache = slots[j]
            layer.kv_group = g
    if proposer is not None:
        proposer.bind_kv(num_blocks, layout.block_size, device)


def release_kv_cache(attn_layers: list[Attention]) -> None:
    for layer in attn_layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
