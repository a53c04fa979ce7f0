"""A pool of ref-counted KV blocks with an LRU free queue and a prefix-cache index.

Block 0 is the null block: never handed out, it pads block tables. Every other block is either in
the free queue (ref_cnt 0; it may still hold cached content until it is reused) or in use (ref_cnt
> 0), so `num_free + num_used == num_usable` always holds. With a host tier (host_tier.py), cached
content a reuse evicts is handed to it first (`on_evict`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

NULL_BLOCK = 0


@dataclass(frozen=True)
class BlockKey:
    """Identity of a full block's content: KV group, chained hash, and the tokens for verification."""

    group: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


def verified_lookup(index: dict[tuple[int, int], int], keys: list[BlockKey | None], key: BlockKey) -> int | None:
    """The block `index` lists for the key's (group, hash), if `keys` says it holds exactly this content."""
    block_id = index.get((key.group, key.block_hash))
    if block_id is None or keys[block_id] != key:
        return None
    return block_id


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        # Flat per-block arrays rather than objects: pools of 10^5-10^6 blocks are built at start-up.
        self.ref_cnt = [0] * num_blocks
        self.ref_cnt[NULL_BLOCK] = 1  # pinned forever
        self.keys: list[BlockKey | None] = [None] * num_blocks  # set while a block is in the prefix index
        # LRU order: allocation pops from the front, so cached content freed longest ago goes first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[tuple[int, int], int] = {}  # (group, hash) -> block id
        # Called with each block whose cached content a reuse evicts, before it goes (the host tier's offload).
        self.on_evict: Callable[[int, BlockKey], None] | None = None

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")  # callers check first
        ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            key = self.keys[block_id]
            if key is not None and self.on_evict is not None:
                self.on_evict(block_id, key)
            self._uncache(block_id)
            self.ref_cnt[block_id] = 1
            ids.append(block_id)
        return ids

    def touch(self, block_id: int) -> None:
        """Take one more reference (a prefix-cache hit or a shared prefix)."""
        if self.ref_cnt[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int], reuse_first: bool = False) -> None:
        """Drop one reference from each; pass a sequence's blocks tail first so its tail is evicted first.
        reuse_first: blocks that hold nothing worth caching (rejected draft slots) go to the front of the queue,
        so the next allocation takes them rather than evict a cached block."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK:
                continue
            if self.ref_cnt[block_id] <= 0:
                raise RuntimeError(f"KV block {block_id} freed more often than taken")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None
                if reuse_first:
                    self.free_queue.move_to_end(block_id, last=False)

    def lookup(self, key: BlockKey) -> int | None:
        """The block holding exactly this content, if cached (tokens and parent verified, not just the hash)."""
        return verified_lookup(self.cached, self.keys, key)

    def cache(self, block_id: int, key: BlockKey) -> None:
        if self.keys[block_id] is not None or (key.group, key.block_hash) in self.cached:
            return  # already indexed, or another block holds the same content
        self.keys[block_id] = key
        self.cached[(key.group, key.block_hash)] = block_id

    def _uncache(self, block_id: int) -> None:
        key = self.keys[block_id]
        if key is not None:
            self.cached.pop((key.group, key.block_hash), None)
            self.keys[block_id] = None

    def check_invariants(self) -> None:
        free = set(self.free_queue)
        for block_id in range(1, self.num_blocks):
            ref = self.ref_cnt[block_id]
            if ref < 0 or (ref == 0) != (block_id in free):
                raise AssertionError(f"block {block_id}: ref_cnt {ref}, in free queue {block_id in free}")
        for (group, h), block_id in self.cached.items():
            key = self.keys[block_id]
            if key is None or (key.group, key.block_hash) != (group, h):
                raise AssertionError(f"prefix index entry ({group}, {h}) points at block {block_id} with key {key}")
        if self.num_free + self.num_used != self.num_usable:
            raise AssertionError("free + used != total")
