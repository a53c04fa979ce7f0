"""The KV cache tensors of one rank: their layout, their size in blocks, and their allocation (the one place).

Layers are grouped by attention type (interface.kv_groups_for). Slot tensor j holds the KV of the j-th layer of
every group, so one block id means the same memory in all groups and all groups share one `BlockPool`: a block's
bytes are `num_slots * 2 * block_size * kv_heads * head_dim * dtype`, plus a drafter's own KV (EAGLE3) in the
same blocks. `allocate_kv_cache` binds the tensors to the attention layers (and the drafter's).

Each group stores its K and V in one dtype (`kv_group_dtypes`): the model's, or FP8 E4M3 (kv_cache_config.dtype,
layers/kv_fp8.py); kv_cache_config.dtype_skip_layers (vLLM's `--kv-cache-dtype-skip-layers sliding_window`) keeps the
sliding-window groups in the model's dtype. Groups share the slot tensors, so a block must be the same bytes in every
group: a group whose dtype is narrower holds more tokens a block (`group_block_sizes`: gpt-oss with FP8 full
attention and bf16 sliding windows has full-attention blocks of 2 x block_size tokens, as vLLM's hybrid allocator
unifies page sizes). block_size stays the smallest, the prefix cache's hashing unit (kv_cache/manager.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from brisk.config import EngineConfig, KvCacheConfig
from brisk.errors import ConfigError
from brisk.kv_cache.manager import KVGroupSpec, cdiv
from brisk.layers.attention import Attention
from brisk.layers.kv_fp8 import FP8_KV_DTYPE
from brisk.model_runner.memory import available_host_memory
from brisk.spec_decode.proposer import Proposer

logger = logging.getLogger("brisk.model_runner.setup")
CPU_KV_CACHE_CAP_BYTES = 2 << 30  # a CPU box runs small models; never take more than this by default
GIB = 1 << 30


def kv_group_dtypes(
    kv_config: KvCacheConfig, model_dtype: torch.dtype, groups: list[KVGroupSpec]
) -> tuple[torch.dtype, ...]:
    """Per KV group, the dtype its K and V are stored in: FP8 E4M3 under an FP8 KV cache, else the model's dtype;
    one dtype for all groups (they share the slot tensors)."""
    if not kv_config.fp8:
        named = getattr(torch, kv_config.dtype, None) if kv_config.dtype != "auto" else None
        if named is not None and named != model_dtype:
            raise ConfigError(
                f"kv_cache_config.dtype {kv_config.dtype}: brisk keeps an unquantized KV cache in the model's compute "
                f"dtype ({model_dtype}); give auto (or fp8), or set the model's --dtype to {kv_config.dtype}"
            )
        return (model_dtype,) * len(groups)
    skip_sliding = "sliding_window" in kv_config.dtype_skip_layers
    return tuple(model_dtype if skip_sliding and g.sliding_window else FP8_KV_DTYPE for g in groups)


def group_block_sizes(block_size: int, dtypes: tuple[torch.dtype, ...]) -> tuple[int, ...]:
    """Tokens a block holds in each group: block_size in the widest dtype's groups, proportionally more in narrower
    ones, so that a block is the same bytes in every group (they share the slot tensors)."""
    widest = max(d.itemsize for d in dtypes)
    return tuple(block_size * widest // d.itemsize for d in dtypes)


@dataclass(frozen=True)
class KVTensorLayout:
    groups: list[KVGroupSpec]
    block_size: int
    num_kv_heads: int  # held by this rank (a share of them under TP, one when they are replicated)
    head_dim: int
    dtype: torch.dtype  # the model's
    draft_bytes_per_block: int = 0  # a drafter's own KV in the same blocks
    group_dtypes: tuple[torch.dtype, ...] = ()  # per group: its K / V storage dtype (empty: the model's)

    @property
    def num_slots(self) -> int:
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def kv_dtypes(self) -> tuple[torch.dtype, ...]:
        return self.group_dtypes or (self.dtype,) * len(self.groups)

    @property
    def group_block_sizes(self) -> tuple[int, ...]:
        return group_block_sizes(self.block_size, self.kv_dtypes)

    @property
    def slot_bytes_per_block(self) -> int:
        """Bytes of one block of a slot tensor (K or V): the same in every group."""
        widest = max(d.itemsize for d in self.kv_dtypes)
        return self.block_size * self.num_kv_heads * self.head_dim * widest

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.slot_bytes_per_block * self.num_slots + self.draft_bytes_per_block

    def describe(self, num_blocks: int) -> str:
        """The pool in one log line: its blocks, the dtypes, the full-attention tokens per GiB against the model's
        dtype."""
        model_dtype = KVTensorLayout(
            self.groups, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.draft_bytes_per_block
        )
        # A full-attention group holds every token of a request: its tokens per GiB are the pool's capacity.
        main = next((g for g, spec in enumerate(self.groups) if spec.sliding_window is None), 0)
        tokens = self.group_block_sizes[main]
        per_gib = GIB // self.bytes_per_block * tokens
        ratio = tokens / self.bytes_per_block / (model_dtype.group_block_sizes[main] / model_dtype.bytes_per_block)
        dtypes = ", ".join(
            f"{'sliding' if g.sliding_window else 'full'} {str(d).removeprefix('torch.')} ({bs} tokens a block)"
            for g, d, bs in zip(self.groups, self.kv_dtypes, self.group_block_sizes)
        )
        return (
            f"KV cache: {num_blocks:,} blocks of {self.bytes_per_block:,} bytes; K/V stored as {dtypes}; "
            f"{per_gib:,} tokens per GiB ({ratio:.2f}x the model dtype's)"
        )

    def most_useful_blocks(self, max_seq_len: int, max_batch_size: int, max_num_tokens: int) -> int:
        """More blocks than a full batch of max-length requests could ever hold is wasted memory. A full-attention
        group holds every token; a sliding group only its window behind each request (the KV manager releases the
        rest after each step) plus the step's new tokens, at most max_num_tokens over the batch: per request at
        most cdiv(window - 1 + new, block_size) + 1 blocks. gpt-oss-20b at batch 4, 4,096 tokens: 280 blocks for
        its sliding half instead of 512 (0.18 GB)."""
        batch = max_batch_size
        blocks = 1  # the null block
        for group, bs in zip(self.groups, self.group_block_sizes):
            per_request = cdiv(max_seq_len, bs)
            window = group.sliding_window
            if window is None:
                blocks += per_request * batch
            else:
                blocks += min((per_request + 1) * batch, cdiv(batch * (window - 1) + max_num_tokens, bs) + 2 * batch)
        return blocks


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
    useful = layout.most_useful_blocks(max_seq_len, config.max_batch_size, config.max_num_tokens)
    return max(2, min(int(budget // layout.bytes_per_block), useful))


def allocate_kv_cache(
    layout: KVTensorLayout,
    num_blocks: int,
    attn_layers: list[Attention],
    device: torch.device,
    proposer: Proposer | None = None,
) -> None:
    """Zeroed KV tensors of `num_blocks` blocks, bound to every attention layer (and the drafter's KV)."""
    slot_bytes = num_blocks * layout.slot_bytes_per_block
    slots = [
        tuple(torch.zeros(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2))
        for _ in range(layout.num_slots)
    ]
    for g, (group, dtype, bs) in enumerate(zip(layout.groups, layout.kv_dtypes, layout.group_block_sizes)):
        shape = (num_blocks, bs, layout.num_kv_heads, layout.head_dim)
        for j, layer_id in enumerate(group.layer_ids):
            layer = attn_layers[layer_id]
            layer.k_cache, layer.v_cache = (raw.view(dtype).view(shape) for raw in slots[j])
            layer.kv_group = g
    if proposer is not None:  # the drafter reads the first (full-attention) group's block table
        proposer.bind_kv(num_blocks, layout.group_block_sizes[0], device)


def release_kv_cache(attn_layers: list[Attention]) -> None:
    for layer in attn_layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
