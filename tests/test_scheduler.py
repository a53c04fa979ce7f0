"""Scheduler + KV cache manager invariants, on a fake model that reads its context back from the paged cache."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from brisk.kv_cache.manager import KVGroupSpec
from tests.fake_engine import FakeEngine

FULL = [KVGroupSpec((0, 1))]
HYBRID = [KVGroupSpec((1, 3)), KVGroupSpec((0, 2), sliding_window=6)]


def _prompts(rng: random.Random, n: int, shared_prefix: int = 0) -> list[list[int]]:
    prefix = [rng.randrange(1, 97) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(1, 97) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def _check_all(engine: FakeEngine, reqs, prompts, max_tokens) -> None:
    for req, prompt, mt in zip(reqs, prompts, max_tokens):
        assert req.output_token_ids == engine.expected_output(prompt, mt), req.request_id
    assert engine.kv.pool.num_used == 0
    assert not engine.kv.tables


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("groups", [FULL, HYBRID], ids=["full", "hybrid"])
def test_batch_decodes_exactly(groups, overlap):
    rng = random.Random(0)
    engine = FakeEngine(groups, num_blocks=200, block_size=4, overlap=overlap)
    prompts = _prompts(rng, 8)
    reqs = [engine.add(p, 12) for p in prompts]
    engine.run()
    _check_all(engine, reqs, prompts, [12] * 8)


@pytest.mark.parametrize("groups", [FULL, HYBRID], ids=["full", "hybrid"])
def test_chunked_prefill_respects_token_budget(groups):
    rng = random.Random(1)
    engine = FakeEngine(groups, num_blocks=200, block_size=4, max_num_tokens=5)
    prompts = _prompts(rng, 6)
    reqs = [engine.add(p, 6) for p in prompts]
    while engine.busy():
        out = engine.step()
        assert out.num_tokens <= 5
    _check_all(engine, reqs, prompts, [6] * 6)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_long_prefill_token_threshold_shares_a_step_among_prompts(overlap):
    """vLLM's long_prefill_token_threshold: no prompt computes more than it a step, so the prompts waiting together
    all start in the first step instead of the first taking the budget; outputs unchanged."""
    rng = random.Random(7)
    engine = FakeEngine(HYBRID, num_blocks=200, block_size=4, max_num_tokens=64, overlap=overlap, max_prefill_chunk=6)
    prompts = [[rng.randrange(1, 97) for _ in range(40)] for _ in range(4)]
    reqs = [engine.add(p, 5) for p in prompts]
    first = engine.step()
    assert first.num_scheduled_tokens == {r.request_id: 6 for r in reqs}  # without the threshold: 40 + 24
    while engine.busy():
        out = engine.step()
        assert max(out.num_scheduled_tokens.values(), default=0) <= 6
    _check_all(engine, reqs, prompts, [5] * 4)


def test_without_chunked_prefill_a_prompt_is_scheduled_whole():
    rng = random.Random(2)
    engine = FakeEngine(FULL, num_blocks=200, block_size=4, max_num_tokens=40, chunked=False)
    prompts = _prompts(rng, 6)
    reqs = [engine.add(p, 4) for p in prompts]
    while engine.busy():
        out = engine.step()
        for new in out.new_requests:
            if new.num_computed_tokens == 0:
                assert out.num_scheduled_tokens[new.req_id] == len(new.token_ids)
    _check_all(engine, reqs, prompts, [4] * 6)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("groups", [FULL, HYBRID], ids=["full", "hybrid"])
def test_preemption_recomputes_exactly(groups, overlap):
    rng = random.Random(3)
    engine = FakeEngine(groups, num_blocks=24, block_size=4, max_batch_size=8, overlap=overlap)
    prompts = _prompts(rng, 8)
    reqs = [engine.add(p, 20) for p in prompts]
    engine.run()
    assert engine.sched.num_preemptions > 0
    _check_all(engine, reqs, prompts, [20] * 8)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("groups", [FULL, HYBRID], ids=["full", "hybrid"])
def test_prefix_cache_hits_are_exact(groups, overlap):
    rng = random.Random(4)
    engine = FakeEngine(groups, num_blocks=300, block_size=4, overlap=overlap)
    prompts = _prompts(rng, 6, shared_prefix=17)
    first = engine.add(prompts[0], 5)
    engine.run()
    reqs = [first] + [engine.add(p, 5) for p in prompts[1:]]
    engine.run()
    assert all(r.num_cached_tokens >= 16 for r in reqs[1:])
    assert engine.kv.prefix_hits > 0
    _check_all(engine, reqs, prompts, [5] * 6)


@pytest.mark.parametrize("host_blocks", [0, 64], ids=["device", "host-tier"])
@pytest.mark.parametrize("groups", [FULL, HYBRID], ids=["full", "hybrid"])
def test_hit_rate_counters_count_each_admission_once(groups, host_blocks):
    """A request waiting for blocks is looked up again at every step; /metrics' prefix_cache_queries / _hits (and
    the host tier's) count it once, when it is admitted (a preempted request again when it comes back): queries
    are the tokens of the requests the scheduler admitted, hits the tokens they were admitted with."""
    rng = random.Random(11)
    engine = FakeEngine(groups, num_blocks=24, block_size=4, max_batch_size=8, host_blocks=host_blocks)
    lookups = 0
    lookup = engine.kv.get_computed_blocks

    def counted(req):
        nonlocal lookups
        lookups += 1
        return lookup(req)

    engine.kv.get_computed_blocks = counted
    prompts = _prompts(rng, 6, shared_prefix=9) + _prompts(rng, 6, shared_prefix=9)
    reqs = [engine.add(p, 12) for p in prompts]
    admitted = []
    while engine.busy():
        admitted += engine.step().new_requests
    assert len(admitted) == len(reqs) + engine.sched.num_preemptions > len(reqs)
    assert lookups > len(admitted)  # some waited for blocks: looked up again
    assert engine.kv.prefix_queries == sum(len(new.token_ids) for new in admitted)
    assert engine.kv.prefix_hits == sum(new.num_computed_tokens for new in admitted) > 0
    assert engine.kv.host_hits <= engine.kv.prefix_hits
    _check_all(engine, reqs, prompts, [12] * len(reqs))


def test_identical_prompt_hit_leaves_one_token_to_compute():
    engine = FakeEngine(FULL, num_blocks=100, block_size=4)
    prompt = list(range(1, 13))  # exactly 3 blocks
    a = engine.add(prompt, 3)
    engine.run()
    b = engine.add(prompt, 3)
    engine.run()
    assert b.num_cached_tokens == 8  # the last block is recomputed so its last token yields logits
    assert a.output_token_ids == b.output_token_ids


def test_sliding_window_releases_blocks():
    engine = FakeEngine(HYBRID, num_blocks=400, block_size=4, prefix_caching=False)
    req = engine.add([5] * 40, 40)
    peak_sliding = 0
    while engine.busy():
        engine.step()
        if req.request_id in engine.kv.tables:
            sliding = [b for b in engine.kv.tables[req.request_id][1] if b != 0]
            peak_sliding = max(peak_sliding, len(sliding))
            # window 6 with blocks of 4 needs at most 3 live blocks (+1 being filled)
            if req.num_computed_tokens > 40:
                assert len(sliding) <= 3
    assert req.output_token_ids == engine.expected_output([5] * 40, 40)


def test_priority_orders_admission_and_preemption():
    engine = FakeEngine(FULL, num_blocks=200, block_size=4, max_batch_size=1)
    low = engine.add([1, 2, 3], 2, priority=5)
    high = engine.add([4, 5, 6], 2, priority=0)
    engine.step()
    assert engine.sched.running == [high]
    engine.run()
    assert engine.finished.index(high) < engine.finished.index(low)


def test_preemption_picks_lowest_priority():
    engine = FakeEngine(FULL, num_blocks=9, block_size=4, max_batch_size=4)
    important = engine.add(list(range(1, 9)), 20, priority=0)
    other = engine.add(list(range(1, 9)), 20, priority=3)
    engine.run()
    assert important.num_preemptions == 0
    assert other.num_preemptions > 0
    assert important.output_token_ids == engine.expected_output(list(range(1, 9)), 20)


def test_abort_frees_blocks_at_any_time():
    rng = random.Random(5)
    engine = FakeEngine(HYBRID, num_blocks=60, block_size=4)
    reqs = [engine.add(p, 30) for p in _prompts(rng, 6)]
    for step in range(12):
        engine.step()
        if step % 3 == 0:
            victim = reqs[step // 3]
            engine.sched.abort(victim)
            assert victim.finish_reason == "abort"
            engine.kv.check_invariants()
    engine.run()
    assert engine.kv.pool.num_used == 0


def test_sibling_follows_leader_and_shares_prompt_blocks():
    engine = FakeEngine(FULL, num_blocks=100, block_size=4)
    prompt = list(range(1, 19))
    leader = engine.add(prompt, 4)
    follower = engine.add(prompt, 4, follows=leader)
    engine.step()
    assert follower in engine.sched.waiting  # waits for the leader's prefill
    engine.step()
    shared = set(engine.kv.tables[leader.request_id][0][:4]) & set(engine.kv.tables[follower.request_id][0])
    assert len(shared) == 4
    engine.run()
    assert follower.num_cached_tokens == 16
    assert leader.output_token_ids == follower.output_token_ids


def test_prefix_hits_come_in_whole_blocks_of_every_group():
    """Full-attention blocks of 8 tokens beside sliding blocks of 4 (an FP8 full group, a model-dtype sliding one):
    of a 21-token shared prefix, 16 tokens hit (two full blocks; the sliding group alone would give 20), and the
    sliding group adopts only the blocks its window still reads."""
    engine = FakeEngine(HYBRID, num_blocks=100, block_size=[8, 4])
    rng = random.Random(11)
    shared = [rng.randrange(1, 97) for _ in range(21)]
    first = engine.add(shared + [5], 3)
    engine.run()
    second = engine.add(shared + [6, 7], 3)
    engine.step()
    assert second.num_cached_tokens == 16
    full, sliding = engine.kv.tables[second.request_id]
    assert len(full) == 3 and len(sliding) == 6  # 24 tokens' room in each: 3 blocks of 8, 6 of 4
    assert sliding[:2] == [0, 0]  # the window (6) at position 16 reads from position 11 on: blocks 0-1 not needed
    engine.run()
    for req, prompt in ((first, shared + [5]), (second, shared + [6, 7])):
        assert req.output_token_ids == engine.expected_output(prompt, 3)
    assert engine.kv.pool.num_used == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    hybrid=st.booleans(),
    num_blocks=st.integers(12, 80),
    block_size=st.sampled_from([1, 2, 4, 8]),
    full_ratio=st.sampled_from([1, 2, 4]),
    budget=st.integers(4, 64),
    chunked=st.booleans(),
    caching=st.booleans(),
    overlap=st.booleans(),
)
def test_random_workloads_keep_accounting_and_outputs(
    seed, hybrid, num_blocks, block_size, full_ratio, budget, chunked, caching, overlap
):
    """full_ratio: a hybrid model's full-attention blocks hold this many times the sliding ones' tokens (an FP8
    full-attention group beside a model-dtype sliding one: the same bytes a block)."""
    rng = random.Random(seed)
    groups = HYBRID if hybrid else FULL
    block_sizes = [block_size * full_ratio, block_size] if hybrid else [block_size]
    engine = FakeEngine(
        groups,
        num_blocks,
        block_sizes,
        max_batch_size=rng.randint(1, 8),
        max_num_tokens=budget,
        chunked=chunked,
        prefix_caching=caching,
        overlap=overlap,
    )
    max_tokens_per_req = 6
    # every request must fit the pool alone, and without chunking the budget too
    fits = max((n for n in range(200) if sum(-(-n // bs) for bs in block_sizes) <= num_blocks - 1), default=0)
    limit = min(fits, budget if not chunked else 10**9) - max_tokens_per_req
    if limit < 2:
        return
    prompts = [p[:limit] for p in _prompts(rng, rng.randint(1, 10), shared_prefix=rng.choice([0, 9]))]
    reqs, aborted = [], set()
    for p in prompts:
        reqs.append(engine.add(p, max_tokens_per_req, priority=rng.randint(0, 2)))
        for _ in range(rng.randint(0, 2)):
            engine.step()
        if rng.random() < 0.15:
            victim = rng.choice(reqs)
            engine.sched.abort(victim)
            aborted.add(victim.request_id)
            engine.kv.check_invariants()
    engine.run()
    assert engine.kv.pool.num_used == 0
    assert not engine.sched.requests
    for req, p in zip(reqs, prompts):
        if req.request_id not in aborted:
            assert req.output_token_ids == engine.expected_output(p, max_tokens_per_req)
