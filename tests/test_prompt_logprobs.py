"""prompt_logprobs (vLLM) and prefill-only requests (max_tokens 0): every prompt token's logprob, rank and top-k
match a full forward pass of the transformers model (fp32), with one-shot prefill, chunked prefill, a prompt whose
prefix is cached (its hit is skipped), preemption, and a mixed batch with requests that do not ask."""

from __future__ import annotations

import random

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.sampling_params import InvalidRequest
from tests.tiny_models import hf_reference, make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

TOP = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model("llama", path, seed=0)
    make_tiny_tokenizer(path)
    return str(path), hf_reference(path)


def _prompts(seed: int, lengths=(2, 9, 17, 30), prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(1, 512) for _ in range(n)] for n in lengths]


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [P, vocab]: row p predicts token p + 1


def _check(hf, prompt: list[int], got) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = _reference(hf, prompt)
    for p in range(1, len(prompt)):
        row, entry = ref[p - 1], got[p]
        token = prompt[p]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        values, ids = row.topk(TOP)
        assert set(entry) == set(ids.tolist()) | {token}
        for t, v in zip(ids.tolist(), values.tolist()):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)


def _run(llm: LLM, prompts, max_tokens: int = 0):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=TOP, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_tokens": 5, "tokens_per_block": 4}, {"max_num_tokens": 7, "disable_overlap_scheduler": False}],
    ids=["whole", "chunked", "chunked-overlap"],
)
def test_prompt_logprobs_match_transformers(tiny, options):
    path, hf = tiny
    llm = LLM(path, seed=0, **options)
    prompts = _prompts(1)
    outs = _run(llm, prompts)
    for prompt, out in zip(prompts, outs):
        _check(hf, prompt, out.prompt_logprobs)
        # max_tokens 0: the prefill alone, nothing sampled, finished by length
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert llm.engine.kv.pool.num_used == 0
    llm.engine.kv.check_invariants()


def test_with_generation_and_requests_that_do_not_ask(tiny):
    path, hf = tiny
    llm = LLM(path, seed=0, max_num_tokens=7, tokens_per_block=4)
    prompts = _prompts(2)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    asking = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [asking, plain, asking, plain])
    expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], plain)]
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == expected[i]  # asking changes nothing of the generation
        if i % 2 == 0:
            _check(hf, prompt, out.prompt_logprobs)
            assert len(out.outputs[0].logprobs) == 4
        else:
            assert out.prompt_logprobs is None


def test_prefix_cache_hit_is_skipped(tiny):
    path, hf = tiny
    llm = LLM(path, seed=0, tokens_per_block=4)
    shared = _prompts(3, lengths=(16,))[0]
    first, second = _prompts(4, lengths=(5, 7), prefix=shared)
    llm.generate({"prompt_token_ids": first}, SamplingParams(temperature=0.0, max_tokens=2))
    # The same prefix again: eligible for a hit, which prompt_logprobs must skip to compute every position.
    out = _run(llm, [second], max_tokens=2)[0]
    assert out.num_cached_tokens == 0
    _check(hf, second, out.prompt_logprobs)
    # Without prompt_logprobs the hit is taken.
    plain = llm.generate({"prompt_token_ids": second}, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert plain.num_cached_tokens >= 16


def test_preempted_request_reports_each_position_once(tiny):
    path, hf = tiny
    prompts = _prompts(5, lengths=(30, 33, 36, 40))
    llm = LLM(path, seed=0, tokens_per_block=4, max_num_tokens=16, kv_cache_config={"max_blocks": 24})
    outs = _run(llm, prompts, max_tokens=30)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        _check(hf, prompt, out.prompt_logprobs)


def test_n_completions_share_one_prompt_logprobs(tiny):
    path, hf = tiny
    llm = LLM(path, seed=0, tokens_per_block=4)
    prompt = _prompts(6, lengths=(13,))[0]
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=TOP)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert len(out.outputs) == 3
    _check(hf, prompt, out.prompt_logprobs)


def test_prompt_logprobs_validated():
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(prompt_logprobs=21)
    assert err.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequest):
        SamplingParams(max_tokens=-1)
