"""KV cache manager: per-request block tables per KV group, prefix caching, sliding-window release.

Layers are grouped by attention type (gpt-oss: full-attention layers and sliding-window layers). All
groups draw from one `BlockPool`: block id b stands for slot b in each group's layer tensors, so a
block handed to the sliding group holds KV for the sliding layers only (see ModelRunner's layout).
A sliding group's table keeps the null block where tokens have fallen out of the window, so half of
gpt-oss's layers cost O(window) memory instead of O(context).

Groups may differ in tokens a block (`block_sizes`: an FP8 group beside a model-dtype one holds twice the tokens
in the same bytes; model_runner/kv_tensors.py). `block_size` is the smallest, the hashing unit: prefix caching
hashes each unit of block_size tokens by (parent hash, token ids), and a group's block of k units is keyed by its
last unit's hash (the chain covers every token before it), so hits come in whole blocks of every group.

A hit is verified against the stored tokens. A hit must leave at least one token to compute (its logits are needed). A request's cache_salt
is its first block's parent: requests share blocks only with requests of the same salt (or none).

Host tier (host_tier.py, `kv_cache_config.host_cache_size`): cached blocks the pool evicts are copied to host
memory; a prefix block found there (and not on the device) counts as found, and admission copies it back into a
fresh device block, indexed again. The scheduler sees a host hit exactly as a device hit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from brisk.kv_cache.block_pool import NULL_BLOCK, BlockKey, BlockPool
from brisk.kv_cache.host_tier import HostTier, KVBlockCopy


class KVRequest(Protocol):
    request_id: str
    num_computed_tokens: int
    cache_salt: str | None

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> list[int]: ...


@dataclass(frozen=True)
class KVGroupSpec:
    layer_ids: tuple[int, ...]
    sliding_window: int | None = None


@dataclass
class PrefixHit:
    num_tokens: int
    # Per group; the null block where a sliding window needs nothing; -1 - h: host block h (host tier), copied into
    # a fresh device block at admission.
    blocks: list[list[int]]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        groups: list[KVGroupSpec],
        num_blocks: int,
        block_sizes: list[int],
        enable_prefix_caching: bool,
        host_tier: HostTier | None = None,
    ):
        """block_sizes: tokens a block of each group holds, each a multiple of the smallest."""
        self.groups = groups
        self.block_sizes = block_sizes
        self.block_size = min(block_sizes)  # the hashing unit
        if any(bs % self.block_size for bs in block_sizes):
            raise ValueError(f"KV groups' block sizes {block_sizes} are not multiples of the smallest")
        self.units = [bs // self.block_size for bs in block_sizes]  # hashing units a block of each group
        self.hit_unit = math.lcm(*self.units)  # a prefix hit is whole blocks of every group
        # Every table of a request holds the blocks for the same tokens, so the group of the smallest blocks runs
        # out of room first and grows whenever another does (another group's block ends where one of its blocks
        # does): the group to watch.
        self.tightest_group = block_sizes.index(self.block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host_tier = host_tier if enable_prefix_caching else None
        if self.host_tier is not None:
            self.pool.on_evict = self.host_tier.offload
        self._no_sliding = all(g.sliding_window is None for g in groups)
        self._next_release: dict[str, int] = {}  # sliding windows: when a request next has a block to release
        self.tables: dict[str, list[list[int]]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: its leading hashing units in the prefix index
        self._hashes: dict[str, list[tuple[int, int | None, tuple[int, ...]]]] = {}
        self.prefix_queries = 0  # tokens looked up (admitted requests only: record_prefix_lookup)
        self.prefix_hits = 0  # tokens found
        self.host_hits = 0  # prompt tokens whose KV the host tier gave back (admitted requests only)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_usable

    def max_blocks_per_request(self, num_tokens: int) -> int:
        """Blocks one request of this length needs at most (all groups); admission must never exceed the pool."""
        return sum(cdiv(num_tokens, bs) for bs in self.block_sizes)

    # ---- prefix cache --------------------------------------------------------------------------
    def get_computed_blocks(self, req: KVRequest) -> PrefixHit:
        empty = PrefixHit(0, [[] for _ in self.groups])
        if not self.enable_prefix_caching:
            return empty
        bs = self.block_size
        max_units = (req.num_tokens - 1) // bs
        hashes = self._block_hashes(req, max_units)
        found = [  # per group, its blocks: each keyed by its last unit
            [self._lookup(BlockKey(g, *hashes[(i + 1) * k - 1])) for i in range(max_units // k)]
            for g, k in enumerate(self.units)
        ]
        limit = max_units
        for g, spec in enumerate(self.groups):
            if spec.sliding_window is None:
                missing = next((i for i, b in enumerate(found[g]) if b is None), len(found[g]))
                limit = min(limit, missing * self.units[g])
        for n in range(limit - limit % self.hit_unit, 0, -self.hit_unit):
            blocks: list[list[int]] = []
            for g in range(len(self.groups)):
                start, end = self._first_needed_block(g, n * bs), n // self.units[g]
                needed = [b for b in found[g][start:end] if b is not None]
                if len(needed) < end - start:
                    break  # a block this group still reads is not cached: try a shorter prefix
                blocks.append([NULL_BLOCK] * start + needed)
            else:
                return PrefixHit(n * bs, blocks)
        return empty

    def record_prefix_lookup(self, req: KVRequest, hit: PrefixHit) -> None:
        """Count a lookup into the hit-rate counters once its request is admitted, as vLLM does: a request that
        waits for blocks is looked up again at every step, and counting each of those would inflate both counters.
        A preempted request coming back counts again (what it finds is KV not recomputed, from the host tier too;
        vLLM counts those apart); one whose prompt logprobs skip the cache does not."""
        if not self.enable_prefix_caching:
            return
        self.prefix_queries += req.num_tokens
        self.prefix_hits += hit.num_tokens
        if self.host_tier is not None:  # the tokens some group's KV comes back from host memory for
            from_host = {
                u
                for t, k in zip(hit.blocks, self.units)
                for i, b in enumerate(t)
                if b < 0
                for u in range(i * k, i * k + k)
            }
            self.host_hits += self.block_size * len(from_host)

    def _lookup(self, key: BlockKey) -> int | None:
        """The device block holding `key`, else -1 - h for host block h holding it, else None."""
        block = self.pool.lookup(key)
        if block is None and self.host_tier is not None:
            host = self.host_tier.lookup(key)
            if host is not None:
                return -1 - host
        return block

    def _first_needed_block(self, g: int, num_computed: int) -> int:
        """First block index of group g the next query (at position num_computed) still reads."""
        window = self.groups[g].sliding_window
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_sizes[g]

    def _block_hashes(self, req: KVRequest, n: int) -> list[tuple[int, int | None, tuple[int, ...]]]:
        hashes = self._hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        bs = self.block_size
        # cache_salt: the first block's parent, so every block of a salted prompt is keyed by its salt (the salt's
        # hash is keyed per process: one without the salt cannot make it)
        salt = None if req.cache_salt is None else hash(("cache_salt", req.cache_salt))
        while len(hashes) < n:
            i = len(hashes)
            parent = hashes[-1][0] if hashes else salt
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            hashes.append((hash((parent, toks)), parent, toks))
        return hashes[:n]

    def cache_full_blocks(self, req: KVRequest, num_tokens: int | None = None) -> None:
        """Index the request's blocks whose first `num_tokens` (default: the computed ones) are all known."""
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        n_full = (req.num_computed_tokens if num_tokens is None else num_tokens) // self.block_size  # units
        start = self.num_cached_blocks.get(rid, 0)
        if n_full <= start:
            return
        hashes = self._block_hashes(req, n_full)
        for g, (table, k) in enumerate(zip(self.tables[rid], self.units)):
            for i in range(start // k, n_full // k):  # the group's blocks that became full
                if table[i] != NULL_BLOCK:
                    self.pool.cache(table[i], BlockKey(g, *hashes[(i + 1) * k - 1]))
        self.num_cached_blocks[rid] = n_full

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, req: KVRequest, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens; on a first admission `hit` adopts cached blocks.

        Returns False, changing nothing, when the pool cannot hold them.
        """
        rid = req.request_id
        if hit is not None:
            tables = [list(b) for b in hit.blocks]
            num_computed = hit.num_tokens
        else:
            tables = self.tables[rid]
            num_computed = req.num_computed_tokens
            if not self._no_sliding and num_computed >= self._next_release.get(rid, 0):
                if self.enable_prefix_caching:  # index what leaves the window before it goes back to the pool
                    self.cache_full_blocks(req, min(num_computed, req.num_tokens))
                self._release_out_of_window(tables, num_computed)
                self._next_release[rid] = self._next_release_at(num_computed)
            if len(tables[self.tightest_group]) * self.block_size >= num_computed + num_new_tokens:
                return True  # the common decode step: O(1) while the last block has room
        total = num_computed + num_new_tokens
        needed = [max(0, cdiv(total, bs) - len(t)) for t, bs in zip(tables, self.block_sizes)]
        reused_free = 0
        if hit is not None:  # its device blocks still in the free queue, and its host blocks (each a fresh block)
            reused_free = sum(1 for t in tables for b in t if b < 0 or (b != NULL_BLOCK and self.pool.ref_cnt[b] == 0))
        if sum(needed) + reused_free > self.pool.num_free:
            return False
        if hit is not None:
            for t in tables:
                for b in t:
                    if b > NULL_BLOCK:
                        self.pool.touch(b)
            self._onboard(req, tables)
            self.tables[rid] = tables
            self.num_cached_blocks[rid] = hit.num_tokens // self.block_size  # units
        for t, n in zip(tables, needed):
            t.extend(self.pool.allocate(n))
        return True

    def _onboard(self, req: KVRequest, tables: list[list[int]]) -> None:
        """Replace a hit's host blocks by fresh device blocks, their copies decided and the blocks indexed."""
        host = self.host_tier
        if host is None or not any(b < 0 for t in tables for b in t):
            return
        for t in tables:  # pinned first: the evictions of the allocations below must not reuse them
            for b in t:
                if b < 0:
                    host.pin(-1 - b)
        hashes = self._block_hashes(req, max(len(t) * k for t, k in zip(tables, self.units)))
        for g, (t, k) in enumerate(zip(tables, self.units)):
            for i, b in enumerate(t):
                if b < 0:
                    (block,) = self.pool.allocate(1)
                    host.onboard(-1 - b, block)
                    self.pool.cache(block, BlockKey(g, *hashes[(i + 1) * k - 1]))
                    t[i] = block

    def take_copies(self) -> list[KVBlockCopy]:
        """The host-tier copies decided since the last call, in order: the next step that runs does them first."""
        return self.host_tier.take_copies() if self.host_tier is not None else []

    def _next_release_at(self, num_computed: int) -> int:
        """The computed-token count at which some sliding group's window next leaves a whole block behind."""
        return min(
            (self._first_needed_block(g, num_computed) + 1) * self.block_sizes[g] + spec.sliding_window - 1
            for g, spec in enumerate(self.groups)
            if spec.sliding_window is not None
        )

    def _release_out_of_window(self, tables: list[list[int]], num_computed: int) -> None:
        for g, (spec, table) in enumerate(zip(self.groups, tables)):
            if spec.sliding_window is None:
                continue
            for i in range(self._first_needed_block(g, num_computed) - 1, -1, -1):
                if table[i] == NULL_BLOCK:
                    break  # everything before was released earlier
                self.pool.free([table[i]])
                table[i] = NULL_BLOCK

    def trim(self, req: KVRequest, num_tokens: int) -> list[int]:
        """Free the request's blocks past its first `num_tokens` slots (speculative decoding: rejected drafts'
        slots); returns the blocks each table keeps. Blocks in the prefix index hold verified tokens only and are
        never past them."""
        tables = self.tables[req.request_id]
        kept = []
        for table, bs in zip(tables, self.block_sizes):
            keep = cdiv(num_tokens, bs)
            if len(table) > keep:
                self.pool.free(table[keep:], reuse_first=True)
                del table[keep:]
            kept.append(len(table))
        return kept

    def free(self, req: KVRequest) -> None:
        rid = req.request_id
        for table in self.tables.pop(rid, []):
            self.pool.free(table[::-1])
        self.num_cached_blocks.pop(rid, None)
        self._hashes.pop(rid, None)
        self._next_release.pop(rid, None)

    def check_invariants(self) -> None:
        """Pool consistency plus: every block reference is held by exactly one table entry."""
        self.pool.check_invariants()
        if self.host_tier is not None:
            self.host_tier.check_invariants()
        refs: dict[int, int] = {}
        for tables in self.tables.values():
            for table in tables:
                for b in table:
                    if b != NULL_BLOCK:
                        refs[b] = refs.get(b, 0) + 1
        for block_id in range(1, self.pool.num_blocks):
            if self.pool.ref_cnt[block_id] != refs.get(block_id, 0):
                raise AssertionError(
                    f"block {block_id}: ref_cnt {self.pool.ref_cnt[block_id]} but {refs.get(block_id, 0)} table entries"
                )
