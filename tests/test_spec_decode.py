"""Speculative decoding end to end: greedy output with speculation is token-identical to decoding without it.

Three proposers on tiny Llama, Qwen3 and gpt-oss: prompt lookup (n-gram), an oracle that drafts the target's own
continuation (every draft accepted) and a random one (almost every draft rejected), with batching, chunked prefill
(a small token budget), preemption (a small KV pool), prefix-cache hits (each batch twice), KV invariants checked
after every step and every block free at the end. Then stop tokens / stop strings / max_tokens inside an accepted
run, n > 1, logprobs, penalties, and two ranks on gloo (TP 2, attention DP 2).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from brisk import LLM, SamplingParams
from brisk.spec_decode.ngram import ngram_draft
from tests.spec_proposers import OracleProposer, RandomProposer, use_proposer
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

MAX_NEW = 16
K = 3
# Small budget (chunked prefill, drafts trimmed), 4-token blocks in a pool too small for the batch (preemption).
OPTIONS = dict(
    seed=0,
    dtype="float32",
    tokens_per_block=4,
    max_num_tokens=24,
    check_kv_invariants=True,
)
# The longest request (37 + 16 tokens) needs 14 blocks per KV group (gpt-oss has two groups).
MAX_BLOCKS = {"llama": 20, "qwen3": 20, "gpt_oss": 60}


def _options(arch: str) -> dict:
    return {**OPTIONS, "kv_cache_config": {"max_blocks": MAX_BLOCKS[arch]}}


NGRAM = {"decoding_type": "NGram", "max_draft_len": K, "max_matching_ngram_size": 2}


def _prompts() -> list[list[int]]:
    """Copy-heavy prompts (a passage repeated: prompt lookup finds its continuation) and plain random ones."""
    rng = random.Random(3)
    prompts = []
    for n in (6, 11, 17):
        passage = [rng.randrange(1, 512) for _ in range(n)]
        prompts.append(passage + passage[: n // 2] + passage[:3])
    prompts += [[rng.randrange(1, 512) for _ in range(n)] for n in (4, 9, 20)]
    return prompts


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for arch in ("llama", "qwen3", "gpt_oss"):
        path = tmp_path_factory.mktemp(arch)
        make_tiny_model(arch, path, seed=0)
        make_tiny_tokenizer(path)
        paths[arch] = str(path)
    return paths


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True, **kw})


def _generate_twice(llm: LLM, prompts, params) -> list[list[int]]:
    batch = [{"prompt_token_ids": p} for p in prompts]
    first = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    second = [o.outputs[0].token_ids for o in llm.generate(batch, params)]  # prefix-cache hits
    assert first == second
    return first


@pytest.fixture(scope="module")
def references(models) -> dict[str, list[list[int]]]:
    out = {}
    for arch, path in models.items():
        with LLM(path, **_options(arch)) as llm:
            out[arch] = _generate_twice(llm, _prompts(), _greedy())
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss"])
@pytest.mark.parametrize("proposer", ["ngram", "oracle", "random"])
def test_greedy_identity(arch, proposer, models, references):
    prompts = _prompts()
    with LLM(models[arch], **_options(arch), speculative_config=NGRAM) as llm:
        oracle = None
        if proposer == "oracle":
            oracle = OracleProposer([p + r for p, r in zip(prompts, references[arch])])
            use_proposer(llm, oracle)
        elif proposer == "random":
            use_proposer(llm, RandomProposer(llm.engine.model_config.vocab_size))
        ours = _generate_twice(llm, prompts, _greedy())
        stats = llm.engine.stats()
        kv = llm.engine.kv
        kv.check_invariants()
        assert kv.pool.num_used == 0
    assert ours == references[arch]
    if arch != "gpt_oss":
        # (gpt-oss' 8-token sliding window hands the prompt's tail blocks back to the small pool during decoding,
        # where they are soon evicted or keep the batch from preempting, depending on how fast drafts are accepted.)
        assert stats.num_preemptions > 0 and stats.prefix_hits > 0, "the setup was meant to preempt and hit the cache"
    assert stats.spec_num_drafts > 0
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    if proposer == "oracle":  # a perfect head: every draft the scheduler sent is accepted
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    elif proposer == "random":
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens / 10
    else:  # the copy-heavy prompts' continuations are found
        assert stats.spec_num_accepted_tokens > 0


def test_stops_n_and_logprobs_inside_accepted_runs(models, references):
    """A stop token, a stop string and max_tokens that fall inside an accepted run end the output exactly where
    decoding without speculation ends it; n = 2, logprobs (the target's, one per token), penalties and min_tokens
    too."""
    path, prompts = models["llama"], _prompts()
    ref = references["llama"]
    stop_token = ref[0][6]  # the oracle drafts straight through it
    cases = [
        _greedy(stop_token_ids=[stop_token], n=2, logprobs=2),
        _greedy(logprob_token_ids=[ref[0][3], 5, 1]),  # verified positions' chosen ids, each in its row
        _greedy(max_tokens=7),
        # penalties and min_tokens see the drafts before each verified position (stop = the reference's 3rd token)
        _greedy(repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=4, stop_token_ids=[ref[0][2]]),
        # min_tokens alone (no history: the count of outputs and drafts before each position), at and past the stop
        _greedy(min_tokens=2, stop_token_ids=[ref[0][2]]),
        _greedy(min_tokens=3, stop_token_ids=[ref[0][2]]),
    ]
    with LLM(path, **_options("llama")) as llm:
        text = llm.generate([{"prompt_token_ids": prompts[1]}], _greedy())[0].outputs[0].text
        cases.append(_greedy(stop=[text[len(text) // 2 : len(text) // 2 + 3]]))
        expected = [llm.generate([{"prompt_token_ids": p} for p in prompts], c) for c in cases]
    with LLM(path, **_options("llama"), speculative_config=NGRAM) as llm:
        use_proposer(llm, OracleProposer([p + r for p, r in zip(prompts, ref)]))
        got = [llm.generate([{"prompt_token_ids": p} for p in prompts], c) for c in cases]
        assert llm.engine.stats().spec_num_accepted_tokens > 0
        assert llm.engine.kv.pool.num_used == 0
    for exp_case, got_case in zip(expected, got):
        for exp, ours in zip(exp_case, got_case):
            assert len(ours.outputs) == len(exp.outputs)
            for a, b in zip(exp.outputs, ours.outputs):
                assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
                    a.token_ids,
                    a.text,
                    a.finish_reason,
                    a.stop_reason,
                )
                if a.logprobs is not None:
                    assert b.logprobs is not None and len(b.logprobs) == len(a.logprobs)
                    for x, y in zip(a.logprobs, b.logprobs):
                        assert x.keys() == y.keys()
                        assert np.allclose(list(x.values()), [y[t] for t in x], atol=1e-4)
    assert any(stop_token in o.token_ids or o.finish_reason == "stop" for o in got[0][0].outputs)


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(tp_size=2, enable_attention_dp=True)], ids=["tp2", "dp2"])
def test_two_ranks_on_gloo_match_single_rank(layout, models, references):
    with LLM(models["llama"], **_options("llama"), **layout, speculative_config=NGRAM) as llm:
        ours = _generate_twice(llm, _prompts(), _greedy())
        stats = llm.engine.stats()
        assert all(kv.pool.num_used == 0 for kv in llm.engine.kv_managers)
    assert ours == references["llama"]
    assert stats.spec_num_accepted_tokens > 0


@pytest.mark.parametrize("proposer", ["oracle", "random"])
def test_adaptive_draft_len(proposer, models, references):
    """draft_len_after_rejection 1: after a rejection a request drafts one token until a step accepts all its
    drafts; the output stays the reference's. The oracle is never rejected (k drafts throughout), the random
    drafter almost always (one draft per step after each request's first verification)."""
    prompts = _prompts()
    spec = {**NGRAM, "draft_len_after_rejection": 1}
    with LLM(models["llama"], **_options("llama"), speculative_config=spec) as llm:
        if proposer == "oracle":
            use_proposer(llm, OracleProposer([p + r for p, r in zip(prompts, references["llama"])]))
        else:
            use_proposer(llm, RandomProposer(llm.engine.model_config.vocab_size))
        ours = _generate_twice(llm, prompts, _greedy())
        stats = llm.engine.stats()
        assert llm.engine.kv.pool.num_used == 0
    assert ours == references["llama"]
    if proposer == "oracle":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        assert stats.spec_accepted_per_pos[K - 1] > 0
    else:
        # Each request's first verification after a (re)start sends up to K drafts, every later one 1 (or K again
        # after a lucky full accept): far fewer than K per verification.
        assert stats.spec_num_drafts > 2 * len(prompts)
        assert stats.spec_num_draft_tokens < 1.5 * stats.spec_num_drafts


def _brute_force_drafts(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    n = len(tokens)
    for size in range(min(max_n, n - 1), min_n - 1, -1):
        suffix = tokens[n - size :]
        starts = [j for j in range(n - size) if tokens[j : j + size] == suffix]
        if starts:
            full = [j for j in starts if j + size + k <= n]
            j = max(full) if full else max(starts)
            return tokens[j + size : j + size + k]
    return []


def test_ngram_drafts_match_brute_force():
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist() for _ in range(200)]
    rows += [[5], [5, 5], [1, 2, 3, 1, 2], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]]
    # Tokens whose bytes hold another token's across a boundary (256 then 0 contain the int32 bytes of 1 at an
    # offset of one byte): only matches on token boundaries count.
    rows += [[256, 0, 7, 1], [5, 256, 0, 9, 1, 3, 1], [65536, 0, 2, 1, 256, 0, 1]]
    for k, min_n, max_n in ((3, 1, 3), (4, 2, 2), (1, 1, 5), (8, 1, 4)):
        for r in rows:
            got = ngram_draft(np.array(r, dtype=np.int32), k, min_n, max_n)
            assert got == _brute_force_drafts(r, k, min_n, max_n), (r, k, min_n, max_n)


def test_scheduler_rolls_back_rejected_drafts():
    from brisk.kv_cache.manager import KVCacheManager, KVGroupSpec
    from brisk.scheduler.output import ModelRunnerOutput
    from brisk.scheduler.request import Request
    from brisk.scheduler.scheduler import Scheduler, SpecDecodeLimits
    from brisk.structured.spec import StructuredOutputs

    kv = KVCacheManager([KVGroupSpec((0,))], 32, [4], enable_prefix_caching=True)
    sched = Scheduler(kv, max_batch_size=4, max_num_tokens=64, enable_chunked_prefill=True, spec=SpecDecodeLimits(3))
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=20), 20, frozenset(), 0)
    sched.add(req)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[5]], spec_token_ids=[[6, 7, 8]]))
    out = sched.schedule()  # the next token (5) and its three drafts
    assert out.scheduled_spec_decode_tokens == {"a": [6, 7, 8]} and out.num_scheduled_tokens == {"a": 4}
    assert len(kv.tables["a"][0]) == 2  # 7 slots: blocks of 4
    # one draft accepted (6), then the target's own 9: positions of 7 and 8 roll back, the second block empties
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[6, 9]], spec_token_ids=[[9, 9]]))
    assert req.output_token_ids == [5, 6, 9] and req.num_computed_tokens == req.num_tokens - 1 == 5
    assert len(kv.tables["a"][0]) == 2 and sched.spec_stats.num_accepted_tokens == 1
    kv.check_invariants()
    structured = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputs(regex="a+"))
    sched.add(Request("b", [4, 4], structured, 20, frozenset(), 1))
    out = sched.schedule()  # b's prefill beside a's decode and drafts (constrained requests speculate too)
    assert out.scheduled_spec_decode_tokens == {"a": [9, 9]} and out.num_scheduled_tokens == {"a": 3, "b": 2}
