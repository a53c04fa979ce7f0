"""Size the KV pool on a GPU from measured memory: weights, a profiling step's activations, graphs, the rest.

At start-up, after the weights are loaded, the runner runs one forward pass of a dummy batch at `max_num_tokens`
(spread over up to `max_batch_size` sequences, so that the logits of a full batch, sampled on the costliest path:
top-k / top-p / min-p, penalties, logprobs, are part of the peak) on a temporary KV cache just large enough for
it. What that costs is measured by torch's allocator (peak allocated bytes) and the driver (free bytes), not
estimated. The KV pool then gets `kv_cache_free_gpu_memory_fraction` of what is left, or, given vLLM's
`gpu_memory_utilization` u, what is left of u of the whole device (vLLM's rule):

    left = total - weights - activations - graphs - other      (other: CUDA context, cuBLAS/NCCL workspaces)
    KV   = left * fraction            or      KV = u * total - (total - left) = left - (1 - u) * total

CUDA graphs are captured after the pool is allocated (a graph holds the pool's addresses), so their memory comes out
of the share the fraction leaves: `graphs` is 0 in what start-up measures, and is there for plans made with a
known figure (tests, estimates). A capture that finds too little left is a start-up error naming the settings to
change (cuda_graph.py), and the memory the graphs took is logged.

Too little memory for one request of `max_seq_len` is a start-up error naming the settings to change, never an
out-of-memory error in the middle of a request. The arithmetic (`plan_kv_cache`) is separate from the measuring
(`measure_profile_run`), so tests check it on any machine with injected numbers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from brisk.errors import ConfigError

logger = logging.getLogger(__name__)

GIB = 1 << 30
FRACTION_SETTING = "kv_cache_free_gpu_memory_fraction"
UTILIZATION_SETTING = "gpu_memory_utilization"


class InsufficientKVMemoryError(ConfigError):
    """The GPU has too little memory left for the KV cache of one request; the message names what to change."""


@dataclass(frozen=True)
class MemoryMeasurement:
    """Device memory in bytes, measured at start-up (or given by a test)."""

    total: int  # the device's memory
    weights: int  # allocated by the loaded model
    activations: int  # peak allocated during the profiling step, above what was allocated before it
    graphs: int = 0  # CUDA graphs' memory where known beforehand (captured after the pool, start-up measures none)
    other: int = 0  # used outside torch's allocator: CUDA context, cuBLAS / NCCL workspaces

    @property
    def left(self) -> int:
        return self.total - self.weights - self.activations - self.graphs - self.other


@dataclass(frozen=True)
class KVGroupLayout:
    """What the plan needs to know of a KV group: its name for the log, its layers, the tokens a block of it holds,
    its sliding window."""

    name: str
    num_layers: int
    block_size: int
    window: int | None = None


@dataclass(frozen=True)
class KVCachePlan:
    measured: MemoryMeasurement
    fraction: float
    utilization: float | None  # vLLM's gpu_memory_utilization, where it sized the pool instead of the fraction
    kv_bytes: int  # the pool's budget
    bytes_per_block: int
    num_blocks: int  # including the null block
    groups: tuple[KVGroupLayout, ...]

    def group_tokens(self, group: KVGroupLayout) -> int:
        """Tokens of KV the pool holds for this group, were it alone (all groups draw on the same blocks)."""
        return (self.num_blocks - 1) * group.block_size

    @property
    def tokens(self) -> int:
        """Tokens of KV the pool holds for a full-attention group: the context it can hold."""
        return self.group_tokens(next((g for g in self.groups if g.window is None), self.groups[0]))

    def describe(self) -> str:
        m = self.measured
        groups = ", ".join(
            f"{g.name} ({g.num_layers} layers{f', window {g.window}' if g.window else ''}): "
            f"{self.group_tokens(g):,} tokens"
            for g in self.groups
        )
        return (
            f"GPU memory (GiB): total {m.total / GIB:.2f}, weights {m.weights / GIB:.2f}, activations "
            f"{m.activations / GIB:.2f}, graphs {m.graphs / GIB:.2f}, other {m.other / GIB:.2f}, left "
            f"{m.left / GIB:.2f}; KV cache {self.kv_bytes / GIB:.2f} ({sizing_rule(self.fraction, self.utilization)}): "
            f"{self.num_blocks:,} blocks; KV tokens per group, one pool: {groups}"
        )


def blocks_for_one_request(groups: Sequence[KVGroupLayout], max_seq_len: int, max_num_tokens: int) -> int:
    """Blocks one request of max_seq_len holds at its peak (plus the null block): every token in full-attention
    groups; a window plus one step's chunk in sliding groups."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    need = 1
    for g in groups:
        tokens = max_seq_len if g.window is None else min(max_seq_len, g.window + max_num_tokens)
        need += cdiv(tokens, g.block_size) + (0 if g.window is None else 1)
    return need


def sizing_rule(fraction: float, utilization: float | None) -> str:
    if utilization is None:
        return f"{FRACTION_SETTING} {fraction:g} of what is left"
    return f"{UTILIZATION_SETTING} {utilization:g}: what is left of {utilization:.0%} of the total"


def plan_kv_cache(
    measured: MemoryMeasurement,
    *,
    fraction: float,
    bytes_per_block: int,
    groups: Sequence[KVGroupLayout],
    max_seq_len: int,
    max_num_tokens: int,
    utilization: float | None = None,
) -> KVCachePlan:
    """The pool: `fraction` of the memory left after weights, activations, graphs and the rest, or, given vLLM's
    `utilization`, what those leave of that share of the whole device; an error naming the settings to change
    when that cannot hold one request of max_seq_len."""
    need = blocks_for_one_request(groups, max_seq_len, max_num_tokens)
    if utilization is None:
        kv_bytes = max(0, int(measured.left * fraction))
    else:
        kv_bytes = max(0, round(utilization * measured.total) - (measured.total - measured.left))
    num_blocks = kv_bytes // bytes_per_block
    if num_blocks < need:
        m = measured
        raise InsufficientKVMemoryError(
            f"not enough GPU memory for the KV cache: of {m.total / GIB:.2f} GiB, the weights take "
            f"{m.weights / GIB:.2f}, a step of max_num_tokens={max_num_tokens} takes {m.activations / GIB:.2f} for "
            f"activations, graphs {m.graphs / GIB:.2f} and the CUDA context and libraries {m.other / GIB:.2f}, "
            f"leaving {max(m.left, 0) / GIB:.2f} GiB; {sizing_rule(fraction, utilization)} gives {num_blocks} KV "
            f"blocks, but one request of max_seq_len={max_seq_len} needs {need} ({need * bytes_per_block / GIB:.2f} "
            f"GiB). Raise {FRACTION_SETTING if utilization is None else UTILIZATION_SETTING}, lower max_seq_len or "
            f"max_num_tokens (or cuda_graph_config's max_batch_size), or split the model over more GPUs (tp_size)"
        )
    return KVCachePlan(measured, fraction, utilization, kv_bytes, bytes_per_block, num_blocks, tuple(groups))


@contextmanager
def out_of_memory_as(advice: Callable[[], str]) -> Iterator[None]:
    """A CUDA out-of-memory error in the block becomes a start-up error saying what to change (`advice()`, asked
    then); any other error passes unchanged."""
    try:
        yield
    except Exception as exc:
        if type(exc).__name__ != "OutOfMemoryError":  # torch.cuda.OutOfMemoryError, by name: no torch import here
            raise
        raise InsufficientKVMemoryError(advice()) from exc


def measure_profile_run(
    device: Any,
    weights: int,
    profile_step: Callable[[], object],
    *,
    cuda: Any = None,
) -> MemoryMeasurement:
    """Run the profiling step, measuring what it takes. `cuda` is torch.cuda unless a test passes a stand-in with
    the same functions. Call it after the weights are loaded and before the KV cache is."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    cuda.synchronize(device)
    cuda.reset_peak_memory_stats(device)
    before = cuda.memory_allocated(device)

    def advice() -> str:
        total = cuda.mem_get_info(device)[1]
        return (
            f"the profiling step (one forward pass of max_num_tokens tokens over up to max_batch_size sequences) ran "
            f"out of GPU memory: the weights take {weights / GIB:.2f} of {total / GIB:.2f} GiB. Lower max_num_tokens "
            f"or max_batch_size, or split the model over more GPUs (tp_size)"
        )

    with out_of_memory_as(advice):
        profile_step()
        cuda.synchronize(device)
    activations = cuda.max_memory_allocated(device) - before
    cuda.empty_cache()
    free, total = cuda.mem_get_info(device)
    # Reserved bytes held by torch after empty_cache are the weights, graph pools and live tensors; the rest of
    # what the device has in use belongs to the CUDA context and libraries outside torch's allocator.
    other = max(0, (total - free) - cuda.memory_reserved(device))
    return MemoryMeasurement(total=total, weights=weights, activations=activations, other=other)


def available_host_memory() -> int:
    """Bytes of RAM a new allocation can take without swapping: the kernel's MemAvailable (free pages plus the
    page cache and other memory it can reclaim; loading a checkpoint of N GB leaves about N GB of its pages cached,
    which MemFree counts as used), else the free pages where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def profile_batch_shape(max_num_tokens: int, max_batch_size: int) -> list[int]:
    """Tokens per sequence of the profiling step: max_num_tokens spread over up to max_batch_size sequences (each
    sampling a row, so a full batch of logits is part of the peak)."""
    num_seqs = max(1, min(max_batch_size, max_num_tokens))
    base, extra = divmod(max_num_tokens, num_seqs)
    return [base + (1 if i < extra else 0) for i in range(num_seqs)]


def log_plan(plan: KVCachePlan) -> None:
    logger.info("%s", plan.describe())
