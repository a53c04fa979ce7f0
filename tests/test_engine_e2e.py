"""End to end: greedy generations from brisk are token-identical to `transformers.generate`.

For each architecture (tiny random weights, fp32, CPU), a batch of prompts of different lengths, also
with chunked prefill forced small, with prefix-cache hits, and with a KV pool so small that requests
are preempted and recomputed. gpt-oss runs past its sliding window and with MXFP4 experts.
"""

from __future__ import annotations

import random

import pytest
import torch

from brisk import LLM, SamplingParams
from tests.conftest import cpu_kernel_isas_under_test, skip_unless_isa_under_test
from tests.tiny_models import hf_reference, make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

MAX_NEW = 12
ARCHS = ["llama", "qwen3", "gpt_oss", "gpt_oss_mxfp4"]


def _build(arch: str, tmp_path_factory):
    path = tmp_path_factory.mktemp(arch)
    make_tiny_model(arch.removesuffix("_mxfp4"), path, seed=0, mxfp4=arch.endswith("_mxfp4"))
    make_tiny_tokenizer(path)
    hf = hf_reference(path)
    hf.generation_config.eos_token_id = None  # compare full-length generations
    hf.generation_config.pad_token_id = 0
    return arch, str(path), hf


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["gpt_oss", "gpt_oss_mxfp4"])
def tiny_gpt_oss(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


def _prompts(seed: int, n: int = 8, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 512) for _ in range(shared_prefix)]
    lengths = [3, 7, 12, 17, 21, 26, 33, 40, 9, 15][:n]
    return [prefix + [rng.randrange(1, 512) for _ in range(length)] for length in lengths]


def _hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, min_new_tokens=MAX_NEW)
            outs.append(ids[0, len(p) :].tolist())
    return outs


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _brisk(path: str, prompts, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(path, seed=0, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    llm.engine.kv.check_invariants()
    return llm, [o.outputs[0].token_ids for o in outs]


def test_batch_matches_transformers(request, tiny):
    _, path, hf = tiny
    prompts = _prompts(1)
    llm, ours = _brisk(path, prompts)
    # By default the best C kernels this CPU runs (of those this run tests); no compiler, or none: PyTorch paths.
    isas = cpu_kernel_isas_under_test(request.config)
    kernels = llm.engine.executor.runner.kernels.cpu
    assert (kernels.isa if kernels else None) == (isas[0] if isas else None)
    if kernels is not None:
        assert type(llm.engine.executor.runner.attn_layers[0].backend).__name__ == "CpuAttentionBackend"
        assert llm.engine.executor.runner.model.model.norm.cpu_kernels is kernels
    assert ours == _hf_greedy(hf, prompts)
    assert llm.engine.kv.pool.num_used == 0


def test_forced_avx2_kernels_match(request, tiny):
    # `cpu_kernels: avx2` runs what CPUs without AVX-512 run (on an AVX-512 machine too): the same greedy tokens,
    # with batched decode steps through the AVX2 matmul, attention and MoE kernels.
    skip_unless_isa_under_test(request.config, "avx2")
    _, path, hf = tiny
    prompts = _prompts(5)
    llm, ours = _brisk(path, prompts, cpu_kernels="avx2")
    assert llm.engine.executor.runner.kernels.cpu.isa == "avx2"
    assert type(llm.engine.executor.runner.attn_layers[0].backend).__name__ == "CpuAttentionBackend"
    assert ours == _hf_greedy(hf, prompts)


def test_pytorch_reference_paths_match(tiny):
    # By default CPU attention and norms run brisk's C kernels; the PyTorch reference must generate the same.
    _, path, hf = tiny
    prompts = _prompts(1)
    llm, ours = _brisk(path, prompts, cpu_kernels="torch", max_num_tokens=16)
    runner = llm.engine.executor.runner
    assert runner.kernels.cpu is None
    assert type(runner.attn_layers[0].backend).__name__ == "TorchAttentionBackend"
    assert ours == _hf_greedy(hf, prompts)


@pytest.mark.parametrize(
    "chunking", [{"max_num_tokens": 5}, {"long_prefill_token_threshold": 3}], ids=["budget", "long-prefill-threshold"]
)
def test_chunked_prefill_matches(tiny, chunking):
    _, path, hf = tiny
    prompts = _prompts(2)
    llm, ours = _brisk(path, prompts, tokens_per_block=4, **chunking)
    assert ours == _hf_greedy(hf, prompts)


def test_prefix_cache_hits_match(tiny):
    _, path, hf = tiny
    prompts = _prompts(3, shared_prefix=24)
    llm = LLM(path, seed=0, tokens_per_block=4)
    first = llm.generate({"prompt_token_ids": prompts[0]}, _greedy())
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], _greedy())
    assert all(o.num_cached_tokens >= 24 for o in rest)
    assert llm.engine.kv.prefix_hits > 0
    ours = [o.outputs[0].token_ids for o in first + rest]
    assert ours == _hf_greedy(hf, prompts)
    llm.engine.kv.check_invariants()


def test_cache_salt_shares_blocks_only_within_a_salt(tiny):
    """vLLM's cache_salt: a prompt's cached blocks are found again only under its salt (none: only unsalted); the
    tokens are those without it. With the host tier too: a salted block evicted to the host is its salt's there."""
    _, path, hf = tiny
    prompt = _prompts(1, n=1, shared_prefix=24)[0]
    host = {"host_cache_size": 1 << 22, "max_blocks": 40}
    with LLM(path, seed=0, tokens_per_block=4, kv_cache_config=host) as llm:

        def cached(salt: str | None) -> int:
            request = {"prompt_token_ids": prompt} | ({"cache_salt": salt} if salt else {})
            [out] = llm.generate(request, _greedy())
            assert out.outputs[0].token_ids == expected
            return out.num_cached_tokens

        [expected] = [o.outputs[0].token_ids for o in llm.generate({"prompt_token_ids": prompt}, _greedy())]
        assert [cached("tenant-a"), cached("tenant-b"), cached("tenant-a"), cached(None)] == [0, 0, 24, 24]
        llm.generate([{"prompt_token_ids": p} for p in _prompts(6)], _greedy())  # evicts the blocks to the host
        host_hits = llm.engine.kv.host_hits
        assert [cached("tenant-b"), cached("tenant-c")] == [24, 0]
        assert llm.engine.kv.host_hits > host_hits
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt_token_ids": prompt, "cache_salt": ""}, _greedy())
        llm.engine.kv.check_invariants()
        assert llm.engine.kv.pool.num_used == 0
    assert expected == _hf_greedy(hf, [prompt])[0]


def test_preemption_matches(tiny):
    _, path, hf = tiny
    prompts = _prompts(4)
    # 2 groups (gpt-oss) x ceil((40+12)/4) blocks = 26 blocks fit one long request; 8 requests do not.
    llm, ours = _brisk(path, prompts, tokens_per_block=4, kv_cache_config={"max_blocks": 40})
    assert llm.engine.scheduler.num_preemptions > 0
    assert ours == _hf_greedy(hf, prompts)
    assert llm.engine.kv.pool.num_used == 0


def test_long_context_past_sliding_window(tiny_gpt_oss):
    _, path, hf = tiny_gpt_oss
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (60, 90)]
    llm, ours = _brisk(path, prompts, max_num_tokens=16, tokens_per_block=4)
    window = llm.engine.model_config.sliding_window
    assert len(prompts[1]) > 4 * window
    assert ours == _hf_greedy(hf, prompts)


def test_bf16_prepacked_weights_generate_what_plain_matmuls_generate(tiny):
    # CPU bf16: weights reordered for oneDNN at load (cpu_weight_prepack) must not change a single token. Dense
    # layers are prepacked where brisk's CPU kernels are not bound (with them, the kernels' plain weights serve).
    from brisk.layers.linear import prepack_cpu_weight

    if prepack_cpu_weight(torch.zeros(8, 8, dtype=torch.bfloat16)) is None:
        pytest.skip("this CPU's torch has no oneDNN bf16 matmul")
    _, path, _ = tiny
    prompts = _prompts(9)
    packed_llm, packed = _brisk(path, prompts, dtype="bfloat16", cpu_kernels="torch")
    plain_llm, plain = _brisk(path, prompts, dtype="bfloat16", cpu_kernels="torch", cpu_weight_prepack=False)
    model = packed_llm.engine.executor.runner.model
    assert model.lm_head.packed_weight is not None
    assert all(getattr(m, "packed_weight", None) is None for m in plain_llm.engine.executor.runner.model.modules())
    assert packed == plain


def test_repetition_penalty_matches_transformers(tiny):
    """The repetition penalty over prompt and outputs (HF's semantics): a batch whose rows join and leave (a pool
    small enough to preempt, so a resumed request's prompt is read again) generates what transformers does."""
    _, path, hf = tiny
    prompts = _prompts(5)
    with torch.no_grad():
        expected = [
            hf.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                repetition_penalty=1.5,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.5)
    # as test_preemption_matches: one long request fits, the batch does not
    with LLM(path, seed=0, tokens_per_block=4, kv_cache_config={"max_blocks": 40}, max_num_tokens=32) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.stats().num_preemptions > 0, "the pool was meant to preempt"
        llm.engine.kv.check_invariants()
    assert [o.outputs[0].token_ids for o in outs] == expected
