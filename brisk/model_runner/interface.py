"""The model side as the rest of brisk sees it: what the engine core and the executors may use of a rank's runner.

The engine core keeps the books of the KV cache from a `KVCacheSpec` and drives steps through
`ModelRunnerInterface.execute_model`; a step's `StepHandle.result()` brings its `ModelRunnerOutput`s (one per
attention-DP rank) to the host. `setup.load_model_runner` builds the runner; nothing outside this package imports
`runner.py`.

KV memory layout: layers are grouped by attention type (`kv_groups_for`). Slot tensor j holds the KV of the j-th
layer of every group, so one block id means the same memory in all groups and all groups share one `BlockPool`; a
block is the same bytes in every group, which holds `block_sizes[g]` tokens in it (more in a group of a narrower KV
dtype; kv_tensors.py allocates them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from brisk.kv_cache.manager import KVGroupSpec
from brisk.model_config import ModelConfig, ParallelConfig
from brisk.scheduler.output import ModelRunnerOutput, SchedulerOutput


def kv_groups_for(model_config: ModelConfig) -> list[KVGroupSpec]:
    """The model's KV groups: its full-attention layers first, then its sliding-window ones."""
    groups = []
    for kind in ("full_attention", "sliding_attention"):
        layers = tuple(i for i, t in enumerate(model_config.layer_types) if t == kind)
        if layers:
            window = model_config.sliding_window if kind == "sliding_attention" else None
            groups.append(KVGroupSpec(layers, window))
    return groups


@dataclass(frozen=True)
class KVCacheSpec:
    """What the engine core needs to know of the model side to keep the books of its KV cache."""

    groups: list[KVGroupSpec]
    num_blocks: int
    block_sizes: tuple[int, ...]  # per group: the tokens a block holds
    dp_size: int  # one KV pool (and scheduler) per attention-DP rank
    spec_lookahead_slots: int = 0  # KV slots past a request's tokens its drafter writes (spec_decode/proposer.py)
    kv_dtypes: tuple[torch.dtype, ...] = ()  # per group: the dtype its K and V are stored in
    num_host_blocks: int = 0  # the host KV tier's blocks (kv_cache_config.host_cache_size; 0: none)
    host_bytes_per_block: int = 0  # bytes one block copy moves (all ranks holding a share of the pool)


class StepHandle(Protocol):
    """A launched step. `result()` is the step's host synchronisation (at most one), done where it is called: the
    ModelRunnerOutput of every attention-DP rank, on rank 0 (other ranks: none)."""

    def result(self) -> list[ModelRunnerOutput]: ...


class ModelRunnerInterface(Protocol):
    """One rank's model, KV cache and persistent batch."""

    parallel: ParallelConfig

    @property
    def kv_cache_spec(self) -> KVCacheSpec: ...

    def execute_model(self, scheds: list[SchedulerOutput]) -> StepHandle:
        """Run this rank's part of a step: scheds holds every attention-DP rank's SchedulerOutput."""
        ...

    def close(self) -> None: ...
