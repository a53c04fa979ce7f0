"""A pool of ref-counted KV blocks with an LRU free queue and a prefix-cache index.

Block 0 is the null block: never handed out, it pads block tables. Every other block is either in
the free queue (ref_cnt 0; it may still hold cached content until it is reused) or in use (ref_cnt
> 0), so `num_free + num_used == num_usable` always holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

NULL_BLOCK = 0


@dataclass(frozen=True)
class BlockKey:
    """Identity of a full block's content: KV group, chained hash, and the tokens for verification."""

    group: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None  # set while the block is in the prefix-cache index


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK].ref_cnt = 1  # pinned forever
        # LRU order: allocation pops from the front, so cached content freed longest ago goes first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[tuple[int, int], int] = {}  # (group, hash) -> block id

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
            block = self.blocks[block_id]
            self._uncache(block)
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_id: int) -> None:
        """Take one more reference (a prefix-cache hit or a shared prefix)."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each; pass a sequence's blocks tail first so its tail is evicted first."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK:
                continue
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV block {block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None

    def lookup(self, key: BlockKey) -> int | None:
        """The block holding exactly this content, if cached (tokens and parent verified, not just the hash)."""
        block_id = self.cached.get((key.group, key.block_hash))
        if block_id is None or self.blocks[block_id].key != key:
            return None
        return block_id

    def cache(self, block_id: int, key: BlockKey) -> None:
        block = self.blocks[block_id]
        if block.key is not None or (key.group, key.block_hash) in self.cached:
            return  # already indexed, or another block holds the same content
        block.key = key
        self.cached[(key.group, key.block_hash)] = block_id

    def _uncache(self, block: KVBlock) -> None:
        if block.key is not None:
            self.cached.pop((block.key.group, block.key.block_hash), None)
            block.key = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._uncache(block)

    def check_invariants(self) -> None:
        free = set(self.free_queue)
        for block in self.blocks[1:]:
            if (block.ref_cnt == 0) != (block.block_id in free):
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue {block.block_id in free}")
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has negative ref_cnt")
        for (group, h), block_id in self.cached.items():
            key = self.blocks[block_id].key
            if key is None or (key.group, key.block_hash) != (group, h):
                raise AssertionError(f"prefix index entry ({group}, {h}) points at block {block_id} with key {key}")
        if self.num_free + self.num_used != self.num_usable:
            raise AssertionError("free + used != total")
