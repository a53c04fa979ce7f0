"""The host KV tier (kv_cache_config.host_cache_size / vLLM's --kv-offloading-size).

The books (KVCacheManager + HostTier) are checked on simulated memory: every block's content is the tokens it
should hold, each step's copies are applied in their order, and every block a hit hands out must then hold
exactly its tokens, under random workloads with shared prefixes, a pool far too small, a host tier that evicts too,
and a sliding-window group. The engine is checked end to end on tiny Llama and gpt-oss (two KV groups: full and
sliding window): a multi-turn workload that overflows a small device pool generates exactly what a pool holding
everything does, with blocks served from the host tier, KV invariants checked every step, every device block free
at the end; with overlap scheduling, concurrent requests and n-gram speculation too; a tier of 0 is today's
engine. Over several ranks (TP, attention DP): tests/test_parallel.py.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from brisk import LLM, SamplingParams
from brisk.cli import build_parser
from brisk.config import OPTIONS, ConfigError, EngineConfig, build_serve_configs
from brisk.engine.messages import SchedulerStats
from brisk.kv_cache.host_tier import HostTier, KVBlockCopy
from brisk.kv_cache.manager import NULL_BLOCK, KVCacheManager, KVGroupSpec
from brisk.model_runner import kv_offload, setup
from brisk.model_runner.kv_offload import HostKVCache, copy_batches, host_runs
from brisk.server.metrics import ServerMetrics
from tests.fake_engine import FakeEngine
from tests.server_utils import RunningServer, is_idle, wait_until
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

BS = 4
DEMO = str(Path(__file__).resolve().parents[1] / "brisk" / "demo_model")


@dataclass
class FakeRequest:
    request_id: str
    tokens: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens


@dataclass
class Memory:
    """Simulated KV memory: what each device and host block holds (group, its tokens)."""

    device: dict[int, tuple] = field(default_factory=dict)
    host: dict[int, tuple] = field(default_factory=dict)

    def apply(self, copies: list[KVBlockCopy]) -> None:
        for c in copies:
            if c.to_host:
                self.host[c.host_block] = self.device.get(c.device_block)
            else:
                self.device[c.device_block] = self.host.get(c.host_block)


def _content(req: FakeRequest, g: int, i: int) -> tuple:
    return (g, tuple(req.tokens[: (i + 1) * BS]))  # a block's KV depends on every token up to its end


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "full+sliding"])
def test_every_hit_reads_the_right_content(seed, sliding):
    rng = random.Random(seed)
    groups = [KVGroupSpec((0,))] + ([KVGroupSpec((1,), sliding_window=8)] if sliding else [])
    host = HostTier(num_blocks=rng.choice([6, 20, 200]), bytes_per_block=100)
    kv = KVCacheManager(
        groups, num_blocks=24, block_sizes=[BS] * len(groups), enable_prefix_caching=True, host_tier=host
    )
    mem = Memory()
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    live: list[FakeRequest] = []
    ids = 0
    for step in range(120):
        admitted = []
        for _ in range(rng.randrange(1, 4)):  # one schedule(): several admissions, then the step's copies
            stem = rng.choice(stems)
            ids += 1  # unique: the manager keeps a request's block hashes by its id
            req = FakeRequest(str(ids), stem + [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
            hit = kv.get_computed_blocks(req)
            if kv.max_blocks_per_request(req.num_tokens) > kv.pool.num_usable:
                continue
            while not kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit):
                if not live:
                    break
                kv.free(live.pop(rng.randrange(len(live))))
                hit = kv.get_computed_blocks(req)
            else:
                req.num_computed_tokens = hit.num_tokens
                admitted.append((req, hit.num_tokens // BS))
        mem.apply(kv.take_copies())
        for req, n_hit in admitted:
            for g, table in enumerate(kv.tables[req.request_id]):
                for i in range(n_hit):
                    if table[i] != NULL_BLOCK:
                        assert mem.device[table[i]] == _content(req, g, i), (step, req.request_id, g, i)
                for i in range(n_hit, len(table)):  # the step computes the rest
                    mem.device[table[i]] = _content(req, g, i) if (i + 1) * BS <= req.num_tokens else None
            req.num_computed_tokens = req.num_tokens
            kv.cache_full_blocks(req)
            live.append(req)
        kv.check_invariants()
        while len(live) > 3:
            kv.free(live.pop(0))
    for req in live:
        kv.free(req)
    kv.check_invariants()
    assert kv.pool.num_used == 0 and not host.pinned and not host.copies
    assert host.blocks_to_device > 0 and host.blocks_to_host > 0


def test_a_host_block_read_this_step_is_not_reused_this_step():
    """A hit pins its host blocks until the step's copies are taken: evictions in the same step go elsewhere."""
    host = HostTier(num_blocks=2, bytes_per_block=1)
    kv = KVCacheManager([KVGroupSpec((0,))], num_blocks=4, block_sizes=[BS], enable_prefix_caching=True, host_tier=host)
    a = FakeRequest("a", list(range(9)))  # two full blocks + one token
    assert kv.allocate_slots(a, 9, kv.get_computed_blocks(a))
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    kv.free(a)
    b = FakeRequest("b", list(range(100, 109)))
    assert kv.allocate_slots(b, 9, kv.get_computed_blocks(b))  # evicts a's two cached blocks to the host
    kv.free(b)  # b's blocks were never indexed: nothing to keep
    copies = kv.take_copies()
    assert [c.to_host for c in copies] == [True, True]
    a2 = FakeRequest("a2", list(range(9)))
    hit = kv.get_computed_blocks(a2)
    assert hit.num_tokens == 8 and all(b < 0 for b in hit.blocks[0])
    assert kv.allocate_slots(a2, 1, hit)
    assert host.pinned == {0, 1} and not host.lru
    assert [c.to_host for c in kv.take_copies()] == [False, False]
    assert not host.pinned and len(host.lru) == 2


def test_copy_batches_keep_the_order_and_never_write_a_block_twice():
    copies = [KVBlockCopy(True, 3, 0), KVBlockCopy(True, 4, 1), KVBlockCopy(True, 9, 0), KVBlockCopy(False, 5, 0)]
    copies += [KVBlockCopy(False, 6, 1), KVBlockCopy(False, 7, 2), KVBlockCopy(True, 6, 3)]
    batches = copy_batches(copies, max_rows=2)
    # host block 0 written twice: the second write starts a batch (so it lands last); at most 2 rows a batch
    assert [(d, [c.device_block for c in b]) for d, b in batches] == [
        (True, [3, 4]),
        (True, [9]),
        (False, [5, 6]),
        (False, [7]),
        (True, [6]),
    ]
    assert host_runs([4, 5, 6, 9, 2, 3]) == [(4, 0, 3), (9, 3, 1), (2, 4, 2)]


def _kv_tensors(num_blocks: int, seed: int) -> list[torch.Tensor]:
    """KV tensors of three shapes and dtypes (bf16 and FP8 K/V slots, a drafter's), blocks first, random bytes."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [((num_blocks, 4, 2, 8), torch.bfloat16), ((num_blocks, 4, 2, 8), torch.float8_e4m3fn)]
    shapes += [((num_blocks, 4, 1, 16), torch.float32)]
    tensors = []
    for shape, dtype in shapes:
        raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), generator=gen)
        tensors.append(raw.to(torch.uint8).view(dtype).view(shape))
    return tensors


@pytest.mark.parametrize("staging_rows", [None, 1, 3, 64], ids=["direct", "staged-1", "staged-3", "staged-64"])
def test_block_copies_move_every_tensors_bytes_as_one_at_a_time_would(monkeypatch, staging_rows):
    """Random copies both ways, straight (a CPU's way) and through staging buffers of 1, 3 and 64 blocks (a GPU's):
    every tensor's device blocks end as a reference that copies block by block, tensor by tensor, in order, leaves
    them (and the host blocks hold what it would)."""
    check_block_copies(monkeypatch, torch.device("cpu"), staging_rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staged_copies_on_a_gpu_move_every_tensors_bytes_as_one_at_a_time_would(monkeypatch):
    """The same on a GPU: pinned host blocks, the copy stream, the forward's stream waiting for it."""
    check_block_copies(monkeypatch, torch.device("cuda"), 3)


def check_block_copies(monkeypatch, device: torch.device, staging_rows: int | None) -> None:
    tensors, reference = [t.to(device) for t in _kv_tensors(12, 0)], _kv_tensors(12, 0)
    ref_host = [torch.zeros((6, *t.shape[1:]), dtype=t.dtype).view(torch.uint8) for t in reference]
    per_block = sum(t[0].numel() * t.element_size() for t in tensors)
    monkeypatch.setattr(kv_offload, "STAGING_BYTES", (staging_rows or 0) * per_block)
    host = HostKVCache(tensors, num_host_blocks=6, device=device, staged=staging_rows is not None)
    staged_rows = host.staging.shape if host.staging is not None else None
    assert staged_rows == (staging_rows and (min(6, staging_rows), per_block)) and host.bytes_per_block == per_block
    host.host_blocks.zero_()  # as the reference's (the engine never reads a host block it did not write)
    rng = random.Random(staging_rows or 0)
    try:
        for _ in range(20):
            copies = [KVBlockCopy(rng.random() < 0.5, rng.randrange(12), rng.randrange(6)) for _ in range(9)]
            copies = copies[: rng.randrange(10)]
            host.start(copies)
            host.wait()  # the current stream waits for the copies
            for c in copies:
                for t, h in zip(reference, ref_host):
                    raw = t.view(torch.uint8)
                    if c.to_host:
                        h[c.host_block] = raw[c.device_block]
                    else:
                        raw[c.device_block] = h[c.host_block]
            for t, r in zip(tensors, reference):
                assert torch.equal(t.view(torch.uint8).cpu(), r.view(torch.uint8))
        if device.type == "cuda":
            torch.cuda.synchronize()  # the host tier's memory is written by the copy stream
        for (_, start, end), h in zip(host.segments, ref_host):  # host block b: every tensor's bytes side by side
            assert torch.equal(host.host_blocks[:, start:end], h.reshape(6, -1))
    finally:
        host.close()


class _Ops(TorchDispatchMode):
    """Counts the operations that move bytes (copies, gathers, scatters), not views."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.count += "copy" in name or "index" in name
        return func(*args, **(kwargs or {}))


def test_a_batch_of_copies_costs_operations_per_tensor_not_per_block_and_tensor():
    """Scattered blocks (no two consecutive) copied out and back the GPU's way: a batch costs a few operations per
    KV tensor and one per host run; copying block by block, tensor by tensor, would be 16 x 3 copies each way."""
    device = _kv_tensors(64, 1)
    host = HostKVCache(device, num_host_blocks=32, device=torch.device("cpu"), staged=True)
    out = [KVBlockCopy(True, 4 * i, 2 * i) for i in range(16)]  # neither side consecutive
    back = [KVBlockCopy(False, 4 * i + 1, 2 * i) for i in range(16)]
    for copies in (out, back):
        with _Ops() as ops:
            host.start(copies)
        assert ops.count <= 2 * len(device) + 16 + 2, ops.count  # a gather or scatter and a copy a tensor
        assert ops.count < 16 * len(device)
    for i in range(16):  # block 4i went out and came back into block 4i + 1
        for t in device:
            assert torch.equal(t[4 * i + 1].view(torch.uint8), t[4 * i].view(torch.uint8))


def test_each_rank_on_a_machine_pins_its_own_tier(monkeypatch):
    """The RAM check counts every rank of the machine (each pins host_cache_size); a launcher says how many."""
    from brisk.distributed.launch import ranks_on_this_machine

    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert ranks_on_this_machine(4) == 4  # brisk spawned them all here
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ranks_on_this_machine(16) == 8
    monkeypatch.setattr(kv_offload, "available_host_memory", lambda: 100 << 20)
    layer = type("Layer", (), {})()
    layer.k_cache, layer.v_cache = _kv_tensors(4, 2)[:2]
    assert HostKVCache.for_layers([layer], [], 40 << 20, torch.device("cpu"), 2).num_blocks > 0
    with pytest.raises(ConfigError, match="for each of its 4 ranks"):
        HostKVCache.for_layers([layer], [], 40 << 20, torch.device("cpu"), 4)


def test_a_failed_start_up_unpins_the_host_tier(model, monkeypatch):
    """Set-up failing after the host tier is pinned (a graph capture out of memory, say) unpins it: the memory is
    freed, and a range left registered with CUDA would refuse the next engine's."""
    _, path = model
    closed = []
    monkeypatch.setattr(HostKVCache, "close", lambda self: closed.append(self))

    def no_memory(*args):
        raise RuntimeError("out of memory in the capture")

    monkeypatch.setattr(setup, "set_up_graphs", no_memory)
    with pytest.raises(RuntimeError, match="out of memory in the capture"):
        LLM(path, **ENGINE, kv_cache_config={"max_blocks": 8, "host_cache_size": 1 << 20})
    assert len(closed) == 1


# ---- the scheduler with a model-free runner (tests/fake_engine.py: a wrong copy changes the output) ----------
FULL = [KVGroupSpec((0, 1))]
HYBRID = [KVGroupSpec((1, 3)), KVGroupSpec((0, 2), sliding_window=6)]


# (groups, tokens a block per group): hybrid-fp8 is an FP8 full-attention group beside a model-dtype sliding one
LAYOUTS = {"full": (FULL, [4]), "hybrid": (HYBRID, [4, 4]), "hybrid-fp8": (HYBRID, [8, 4])}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_preempted_requests_come_back_through_the_host_tier(layout, overlap):
    """A preempted request's computed blocks stay indexed; evicted while it waits, the host tier keeps them, and
    it resumes with them copied back (swap instead of recompute): outputs exact, every block free at the end."""
    rng = random.Random(3)
    groups, block_sizes = LAYOUTS[layout]
    engine = FakeEngine(
        groups, num_blocks=24, block_size=block_sizes, max_batch_size=8, overlap=overlap, host_blocks=200
    )
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    reqs = [engine.add(p, 20) for p in prompts]
    resumed_with_blocks = 0
    while engine.busy():
        out = engine.step()
        resumed_with_blocks += sum(1 for n in out.new_requests if n.resumed and n.num_computed_tokens > 0)
    assert engine.sched.num_preemptions > 0 and resumed_with_blocks > 0
    assert engine.kv.host_tier.blocks_to_device > 0
    for req, prompt in zip(reqs, prompts):
        assert req.output_token_ids == engine.expected_output(prompt, 20), req.request_id
    assert engine.kv.pool.num_used == 0 and not engine.kv.tables


@pytest.mark.parametrize("host_blocks", [12, 400], ids=["small-tier", "big-tier"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_returning_prefixes_are_copied_back_exactly(layout, overlap, host_blocks):
    rng = random.Random(5)
    groups, block_sizes = LAYOUTS[layout]
    engine = FakeEngine(
        groups, num_blocks=40, block_size=block_sizes, max_batch_size=3, overlap=overlap, host_blocks=host_blocks
    )
    histories = [[rng.randrange(1, 97) for _ in range(10 + i)] for i in range(6)]
    for _ in range(4):  # turns: each conversation resends its history, plus a new message
        prompts = [h + [rng.randrange(1, 97) for _ in range(3)] for h in histories]
        reqs = [engine.add(p, 4) for p in prompts]
        engine.run()
        for h, p, req in zip(histories, prompts, reqs):
            assert req.output_token_ids == engine.expected_output(p, 4), req.request_id
            h[:] = p + req.output_token_ids
    host = engine.kv.host_tier
    assert host.blocks_to_host > 0 and host.blocks_to_device > 0 and engine.kv.host_hits > 0
    assert engine.kv.pool.num_used == 0 and not engine.kv.tables and not host.pinned


# ---- the engine -------------------------------------------------------------------------------------------------
ENGINE = dict(dtype="float32", tokens_per_block=BS, max_num_tokens=32, seed=0, check_kv_invariants=True)
SMALL_POOL = {"llama": 40, "gpt_oss": 64}  # far less than the conversations' history (several hundred blocks)


@pytest.fixture(scope="module", params=["llama", "gpt_oss"])
def model(request, tmp_path_factory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, path, seed=0)
    make_tiny_tokenizer(path)
    return request.param, str(path)


def _multi_turn(llm: LLM, turns: int = 4, conversations: int = 6) -> list[list[int]]:
    """Conversations that resend their growing history each turn; all conversations of a turn are sent at once."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(r.outputs[0].token_ids) for r in results]

    return _multi_turn_with(generate, turns, conversations)


def _multi_turn_with(
    generate: Callable[[list[list[int]]], list[list[int]]], turns: int = 4, conversations: int = 6
) -> list[list[int]]:
    """_multi_turn's workload through `generate` (each turn's prompts -> their greedy tokens)."""
    rng = random.Random(0)
    histories = [[rng.randrange(1, 512) for _ in range(18 + c)] for c in range(conversations)]
    outputs = []
    for _ in range(turns):
        prompts = [h + [rng.randrange(1, 512) for _ in range(5)] for h in histories]
        for h, p, tokens in zip(histories, prompts, generate(prompts)):
            outputs.append(tokens)
            h[:] = p + tokens
    return outputs


def _end_state(llm: LLM) -> SchedulerStats:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    for kv in engine.kv_managers:
        kv.check_invariants()
        assert kv.pool.num_used == 0 and not kv.tables
        if kv.host_tier is not None:
            assert not kv.host_tier.pinned and not kv.host_tier.copies
    return engine.stats()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_multi_turn_beyond_the_device_pool_is_served_from_the_host_tier(model, overlap):
    arch, path = model
    options = dict(ENGINE, disable_overlap_scheduler=not overlap, max_batch_size=2)
    with LLM(path, **options) as big:  # a pool that holds every conversation: no eviction at all
        expected = _multi_turn(big)
        reference = _end_state(big)
    small = {"max_blocks": SMALL_POOL[arch]}
    with LLM(path, **options, kv_cache_config=small) as dropped:  # today: evicted prefixes are recomputed
        assert _multi_turn(dropped) == expected
        without = _end_state(dropped)
    with LLM(path, **options, kv_cache_config={**small, "host_cache_size": 1 << 20}) as tiered:
        assert tiered.engine.executor.runner.host_kv is not None
        assert _multi_turn(tiered) == expected
        stats = _end_state(tiered)
    assert without.prefix_hits < reference.prefix_hits  # the small pool loses prefixes ...
    assert stats.host_hits > 0  # ... the host tier gives them back (sliding-window groups included)
    assert stats.prefix_hits == reference.prefix_hits  # every prefix the big pool hit
    assert stats.host_bytes_to_host > 0 and stats.host_bytes_to_device > 0 and 0 < stats.host_usage <= 1


def test_speculation_over_the_host_tier_generates_what_plain_decoding_does(model):
    """n-gram speculation over a small pool with a host tier: rejected drafts are rolled back before their blocks
    could be indexed, so only verified KV reaches the host tier and comes back; the tokens are those of plain
    decoding with a pool that holds everything."""
    arch, path = model
    options = dict(ENGINE, max_batch_size=2)
    with LLM(path, **options) as big:
        expected = _multi_turn(big)
    ngram = {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}
    tier = {"max_blocks": SMALL_POOL[arch], "host_cache_size": 1 << 20}
    with LLM(path, **options, speculative_config=ngram, kv_cache_config=tier) as speculating:
        assert _multi_turn(speculating) == expected
        stats = _end_state(speculating)
    assert stats.host_hits > 0 and stats.host_bytes_to_device > 0
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_a_small_host_tier_evicts_and_still_generates_the_same(model):
    """A host tier smaller than the history: its LRU drops blocks too, copy-ins pin theirs; concurrent requests
    (batch 4) evict each other's prefixes mid-run, and preempted requests come back through the tiers."""
    arch, path = model
    options = dict(ENGINE, max_batch_size=4)
    with LLM(path, **options) as big:
        expected = _multi_turn(big, turns=3, conversations=8)
        per_block = big.engine.executor.runner.kv_layout.bytes_per_block
        history = len(big.engine.kv.pool.cached)  # every block the workload indexed (this pool evicted none)
    num_host = history * 3 // 4
    tier = {"max_blocks": SMALL_POOL[arch], "host_cache_size": num_host * per_block}
    with LLM(path, **options, kv_cache_config=tier) as tiered:
        assert tiered.engine.kv.host_tier.num_blocks == num_host
        assert _multi_turn(tiered, turns=3, conversations=8) == expected
        stats = _end_state(tiered)
    assert stats.host_bytes_to_host > num_host * per_block  # it took more than it holds: it evicted
    assert stats.host_hits > 0 and stats.num_preemptions > 0


def test_a_host_tier_of_zero_is_todays_engine(model):
    arch, path = model
    small = {"max_blocks": SMALL_POOL[arch]}
    with LLM(path, **ENGINE, max_batch_size=2, kv_cache_config=small) as default:
        expected = _multi_turn(default, turns=2)
        stats = _end_state(default)
    with LLM(path, **ENGINE, max_batch_size=2, kv_cache_config={**small, "host_cache_size": 0}) as zero:
        assert zero.engine.executor.runner.host_kv is None and zero.engine.kv.host_tier is None
        copies = []
        step = zero.engine.scheduler.schedule

        def spy():
            out = step()
            copies.extend(out.kv_block_copies)
            return out

        zero.engine.scheduler.schedule = spy
        assert _multi_turn(zero, turns=2) == expected
        assert _end_state(zero) == stats and not copies


# ---- the options ------------------------------------------------------------------------------------------------
def test_host_tier_options(tmp_path, caplog):
    assert EngineConfig.build("m").kv_cache_config.host_cache_size == 0
    yaml_path = tmp_path / "extra.yaml"
    yaml_path.write_text("kv_cache_config:\n  host_cache_size: 1048576\n")
    assert EngineConfig.build("m", yaml_path=yaml_path).kv_cache_config.host_cache_size == 1 << 20
    yaml_path.write_text("kv_cache_config:\n  host_cache_size: null\n")  # trtllm's default
    assert EngineConfig.build("m", yaml_path=yaml_path).kv_cache_config.host_cache_size == 0
    caplog.set_level("INFO", logger="brisk.config")
    vllm = EngineConfig.build("m", kv_offloading_size=2.0, kv_offloading_backend="native", tp_size=2, device="cpu")
    assert vllm.kv_cache_config.host_cache_size == 1 << 30 and vllm.kv_offloading_size is None  # each rank's share
    assert "kv_offloading_size 2 GiB: kv_cache_config.host_cache_size 1073741824 bytes" in caplog.text
    # the converted config crosses to the engine process as JSON and validates again
    assert EngineConfig.model_validate_json(vllm.model_dump_json(exclude_unset=True)) == vllm
    flags = ["serve", "--kv-offloading-size", "0.5", "--kv-offloading-backend", "native", "--device", "cpu"]
    engine, _ = build_serve_configs(None, OPTIONS.given(build_parser().parse_args(flags)), default_model=DEMO)
    assert engine.kv_cache_config.host_cache_size == 1 << 29
    with pytest.raises(ConfigError, match="kv_offloading_backend"):
        flags = ["serve", "--kv-offloading-size", "1", "--kv-offloading-backend", "nixl"]
        build_serve_configs(None, OPTIONS.given(build_parser().parse_args(flags)), default_model=DEMO)
    with pytest.raises(ConfigError, match="no lmcache KV offloading"):
        EngineConfig.build("m", kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ConfigError, match="both size the host KV tier"):
        EngineConfig.build("m", kv_offloading_size=1, kv_cache_config={"host_cache_size": 10})
    with pytest.raises(ConfigError, match="need kv_cache_config.enable_block_reuse"):
        EngineConfig.build("m", enable_prefix_caching=False, kv_cache_config={"host_cache_size": 10})
    with pytest.raises(ConfigError, match="host_cache_size"):
        EngineConfig.build("m", kv_cache_config={"host_cache_size": -1})


def test_a_host_tier_beyond_the_ram_or_under_a_block_is_a_start_up_error(model):
    _, path = model
    with LLM(path, **ENGINE, kv_offloading_size=0.001, kv_cache_config={"max_blocks": 8}) as vllm_spelling:
        per_block = vllm_spelling.engine.executor.runner.kv_layout.bytes_per_block
        assert vllm_spelling.engine.kv.host_tier.num_blocks == int(0.001 * 2**30) // per_block
    with pytest.raises(ConfigError, match="RAM available"):
        LLM(path, **ENGINE, kv_cache_config={"max_blocks": 8, "host_cache_size": 1 << 50})
    with pytest.raises(ConfigError, match="holds no KV block"):
        LLM(path, **ENGINE, kv_cache_config={"max_blocks": 8, "host_cache_size": 1})


def test_host_tier_metrics():
    metrics = ServerMetrics("m")
    stats = SchedulerStats(
        host_queries=100, host_hits=40, host_bytes_to_host=4096, host_bytes_to_device=2048, host_usage=0.5
    )
    metrics.observe_engine(stats)
    text = metrics.render().decode()
    for line in (
        'brisk:external_prefix_cache_queries_total{model_name="m"} 100.0',
        'brisk:external_prefix_cache_hits_total{model_name="m"} 40.0',
        'brisk:kv_offload_bytes_total{direction="to_host",model_name="m"} 4096.0',
        'brisk:kv_offload_bytes_total{direction="to_device",model_name="m"} 2048.0',
        'brisk:kv_host_cache_usage_perc{model_name="m"} 0.5',
    ):
        assert line in text
    metrics.observe_engine(SchedulerStats(host_queries=150, host_hits=40))  # counters advance by what is new
    assert 'brisk:external_prefix_cache_queries_total{model_name="m"} 150.0' in metrics.render().decode()


def test_vllm_flags_serve_fp8_beside_sliding_windows_with_a_host_tier(tmp_path):
    """`brisk serve` with vLLM's flags (--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window
    --kv-offloading-size, a device pool far smaller than the conversations): the served greedy turns are the
    offline engine's with a pool that holds everything, /metrics counts the host tier's hits and bytes both ways, and
    the start-up lines name each group's tokens a block (FP8 full attention: 4x the fp32 sliding group's). After a
    storm of clients hanging up mid-stream the server is idle, every block free, and serves the same turns again."""
    make_tiny_model("gpt_oss", tmp_path, seed=0)
    make_tiny_tokenizer(tmp_path)
    path = str(tmp_path)
    skip = dict(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["sliding_window"])
    with LLM(path, **ENGINE, **skip, max_batch_size=2) as big:
        assert big.engine.kv.block_sizes == [4 * BS, BS]
        expected = _multi_turn(big)
    flags = ["--dtype", "float32", "--block-size", str(BS), "--max-num-batched-tokens", "32", "--seed", "0"]
    flags += ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window", "--max-num-seqs", "2"]
    flags += ["--num-gpu-blocks-override", str(SMALL_POOL["gpt_oss"]), "--kv-offloading-size", str(2**-10)]
    server = RunningServer(path, *flags)
    try:

        def complete(prompt: list[int]) -> list[int]:
            body = {"model": path, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            body.update(logprobs=0, return_tokens_as_token_ids=True)
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return [int(t.removeprefix("token_id:")) for t in response.json()["choices"][0]["logprobs"]["tokens"]]

        served = _multi_turn_with(lambda prompts: [complete(p) for p in prompts])
        metrics = server.metrics()
        # Clients that hang up mid-stream while the pool overflows (evictions to the host tier, copies back): every
        # block comes back, and what the tiers then hold still serves the turns exactly.
        asyncio.run(_disconnect_storm(server.url, path))
        assert wait_until(lambda: is_idle(server.metrics(), path)), server.metrics()
        after = server.metrics()
        aborted = 'brisk:request_success_total{finished_reason="abort",model_name="' + path + '"}'
        assert after.get(aborted, 0) > 0
        to_host = 'brisk:kv_offload_bytes_total{direction="to_host"'
        assert _value(after, to_host) > _value(metrics, to_host)  # the storm overflowed the pool again
        assert _multi_turn_with(lambda prompts: [complete(p) for p in prompts]) == expected
    finally:
        server.stop()
    assert served == expected

    def value(prefix: str) -> float:
        return _value(metrics, prefix)

    assert value("brisk:external_prefix_cache_hits_total") > 0
    assert value('brisk:kv_offload_bytes_total{direction="to_host"') > 0
    assert value('brisk:kv_offload_bytes_total{direction="to_device"') > 0
    assert any(n.startswith("brisk:cache_config_info{") and f'block_size="{4 * BS}/{BS}"' in n for n in metrics)
    log = server.log()
    assert f"full float8_e4m3fn ({4 * BS} tokens a block), sliding float32 ({BS} tokens a block)" in log
    assert f"{SMALL_POOL['gpt_oss']} KV blocks of {4 * BS}/{BS} tokens" in log  # the ready line


async def _disconnect_storm(url: str, model: str) -> None:
    rng = random.Random(5)
    shared = [rng.randrange(1, 512) for _ in range(24)]  # prefixes to hit, evict and copy back

    async def hang_up(http: httpx.AsyncClient, i: int) -> None:
        prompt = shared[: rng.randrange(0, 25)] + [rng.randrange(1, 512) for _ in range(rng.randrange(1, 40))]
        body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        after = rng.randrange(0, 8)
        async with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen > after:
                    return  # leaving the block drops the connection: the server aborts the request

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        await asyncio.gather(*(hang_up(http, i) for i in range(32)))


def _value(metrics: dict[str, float], prefix: str) -> float:
    (found,) = [v for name, v in metrics.items() if name.startswith(prefix)]
    return found
