"""The host-memory KV tier's books: which evicted prefix-cache blocks host memory holds, in LRU order.

With `kv_cache_config.host_cache_size` > 0, a full prefix-cache block that the device pool evicts (`BlockPool`
reuses a free block that still holds cached content) is copied to a host block instead of being dropped; the
host tier indexes it by the same `BlockKey`. A request whose prefix misses on the device but hits here gets fresh
device blocks and the host blocks are copied back into them (the manager's `allocate_slots`), so the scheduler
only advances `num_computed_tokens`, as for a device hit.

This class keeps the books only. The copies it decides are `KVBlockCopy`s, in the order they were decided; the
scheduler hands them to the runner with the next step that runs (`SchedulerOutput.kv_block_copies`), which runs
them before that step's forward (model_runner/kv_offload.py). Order matters: a device block is copied out before
a later copy fills it, and a host block read by a copy-in is pinned (never reused) until the copies are taken.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from brisk.kv_cache.block_pool import BlockKey, verified_lookup


class KVBlockCopy(msgspec.Struct, array_like=True, frozen=True):
    """One block's KV copied between the device pool and the host tier (every layer, K and V, its raw bytes)."""

    to_host: bool  # True: device block -> host block (an eviction); False: host -> device (a host hit)
    device_block: int
    host_block: int


class HostTier:
    def __init__(self, num_blocks: int, bytes_per_block: int) -> None:
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        self.keys: list[BlockKey | None] = [None] * num_blocks
        self.index: dict[tuple[int, int], int] = {}  # (group, hash) -> host block
        # LRU order of the blocks that may be reused: empty ones first, then content stored or hit longest ago.
        self.lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.pinned: set[int] = set()  # read by a copy-in not yet handed to the runner
        self.copies: list[KVBlockCopy] = []
        # Cumulative counts for /metrics.
        self.blocks_to_host = 0
        self.blocks_to_device = 0

    @property
    def num_used(self) -> int:
        return len(self.index)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def lookup(self, key: BlockKey) -> int | None:
        return verified_lookup(self.index, self.keys, key)

    def offload(self, device_block: int, key: BlockKey) -> None:
        """The device pool evicts `device_block` holding `key`: keep its content here (the LRU host block goes)."""
        held = self.lookup(key)
        if held is not None:  # already here (it came from here, or was evicted before): now the most recent
            if held in self.lru:
                self.lru.move_to_end(held)
            return
        if not self.lru:
            return  # every host block is pinned by this step's copy-ins: the content is dropped, as without a tier
        block, _ = self.lru.popitem(last=False)
        old = self.keys[block]
        if old is not None:
            del self.index[(old.group, old.block_hash)]
        self.keys[block] = key
        self.index[(key.group, key.block_hash)] = block
        self.lru[block] = None
        self.copies.append(KVBlockCopy(True, device_block, block))
        self.blocks_to_host += 1

    def onboard(self, host_block: int, device_block: int) -> None:
        """Copy a hit back into a fresh device block; the host block keeps its content. The caller pinned it first."""
        self.copies.append(KVBlockCopy(False, device_block, host_block))
        self.blocks_to_device += 1

    def pin(self, host_block: int) -> None:
        """Until the copies are taken: no eviction in this step reuses the block before its copy-in reads it."""
        self.lru.pop(host_block, None)
        self.pinned.add(host_block)

    def take_copies(self) -> list[KVBlockCopy]:
        """The copies decided since the last call, in order (for the step about to run); unpins their host blocks
        as the most recently used."""
        copies, self.copies = self.copies, []
        for block in self.pinned:
            self.lru[block] = None
        self.pinned.clear()
        return copies

    def check_invariants(self) -> None:
        for (group, h), block in self.index.items():
            key = self.keys[block]
            if key is None or (key.group, key.block_hash) != (group, h):
                raise AssertionError(f"host tier entry ({group}, {h}) points at host block {block} with key {key}")
        if sum(k is not None for k in self.keys) != len(self.index):
            raise AssertionError("a host block holds content the host index does not list")
        if len(self.lru) + len(self.pinned) != self.num_blocks or self.pinned & set(self.lru):
            raise AssertionError("host blocks: LRU + pinned != total")
