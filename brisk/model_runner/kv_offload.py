"""The host KV tier's memory on one rank, and the block copies between it and the device pool.

The scheduler's books (kv_cache/host_tier.py) decide the copies; each step's `SchedulerOutput.kv_block_copies`
lists them in order, and the runner runs them before that step's forward. A block is its raw bytes in every KV
tensor (each layer slot's K and V; whatever their dtype: an FP8 cache with static per-layer scales copies the
same way). Host memory mirrors the device tensors' shapes with `num_host_blocks` blocks; pinned on a GPU, so the
copies are DMA transfers. It is pinned by registering ordinary memory with CUDA (`cudaHostRegister`, as torch's
checkpoint stager and SGLang's host KV pool do), not by `pin_memory=True`: torch's caching host allocator rounds every
pinned allocation up to a power of two, which would lock up to twice `host_cache_size` of RAM.

On a GPU the copies run on a copy stream: it waits for the work already queued (a block evicted now may still be
written by the step in flight), copies, and the step's forward waits for it only when it starts, so the transfers
overlap the step's host-side preparation and never stall the host. On a CPU they run at once, in the same order.
Consecutive block ids copied to consecutive host blocks go as one slice copy.
"""

from __future__ import annotations

import torch

from brisk.errors import ConfigError
from brisk.kv_cache.host_tier import KVBlockCopy
from brisk.layers.attention import Attention
from brisk.model_runner.memory import available_host_memory


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
    def __init__(self, device_tensors: list[torch.Tensor], num_host_blocks: int, device: torch.device) -> None:
        self.device_tensors = device_tensors
        self.num_blocks = num_host_blocks
        self.host_tensors = [torch.empty((num_host_blocks, *t.shape[1:]), dtype=t.dtype) for t in device_tensors]
        self._registered: list[int] = []  # host tensors' addresses registered with CUDA (unregistered by close())
        if device.type == "cuda":
            cudart = torch.cuda.cudart()
            for t in self.host_tensors:
                status = int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
                if status != 0:
                    self.close()
                    raise RuntimeError(f"pinning the host KV tier failed (cudaHostRegister error {status})")
                self._registered.append(t.data_ptr())
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending = False

    def close(self) -> None:
        """Unpin the host tensors (before their memory is freed: an address left registered would make a later
        registration of the same range fail)."""
        if self._registered:
            if self.stream is not None:
                self.stream.synchronize()  # no copy in flight reads or writes them
            cudart = torch.cuda.cudart()
            for address in self._registered:
                cudart.cudaHostUnregister(address)
            self._registered = []

    @classmethod
    def for_layers(
        cls, attn_layers: list[Attention], draft_kv: list[torch.Tensor], host_cache_size: int, device: torch.device
    ) -> HostKVCache:
        """A tier of `host_cache_size` bytes for the KV tensors bound to `attn_layers` and a drafter's `draft_kv`; a
        size beyond the RAM available, or under one block, is a start-up error naming the option."""
        tensors = kv_tensors_of(attn_layers, draft_kv)
        per_block = block_bytes(tensors)
        available = available_host_memory()
        if host_cache_size > available:
            raise ConfigError(
                f"kv_cache_config.host_cache_size is {host_cache_size / 2**30:.2f} GiB but this machine has "
                f"{available / 2**30:.2f} GiB of RAM available: give a smaller host KV tier"
            )
        num_blocks = host_cache_size // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_config.host_cache_size ({host_cache_size} bytes) holds no KV block ({per_block} bytes a "
                "block on this rank): give at least that, or 0 for no host tier"
            )
        return cls(tensors, num_blocks, device)

    @property
    def bytes_per_block(self) -> int:
        return block_bytes(self.device_tensors)

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
        for to_host, src, dst, n in _runs(copies):
            for device_tensor, host_tensor in zip(self.device_tensors, self.host_tensors):
                if to_host:
                    host_tensor[dst : dst + n].copy_(device_tensor[src : src + n], non_blocking=True)
                else:
                    device_tensor[dst : dst + n].copy_(host_tensor[src : src + n], non_blocking=True)


def _runs(copies: list[KVBlockCopy]) -> list[tuple[bool, int, int, int]]:
    """The copies as (to_host, first source block, first destination block, count), in order: consecutive copies
    of one direction whose source and destination both continue the last one's merge."""
    runs: list[tuple[bool, int, int, int]] = []
    for c in copies:
        src, dst = (c.device_block, c.host_block) if c.to_host else (c.host_block, c.device_block)
        if runs:
            to_host, s0, d0, n = runs[-1]
            if to_host == c.to_host and src == s0 + n and dst == d0 + n:
                runs[-1] = (to_host, s0, d0, n + 1)
                continue
        runs.append((c.to_host, src, dst, 1))
    return runs
