"""The host KV tier's memory on one rank, and the block copies between it and the device pool.

The scheduler's books (kv_cache/host_tier.py) decide the copies; each step's `SchedulerOutput.kv_block_copies`
lists them in order, and the runner runs them before that step's forward. A block is its raw bytes in every KV
tensor (each layer slot's K and V; whatever their dtype: an FP8 cache with static per-layer scales copies the
same way). The host tier stores them block-major: host block h is one row of `bytes_per_block` bytes, every KV
tensor's bytes of the block side by side (as SGLang's HiCache "page first" layout). It is pinned on a GPU by
registering ordinary memory with CUDA (`cudaHostRegister`, as torch's checkpoint stager and SGLang's host KV pool
do), not by `pin_memory=True`: torch's caching host allocator rounds every pinned allocation up to a power of two,
which would lock up to twice `host_cache_size` of RAM.

The device pool keeps each layer's K and V in a tensor of its own, so one block is scattered over them all (72
tensors for gpt-oss-120b). On a GPU, copying block by block, tensor by tensor, would be one small transfer per
block and tensor: ~0.5 ms of host time per block, whole seconds for a long prompt's evictions, and PCIe far from
its bandwidth. So on a GPU the copies of a step go in batches through a device staging buffer of whole blocks
(`staged`): a gather per KV tensor packs the batch's blocks into it (one kernel per tensor, whatever the number of
blocks), and one transfer per run of consecutive host blocks moves them (copy-ins: the reverse, then a scatter per
tensor); a batch costs two operations per KV tensor plus one per host run. On a CPU, where a copy call costs less
than moving a block's bytes, each block's bytes go straight between the two, one pass over them.

On a GPU the copies run on a copy stream: it waits for the work already queued (a block evicted now may still be
written by the step in flight), copies, and the step's forward waits for it only when it starts, so the transfers
overlap the step's host-side preparation and never stall the host. On a CPU they run at once, in the same order.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

from brisk.errors import ConfigError
from brisk.host import to_device
from brisk.kv_cache.host_tier import KVBlockCopy
from brisk.layers.attention import Attention
from brisk.model_runner.memory import available_host_memory

STAGING_BYTES = 64 << 20  # the device staging buffer: at most this, and at least one block


def kv_tensors_of(attn_layers: list[Attention], extra: list[torch.Tensor]) -> list[torch.Tensor]:
    """The distinct KV tensors bound to the layers (slot tensors are shared across groups), and `extra` (a drafter's
    KV in the same blocks)."""
    seen: dict[int, torch.Tensor] = {}
    for cache in [t for layer in attn_layers for t in (layer.k_cache, layer.v_cache)] + extra:
        seen.setdefault(cache.data_ptr(), cache)
    return list(seen.values())


def block_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in tensors)


class HostKVCache:
    def __init__(
        self,
        device_tensors: list[torch.Tensor],
        num_host_blocks: int,
        device: torch.device,
        staged: bool | None = None,
    ) -> None:
        """staged: batches through a device staging buffer (default: on a GPU; a test may ask for it on a CPU)."""
        # Each KV tensor as [blocks, its bytes of one block] (the tensors are contiguous views of raw slot buffers).
        as_bytes = [t.view(t.shape[0], -1).view(torch.uint8) for t in device_tensors]
        offsets = list(accumulate((t.shape[1] for t in as_bytes), initial=0))
        self.segments = list(zip(as_bytes, offsets, offsets[1:]))  # (tensor, its bytes' start and end)
        self.bytes_per_block = offsets[-1]
        self.num_blocks = num_host_blocks
        self.host_blocks = torch.empty((num_host_blocks, self.bytes_per_block), dtype=torch.uint8)
        self.staging: torch.Tensor | None = None
        if device.type == "cuda" if staged is None else staged:
            rows = max(1, min(num_host_blocks, STAGING_BYTES // self.bytes_per_block))
            self.staging = torch.empty((rows, self.bytes_per_block), dtype=torch.uint8, device=device)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending = False
        self._registered = False  # host_blocks pinned with CUDA (unregistered by close())
        if device.type == "cuda":
            status = int(torch.cuda.cudart().cudaHostRegister(self.host_blocks.data_ptr(), self.host_blocks.nbytes, 0))
            if status != 0:
                raise RuntimeError(
                    f"pinning the host KV tier ({self.host_blocks.nbytes / 2**30:.2f} GiB) failed (cudaHostRegister "
                    f"error {status}): give a smaller kv_cache_config.host_cache_size"
                )
            self._registered = True

    def close(self) -> None:
        """Unpin the host blocks (before their memory is freed: an address left registered would make a later
        registration of the same range fail)."""
        if self._registered:
            if self.stream is not None:
                self.stream.synchronize()  # no copy in flight reads or writes them
            torch.cuda.cudart().cudaHostUnregister(self.host_blocks.data_ptr())
            self._registered = False

    @classmethod
    def for_layers(
        cls,
        attn_layers: list[Attention],
        draft_kv: list[torch.Tensor],
        host_cache_size: int,
        device: torch.device,
        ranks_on_this_machine: int = 1,
    ) -> HostKVCache:
        """A tier of `host_cache_size` bytes for the KV tensors bound to `attn_layers` and a drafter's `draft_kv`; a
        size beyond the RAM available to each of this machine's ranks, or under one block, is a start-up error
        naming the option."""
        tensors = kv_tensors_of(attn_layers, draft_kv)
        per_block = block_bytes(tensors)
        available = available_host_memory() // ranks_on_this_machine  # each rank pins its own tier
        if host_cache_size > available:
            ranks = f", for each of its {ranks_on_this_machine} ranks" if ranks_on_this_machine > 1 else ""
            raise ConfigError(
                f"kv_cache_config.host_cache_size is {host_cache_size / 2**30:.2f} GiB but this machine has "
                f"{available / 2**30:.2f} GiB of RAM available{ranks}: give a smaller host KV tier"
            )
        num_blocks = host_cache_size // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_config.host_cache_size ({host_cache_size} bytes) holds no KV block ({per_block} bytes a "
                "block on this rank): give at least that, or 0 for no host tier"
            )
        return cls(tensors, num_blocks, device)

    def start(self, copies: list[KVBlockCopy]) -> None:
        """Launch a step's copies (on a CPU: do them)."""
        if not copies:
            return
        if self.stream is None:
            self._copy(copies)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self._copy(copies)
        self._pending = True

    def wait(self) -> None:
        """The step's forward reads the copied blocks: its stream waits for the copies (the host does not)."""
        if self._pending and self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._pending = False

    def _copy(self, copies: list[KVBlockCopy]) -> None:
        """The copies in order: on a CPU block by block; staged, a batch at a time (all on one stream: a batch's
        staging rows are reused only after its transfers)."""
        if self.staging is None:
            for c in copies:
                host_block = self.host_blocks[c.host_block]
                for tensor, start, end in self.segments:
                    if c.to_host:
                        host_block[start:end].copy_(tensor[c.device_block])
                    else:
                        tensor[c.device_block].copy_(host_block[start:end])
            return
        for to_host, batch in copy_batches(copies, self.staging.shape[0]):
            staged = self.staging[: len(batch)]
            device_ids = to_device(np.array([c.device_block for c in batch], dtype=np.int64), self.device)
            runs = host_runs([c.host_block for c in batch])
            if to_host:
                for tensor, start, end in self.segments:
                    staged[:, start:end] = tensor.index_select(0, device_ids)
                for first, row, n in runs:
                    self.host_blocks[first : first + n].copy_(staged[row : row + n], non_blocking=True)
            else:
                for first, row, n in runs:
                    staged[row : row + n].copy_(self.host_blocks[first : first + n], non_blocking=True)
                for tensor, start, end in self.segments:
                    tensor.index_copy_(0, device_ids, staged[:, start:end])


def copy_batches(copies: list[KVBlockCopy], max_rows: int) -> list[tuple[bool, list[KVBlockCopy]]]:
    """The copies in order as batches of one direction, at most `max_rows` each, none writing a block twice (a
    batch's writes go at once: a later copy into the same block must come in a later batch to win, as in order)."""
    batches: list[tuple[bool, list[KVBlockCopy]]] = []
    written: set[int] = set()
    for c in copies:
        target = c.host_block if c.to_host else c.device_block
        if not batches or batches[-1][0] != c.to_host or len(batches[-1][1]) == max_rows or target in written:
            batches.append((c.to_host, []))
            written = set()
        batches[-1][1].append(c)
        written.add(target)
    return batches


def host_runs(host_blocks: list[int]) -> list[tuple[int, int, int]]:
    """A batch's host blocks as (first host block, first staging row, count): runs of consecutive host blocks in
    consecutive rows, each one transfer."""
    runs: list[tuple[int, int, int]] = []
    for row, host in enumerate(host_blocks):
        if runs and host == runs[-1][0] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((host, row, 1))
    return runs
