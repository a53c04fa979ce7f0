"""On a GPU: greedy generations through the Triton kernels equal those of the torch reference backends.

Skipped without CUDA (CI has none); the kernels themselves are checked on CPU under TRITON_INTERPRET in
tests/test_triton_attention.py and tests/test_triton_moe.py.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from brisk import LLM, SamplingParams
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# FP8 full attention (blocks of 64 tokens in fp32's bytes of 16) beside fp32 sliding windows: each kernel reads its
# group's block size off the cache
FP8_SKIP_SLIDING = {"kv_cache_dtype": "fp8", "kv_cache_dtype_skip_layers": ["sliding_window"]}


@pytest.mark.parametrize(
    "mxfp4, options",
    [(True, {}), (False, {}), (True, FP8_SKIP_SLIDING)],
    ids=["mxfp4", "bf16-experts", "fp8-skip-sliding"],
)
def test_triton_path_matches_torch_path(tmp_path, mxfp4, options):
    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0, mxfp4=mxfp4)
    make_tiny_tokenizer(path)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(n)]} for n in (3, 9, 17, 40, 70, 5, 33, 12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            attn_backend=backend,
            moe_config={"backend": backend},
            tokens_per_block=16,
            max_num_tokens=64,
            max_batch_size=8,  # the 8 prompts; graphs captured for 1..8, not the default ladder up to 256
            cuda_graph_config={"batch_sizes": [1, 2, 4, 8]},
            **options,
        )
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.parametrize("batch", [1, 3, 8, 64])
def test_cuda_graphs_generate_what_eager_steps_do(tmp_path, batch):
    """Decode steps replayed from CUDA graphs (padded to the captured sizes) equal eager steps, with overlap
    scheduling on (the GPU default). In float32: graph decode sizes split-K from max_seq_len where eager sizes it
    from the live context (the sink merged in the reduce instead of in the kernel) and padded batch sizes may get
    other cuBLAS kernels, so the arithmetic differs by rounding; in bf16 that can flip a greedy token without any
    bug, in float32 it does not (as in the verify and EAGLE3 graph tests below)."""
    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0, mxfp4=True)
    make_tiny_tokenizer(path)
    rng = random.Random(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(rng.randrange(3, 40))]} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for name, graphs in (("eager", None), ("graphs", {"max_batch_size": 64, "enable_padding": True})):
        llm = LLM(path, device="cuda", dtype="float32", cuda_graph_config=graphs, max_batch_size=64)
        if graphs is not None:
            assert llm.engine.executor.runner.graphs is not None
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.kv.pool.num_used == 0
        del llm
        torch.cuda.empty_cache()
    assert outputs["graphs"] == outputs["eager"]


def test_overlap_and_graphs_generate_what_plain_eager_steps_do(tmp_path):
    """Overlap scheduling (step N+1 prepared while step N runs), alone and with CUDA-graph replay, against eager
    steps without overlap: the same greedy tokens, requests finishing at different steps (the wasted token of an
    overlapped finish must never reach the output), every KV block returned. In float32, for the reason given in
    test_cuda_graphs_generate_what_eager_steps_do (graph and eager steps round differently; overlap may also run a
    step at another batch size)."""
    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0, mxfp4=True)
    make_tiny_tokenizer(path)
    rng = random.Random(11)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(rng.randrange(3, 40))]} for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(8)]
    # Logprobs and prompt logprobs come to the host by their own copy, read after the next step is launched.
    params[1] = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2)
    params[2] = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    runs = {
        "plain": dict(disable_overlap_scheduler=True, cuda_graph_config=None),
        "overlap": dict(disable_overlap_scheduler=False, cuda_graph_config=None),
        "overlap+graphs": dict(disable_overlap_scheduler=False, cuda_graph_config={"batch_sizes": [1, 2, 4, 8]}),
    }
    outputs, logprobs = {}, {}
    for name, options in runs.items():
        llm = LLM(path, device="cuda", dtype="float32", max_batch_size=8, **options)
        results = llm.generate(prompts, params)
        outputs[name] = [o.outputs[0].token_ids for o in results]
        sampled = [(t, d[t]) for t, d in zip(results[1].outputs[0].token_ids, results[1].outputs[0].logprobs or [])]
        prompt = [(t, d[t].logprob) for t, d in zip(prompts[2]["prompt_token_ids"][1:], results[2].prompt_logprobs[1:])]
        logprobs[name] = sampled + prompt
        assert llm.engine.kv.pool.num_used == 0
        del llm
        torch.cuda.empty_cache()
    assert [len(t) for t in outputs["plain"]] == [4 + 3 * i for i in range(8)]
    assert outputs["overlap"] == outputs["plain"]
    assert outputs["overlap+graphs"] == outputs["plain"]
    n = 7 + len(prompts[2]["prompt_token_ids"]) - 1
    for name in ("overlap", "overlap+graphs"):  # the same tokens; values to fp32 rounding (other batch shapes)
        assert len(logprobs[name]) == len(logprobs["plain"]) == n
        assert [t for t, _ in logprobs[name]] == [t for t, _ in logprobs["plain"]]
        assert [v for _, v in logprobs[name]] == pytest.approx([v for _, v in logprobs["plain"]], abs=1e-4)


def test_an_overlapped_step_never_waits_for_the_device(tmp_path):
    """Overlap scheduling holds only if launching a step never waits for the GPU: torch's sync debug mode, around
    every execute_model (layout, forward or graph replay, sampling with truncation, logit_bias and logprobs, the
    result's copy started), reports each synchronising CUDA call; there must be none. The step's one wait is in
    StepResult.result(), outside. (tests/test_rehearsed_gpu_path.py checks the same calls on a CPU.)"""
    import warnings

    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0, mxfp4=True)
    make_tiny_tokenizer(path)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(rng.randrange(3, 40))]} for _ in range(12)]
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, logit_bias={5: 2.0}, logprobs=2, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    ] * 6
    with LLM(path, device="cuda", dtype="float32", max_batch_size=16) as llm:
        runner = llm.engine.executor.runner
        assert llm.engine.overlap
        launch = runner.execute_model

        def watched(scheds):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return launch(scheds)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        runner.execute_model = watched
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            outputs = llm.generate(prompts, params)
        assert all(o.outputs[0].token_ids for o in outputs)
    # the mode's own "is a prototype feature" notice is no synchronisation; each caught one reads "called a
    # synchronizing CUDA operation"
    syncs = sorted({str(w.message)[:200] for w in seen if "called a synchronizing" in str(w.message)})
    assert not syncs, syncs


def test_structured_outputs_on_cuda_logits_hold_the_constraints(tmp_path):
    """Structured outputs on a GPU: the grammar's bitmask is applied to CUDA logits (xgrammar's Triton kernel) in
    the runner; hot sampling over many seeds must still produce only what the constraints allow, never a token of
    the model's padded vocabulary."""
    from brisk.structured import StructuredOutputs

    path = make_tiny_model("llama", tmp_path / "m", seed=0, vocab_size=544)  # embedding padded past the tokenizer
    make_tiny_tokenizer(path, 512)
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "level": {"const": 3}},
        "required": ["unit", "level"],
        "additionalProperties": False,
    }
    pattern = r"[0-9]{2,4}-[a-z]{3}"
    seeds = range(16)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=StructuredOutputs(json=schema))
        for s in seeds
    ] + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=30, structured_outputs=StructuredOutputs(regex=pattern))
        for s in seeds
    ]
    with LLM(path, device="cuda", dtype="float32", max_batch_size=32, grammar_max_json_whitespace=1) as llm:
        outputs = llm.generate([[5, 6, 7]] * len(params), params)
        eos = set(llm.engine.model_config.eos_token_ids)
        for out in outputs[: len(seeds)]:
            completion = out.outputs[0]
            assert completion.finish_reason == "stop" and all(t < 512 for t in completion.token_ids), completion
            value = json.loads(llm.tokenizer.decode([t for t in completion.token_ids if t not in eos]), strict=False)
            assert (
                set(value) == {"unit", "level"} and value["unit"] in ("celsius", "fahrenheit") and value["level"] == 3
            )
        for out in outputs[len(seeds) :]:
            assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
        assert llm.engine.kv.pool.num_used == 0


@pytest.mark.parametrize("batch", [1, 5])
def test_cuda_graphs_replay_speculative_verify_steps(tmp_path, batch):
    """n-gram verify steps (k + 1 tokens a request) replayed from their own CUDA graphs equal eager decoding
    without speculation; copy-heavy prompts so that drafts are accepted."""
    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0, mxfp4=True)
    make_tiny_tokenizer(path)
    rng = random.Random(batch)
    prompts = []
    for _ in range(batch):
        passage = [rng.randrange(1, 512) for _ in range(rng.randrange(5, 20))]
        prompts.append({"prompt_token_ids": passage + passage + passage[:3]})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ngram = {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}
    outputs = {}
    for name, options in (
        ("eager", {}),
        ("graphs", {"speculative_config": ngram, "cuda_graph_config": {"batch_sizes": [1, 2, 4, 8]}}),
    ):
        llm = LLM(path, device="cuda", dtype="float32", max_batch_size=8, **options)
        if options:
            graphs = llm.engine.executor.runner.graphs
            assert graphs is not None and graphs.capture and graphs.query_lens == [1, 4]
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if options:
            assert llm.engine.stats().spec_num_accepted_tokens > 0
        assert llm.engine.kv.pool.num_used == 0
        del llm
        torch.cuda.empty_cache()
    assert outputs["graphs"] == outputs["eager"]


def test_cuda_graphs_with_eagle3_generate_what_eager_steps_do(tmp_path):
    """EAGLE3 (a random head) with the target's steps replayed from CUDA graphs: the same greedy tokens as eager
    decoding without speculation (the aux hidden states come out of the graphs)."""
    from brisk.model_config import ModelConfig
    from tests.test_eagle3_model import head_config, head_weights, write_head

    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0, mxfp4=True)
    make_tiny_tokenizer(path)
    target = ModelConfig.from_pretrained(path, dtype="float32")
    aux = [1, target.num_layers // 2, target.num_layers - 1]
    head = write_head(
        tmp_path / "head",
        head_config(target, eagle_config={"eagle_aux_hidden_state_layer_ids": aux}),
        head_weights(target, seed=5),
    )
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(rng.randrange(3, 30))]} for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eagle = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(head)}
    outputs = {}
    for name, options in (
        ("eager", {}),
        ("graphs", {"speculative_config": eagle, "cuda_graph_config": {"batch_sizes": [1, 2, 4, 8]}}),
    ):
        llm = LLM(path, device="cuda", dtype="float32", max_batch_size=8, **options)
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.kv.pool.num_used == 0
        del llm
        torch.cuda.empty_cache()
    assert outputs["graphs"] == outputs["eager"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_graphs_with_tensor_parallel_collectives(tmp_path):
    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0)
    make_tiny_tokenizer(path)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for tp in (1, 2):
        with LLM(path, device="cuda", dtype="float32", tp_size=tp, cuda_graph_config={"batch_sizes": [1, 2, 4]}) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]
