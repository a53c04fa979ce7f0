"""Speculative verification steps on the static (CUDA graph) buffers: every request's drafts padded to
max_draft_len, a step of B requests x (k + 1) tokens padded to a captured batch size. On a CPU the same buffers run
uncaptured (what a GPU replays); greedy output stays token-identical to decoding without speculation or graphs."""

from __future__ import annotations

import random

import pytest

from brisk import LLM, SamplingParams
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

K = 3
OPTIONS = dict(seed=0, dtype="float32", tokens_per_block=4, max_num_tokens=64, check_kv_invariants=True)
GRAPHS = {"batch_sizes": [1, 2, 4, 8], "enable_padding": True}
NGRAM = {"decoding_type": "NGram", "max_draft_len": K, "max_matching_ngram_size": 2}


def _prompts() -> list[dict]:
    """Copy-heavy prompts (prompt lookup finds their continuation) and random ones (no draft: padded ones only)."""
    rng = random.Random(5)
    prompts = []
    for n in (6, 11, 17):
        passage = [rng.randrange(1, 512) for _ in range(n)]
        prompts.append(passage + passage[: n // 2] + passage[:3])
    prompts += [[rng.randrange(1, 512) for _ in range(n)] for n in (4, 9)]
    return [{"prompt_token_ids": p} for p in prompts]


def record_static_steps(graphs) -> list[tuple[int, int, int]]:
    """(requests, padded requests, tokens per request) of every step that runs on the static buffers, appended as
    they run."""
    shapes: list[tuple[int, int, int]] = []
    run = graphs.run

    def spy(step, last_sampled, shape):
        shapes.append((step.num_rows, *shape))
        return run(step, last_sampled, shape)

    graphs.run = spy
    return shapes


@pytest.mark.parametrize(
    "arch, layout",
    [("llama", {}), ("gpt_oss", {}), ("gpt_oss", dict(tp_size=2, enable_attention_dp=True))],
    ids=["llama", "gpt_oss", "gpt_oss-dp2"],
)
def test_verification_on_static_buffers_is_token_identical(arch, layout, tmp_path):
    make_tiny_model(arch, tmp_path, seed=0)
    make_tiny_tokenizer(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    with LLM(str(tmp_path), **OPTIONS) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
    with LLM(str(tmp_path), **OPTIONS, **layout, speculative_config=NGRAM, cuda_graph_config=GRAPHS) as llm:
        graphs = llm.engine.executor.runner.graphs  # rank 0's (under attention DP: to the ranks' common size)
        assert graphs is not None and graphs.query_lens == [1, K + 1]
        graphs.pad_input_id, graphs.pad_position = 321, 7  # padding rows' inputs must not reach the real rows
        shapes = record_static_steps(graphs)
        ours = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]
        stats = llm.engine.stats()
        assert llm.engine.kv.pool.num_used == 0
    assert ours == reference
    verify = [(b, padded) for b, padded, t in shapes if t == K + 1]
    assert verify, "no verification step ran on the static buffers"
    assert any(padded > b for b, padded in verify), "no verification step was padded with rows"
    assert stats.spec_num_accepted_tokens > 0  # the copy-heavy prompts' drafts are accepted through the graph path
    # every draft list was padded to k: the scheduler sent k drafts a request, except where max_tokens trimmed them
    assert stats.spec_num_draft_tokens >= K * len(verify)
