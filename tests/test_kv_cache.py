"""Block pool accounting as a hypothesis state machine: free + used == total after every operation."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from brisk.kv_cache.block_pool import NULL_BLOCK, BlockKey, BlockPool

NUM_BLOCKS = 12


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.held: list[int] = []  # one entry per reference we hold

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        if n > self.pool.num_free:
            with pytest.raises(RuntimeError):
                self.pool.allocate(n)
            return
        ids = self.pool.allocate(n)
        assert NULL_BLOCK not in ids and len(set(ids)) == n
        self.held.extend(ids)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free_one(self, i):
        self.pool.free([self.held.pop(i % len(self.held))])

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), h=st.integers(0, 3))
    def cache_and_hit(self, i, h):
        block = self.held[i % len(self.held)]
        key = BlockKey(0, h, None, (h,))
        self.pool.cache(block, key)
        found = self.pool.lookup(key)
        if found is not None:
            assert self.pool.keys[found] == key
            self.pool.touch(found)
            self.held.append(found)

    @rule(h=st.integers(0, 3))
    def lookup_wrong_tokens_misses(self, h):
        assert self.pool.lookup(BlockKey(0, h, None, (h, 999))) is None

    @invariant()
    def accounting(self):
        self.pool.check_invariants()
        assert self.pool.num_used == len(set(self.held))
        assert sum(self.pool.ref_cnt[1:]) == len(self.held)


TestBlockPool = PoolMachine.TestCase


def test_double_free_is_an_error():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_evicted_block_leaves_the_prefix_index():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    key = BlockKey(0, 7, None, (1, 2))
    pool.cache(a, key)
    pool.free([a, b])
    assert pool.lookup(key) == a  # still cached while free
    pool.allocate(2)  # LRU reuse evicts it
    assert pool.lookup(key) is None
