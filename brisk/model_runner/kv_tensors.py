"""The KV cache tensors of one rank: their layout, their size in blocks, and their allocation (the one place).

Layers are grouped by attention type (interface.kv_groups_for). Slot tensor j holds the KV of the j-th layer of
every group, so one block id means the same memory in all groups and all groups share one `BlockPool`: a block's
bytes are `num_slots * 2 * block_size * kv_heads * head_dim * dtype`, plus a drafter's own KV (EAGLE3) in the
same blocks. `allocate_kv_cache` binds the tensors to the attention layers (and the drafter's).

Each group stores its K and V in one dtype (`kv_group_dtypes`): the model's, or FP8 E4M3 (kv_cache_config.dtype,
layers/kv_fp8.py). Groups share the slot tensors, so they share one dtype: a block id's bytes in slot j belong to
whichever group holds that block, and two dtypes would put block b of one group over other blocks of the other.
So kv_cache_config.dtype_skip_layers (vLLM's `--kv-cache-dtype-skip-layers sliding_window`) keeps a hybrid model's
whole cache in the model's dtype (a start-up warning says so; FP8 on the full-attention half alone would add its
error without saving a byte, the sliding half's slots setting the block size), and changes nothing on a model
whose layers are of one type it does not name.
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
    if skip_sliding and any(g.sliding_window for g in groups):
        logger.warning(
            "kv_cache_dtype_skip_layers sliding_window: this model's KV groups share one block layout, so its whole "
            "KV cache stays in the model's dtype (%s); FP8 KV is off",
            model_dtype,
        )
        return (model_dtype,) * len(groups)
    return (FP8_KV_DTYPE,) * len(groups)


@dataclass(frozen=True)
class KVTensorLayout:
    groups: list[KVGroupSpec]
    block_size: int
    num_kv_heads: int  # held by this rank (a share of them under TP, one when they are replicated)
    head_dim: int
    dtype: torch.dtype  # the model's
    draft_bytes_per_block: int = 0  # a drafter's own KV in the same blocks
    group_dtypes: tuple[torch.dtype, ...] = ()  # per group: its K / V storage dtype (empty: the model's)

    def __post_init__(self) -> None:
        if len(set(self.kv_dtypes)) > 1:  # kv_group_dtypes never asks for it: see the module's docstring
            raise ValueError(f"KV groups sharing slot tensors need one dtype, not {self.kv_dtypes}")

    @property
    def num_slots(self) -> int:
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def kv_dtypes(self) -> tuple[torch.dtype, ...]:
        return self.group_dtypes or (self.dtype,) * len(self.groups)

    def slot_bytes_per_block(self, slot: int) -> int:
        """Bytes of one block of slot tensor `slot` (K or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.kv_dtypes[0].itemsize

    @property
    def bytes_per_block(self) -> int:
        return sum(2 * self.slot_bytes_per_block(j) for j in range(self.num_slots)) + self.draft_bytes_per_block

    def describe(self, num_blocks: int) -> str:
        """The pool in one log line: its blocks, the dtypes, the tokens per GiB against the model's dtype."""
        per_gib = GIB // self.bytes_per_block * self.block_size
        model_dtype = KVTensorLayout(
            self.groups, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.draft_bytes_per_block
        )
        ratio = model_dtype.bytes_per_block / self.bytes_per_block
        dtypes = ", ".join(
            f"{'sliding' if g.sliding_window else 'full'} {str(d).removeprefix('torch.')}"
            for g, d in zip(self.groups, self.kv_dtypes)
        )
        return (
            f"KV cache: {num_blocks:,} blocks of {self.block_size} tokens, {self.bytes_per_block:,} bytes each; K/V "
            f"stored as {dtypes}; {per_gib:,} tokens per GiB ({ratio:.2f}x the model dtype's)"
        )

    def most_useful_blocks(self, max_seq_len: int, max_batch_size: int, max_num_tokens: int) -> int:
        """More blocks than a full batch of max-length requests could ever hold is wasted memory. A full-attention
        group holds every token; a sliding group only its window behind each request (the KV manager releases the
        rest after each step) plus the step's new tokens, at most max_num_tokens over the batch: per request at
        most cdiv(window - 1 + new, block_size) + 1 blocks. gpt-oss-20b at batch 4, 4,096 tokens: 280 blocks for
        its sliding half instead of 512 (0.18 GB)."""
        bs, batch = self.block_size, max_batch_size
        per_request = cdiv(max_seq_len, bs)
        blocks = 1  # the null block
        for group in self.groups:
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
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    elements = num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim
    slots = [
        tuple(
            torch.zeros(num_blocks * layout.slot_bytes_per_block(j), dtype=torch.uint8, device=device) for _ in range(2)
        )
        for j in range(layout.num_slots)
    ]
    for g, (group, dtype) in enumerate(zip(layout.groups, layout.kv_dtypes)):
        for j, layer_id in enumerate(group.layer_ids):
            layer = attn_layers[layer_id]
            layer.k_cache, layer.v_cache = (
                raw[: elements * dtype.itemsize].view(dtype).view(shape) for raw in slots[j]
            )
            layer.kv_group = g
    if proposer is not None:
        proposer.bind_kv(num_blocks, layout.block_size, device)


def release_kv_cache(attn_layers: list[Attention]) -> None:
    for layer in attn_layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
