"""The engine's hot loop: every combination of overlap scheduling and the static-buffer decode path
(`cuda_graph_config`: null, padded sizes [1, 2, 4, 8], the default) generates exactly what the plain loop does.

Tiny random Llama, Qwen3 and gpt-oss (fp32, CPU). One workload per model exercises batching, chunked prefill (a
small token budget), preemption (a small KV pool), prefix-cache hits (shared prefixes, and a second identical
generate), n > 1 completions, stop strings, stop token ids, max_tokens, greedy and seeded sampling; every run
checks the KV invariants after each step and ends with every block free. Aborts mid-stream are checked on the
engine core directly, and padding rows are poisoned to show they never write a block a request owns.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.engine.core import EngineCore
from brisk.engine.messages import EngineCoreRequest
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

PADDED = {"batch_sizes": [1, 2, 4, 8], "enable_padding": True}
# (overlap, cuda_graph_config); the first is the plain loop every other one is compared with.
LOOPS = {
    "plain": (False, None),
    "plain-padded": (False, PADDED),
    "plain-default-graphs": (False, {}),
    "overlap": (True, None),
    "overlap-padded": (True, PADDED),
    "overlap-default-graphs": (True, {}),
}
ENGINE = dict(dtype="float32", tokens_per_block=4, max_num_tokens=24, seed=0, check_kv_invariants=True)
# The workload below needs more at once: some requests are preempted and recomputed (gpt-oss: two KV groups).
MAX_BLOCKS = {"llama": 22, "qwen": 22, "gpt_oss": 34}  # by the model directory name, less its number


def _options(path: str, overlap: bool, graphs: dict | None) -> dict:
    max_blocks = MAX_BLOCKS[os.path.basename(path).rstrip("0123456789")]
    options = dict(ENGINE, disable_overlap_scheduler=not overlap, kv_cache_config={"max_blocks": max_blocks})
    # {}: the default sizes (1, 2, 4, 8, 16, ... 256), given explicitly: on a CPU an absent cuda_graph_config pads nothing.
    options["cuda_graph_config"] = graphs
    return options


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt_oss"])
def model(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, path, seed=0)
    make_tiny_tokenizer(path)
    return str(path)


def _workload(stop_text: str | None, stop_token: int | None) -> list[tuple[dict, SamplingParams]]:
    rng = random.Random(0)
    prefix = [rng.randrange(1, 512) for _ in range(9)]
    prompts = [prefix + [rng.randrange(1, 512) for _ in range(n)] for n in (2, 7, 13, 21, 30, 4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=11, max_tokens=10, ignore_eos=True)
    work = [
        (prompts[0], greedy),
        (prompts[1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),  # finishes early
        (prompts[2], seeded),
        (prompts[3], SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=8, ignore_eos=True)),
        (prompts[4], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)),
        (prompts[5], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=4)),
        # penalties: under overlap the previous step's token is counted on the device
        (prompts[2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.4)),
        (
            prompts[4],
            SamplingParams(
                temperature=0.9, seed=3, max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0
            ),
        ),
    ]
    if stop_text is not None:
        work.append((prompts[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop_text])))
    if stop_token is not None:
        work.append((prompts[0], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_token])))
        # the same stop held back by min_tokens (it reads the outputs' count, which overlap has before their values)
        held = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_token], min_tokens=4)
        work.append((prompts[0], held))
    return [({"prompt_token_ids": p}, params) for p, params in work]


def _generate(path: str, overlap: bool, graphs: dict | None, work) -> list:
    with LLM(path, **_options(path, overlap, graphs)) as llm:
        results = []
        for _ in range(2):  # the second round hits the prefix cache
            outs = llm.generate([p for p, _ in work], [s for _, s in work])
            results.append(
                [
                    (c.token_ids, c.text, c.finish_reason, c.logprobs and [sorted(d) for d in c.logprobs])
                    for o in outs
                    for c in o.outputs
                ]
            )
        engine = llm.engine
        assert engine.overlap == overlap
        assert (engine.executor.runner.graphs is None) == (graphs is None)
        assert engine.stats().prefix_hits > 0 and engine.stats().num_preemptions > 0
        assert not engine.has_unfinished_requests()
        for kv in engine.kv_managers:
            kv.check_invariants()
            assert kv.pool.num_used == 0 and not kv.tables
        return results


def test_every_loop_generates_what_the_plain_loop_does(model):
    with LLM(model, **_options(model, False, None)) as llm:  # pick a stop string and a stop token from a plain run
        reference = llm.generate([_workload(None, None)[0][0]], _workload(None, None)[0][1])[0].outputs[0]
    stop_text = reference.text[len(reference.text) // 2 :][:2] or None
    work = _workload(stop_text, reference.token_ids[3])
    expected = _generate(model, *LOOPS["plain"], work)
    assert any(reason == "stop" for _, _, reason, _ in expected[0])
    assert any(reason == "length" for _, _, reason, _ in expected[0])
    assert expected[0] == expected[1]  # greedy and seeded requests repeat exactly with prefix-cache hits
    for name, (overlap, graphs) in LOOPS.items():
        if name != "plain":
            assert _generate(model, overlap, graphs, work) == expected, name


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_abort_mid_stream_stops_output_and_frees_blocks(model, overlap):
    llm = LLM(model, **_options(model, overlap, PADDED))
    core: EngineCore = llm.engine
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(5):
        core.add_request(EngineCoreRequest(f"r{i}", [rng.randrange(1, 512) for _ in range(5 + 3 * i)], params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(5)}
    aborted: set[str] = set()
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.request_id not in aborted, "a token after the abort"
            tokens[out.request_id].extend(out.new_token_ids)
        steps += 1
        if steps == 4:
            for out in core.abort_request("r1") + core.abort_request("r3"):
                assert out.finish_reason == "abort"
            aborted = {"r1", "r3"}
    for kv in core.kv_managers:
        assert kv.pool.num_used == 0 and not kv.tables
    assert all(len(tokens[r]) == 12 for r in ("r0", "r2", "r4"))
    assert all(len(tokens[r]) < 12 for r in aborted)
    llm.shutdown()


def test_padding_rows_never_write_a_requests_blocks(model):
    """Padding rows with poisoned inputs (other tokens, other positions) leave every block a request owns exactly
    as padding rows with the neutral inputs do: they write only the null block."""
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(n)]} for n in (3, 6, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    caches, outputs = [], []
    per_row_exact = True
    for poison in (False, True):
        options = _options(model, False, {"batch_sizes": [4, 8], "enable_padding": True})
        options["enable_chunked_prefill"] = True
        with LLM(model, **options) as llm:
            runner = llm.engine.executor.runner
            graphs = runner.graphs
            if poison:
                graphs.pad_input_id, graphs.pad_position = 321, 7
            padded_steps = []
            run = graphs.run

            def spy(step, last_sampled, shape, run=run, padded_steps=padded_steps):
                padded_steps.append(shape[0] - step.num_rows)
                return run(step, last_sampled, shape)

            graphs.run = spy
            outs = llm.generate(prompts, params)
            assert sum(padded_steps) > 0, "no step ran with padding rows"
            outputs.append([o.outputs[0].token_ids for o in outs])
            per_row_exact = runner.kernels.cpu is not None
            layer = runner.attn_layers[0]
            caches.append((layer.k_cache[1:].clone(), layer.v_cache[1:].clone()))  # every block but the null one
    assert outputs[0] == outputs[1]
    if per_row_exact:  # brisk's C kernels compute each row alone: other rows' inputs change no bit of it
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    else:
        # The PyTorch paths (no C compiler, cpu_kernels: torch) are not batch-invariant: the reference MoE groups
        # rows by expert, so what the padding rows route to changes the matmul shapes of the real rows and their
        # rounding (measured: at most 1.2e-6 here), which reaches the KV of the later layers sharing this slot
        # tensor. A padding row writing a real block would put its own K/V there: differences of order one.
        torch.testing.assert_close(caches[1], caches[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("asked", ["logprobs", "prompt_logprobs"])
def test_overlap_reads_a_steps_logprobs_after_launching_the_next(model, monkeypatch, asked):
    # A step's logprobs (and prompt logprobs) come to the host by their own copy, read where the step's outputs are
    # built: with overlap that is after the next step is launched (on a GPU, reading them inside the step would make
    # the host wait for it before queuing the next one).
    from brisk.host import HostResult
    from brisk.model_runner.runner import ModelRunner
    from brisk.model_runner.step_output import packed_rows

    events: list[str] = []
    launch, read = ModelRunner.execute_model, HostResult.get
    monkeypatch.setattr(ModelRunner, "execute_model", lambda self, s: (events.append("launch"), launch(self, s))[1])

    def get(self):  # reads of logprobs, not of the packed rows (built by packed_rows)
        if self._build is not packed_rows:
            events.append("read")
        return read(self)

    monkeypatch.setattr(HostResult, "get", get)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **{asked: 2})
    with LLM(model, **_options(model, True, None)) as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params)[0]
    if asked == "logprobs":
        assert len(out.outputs[0].logprobs) == 6 and events.count("read") == 6
    else:  # the one prefill step's: three prompt tokens after the first, each with its top 2
        assert len(out.prompt_logprobs) == 4 and all(len(lp) >= 2 for lp in out.prompt_logprobs[1:])
        assert events.count("read") == 1
    reads = [i for i, e in enumerate(events) if e == "read"]
    for n, at in enumerate(reads[:-1] if asked == "logprobs" else reads):
        assert events[:at].count("launch") >= n + 2, events  # step n's (from 0) after step n + 1 was launched


@pytest.mark.parametrize(
    "params",
    [dict(min_tokens=4, stop_token_ids=[9]), dict(repetition_penalty=1.3, presence_penalty=0.5, min_tokens=4)],
    ids=["min_tokens", "penalties"],
)
def test_sampling_under_overlap_never_waits_for_the_previous_step(model, monkeypatch, params):
    # min_tokens needs the count of a request's outputs, which the runner has while their values are still on the
    # device; the penalties count the previous step's token where it is, on the device: no step reads the previous
    # one's tokens while it is launched.
    from brisk.host import HostResult
    from brisk.model_runner.runner import ModelRunner
    from brisk.model_runner.step_output import packed_rows

    inside, reads_inside = [False], [0]
    launch, read = ModelRunner.execute_model, HostResult.get

    def execute_model(self, scheds):
        inside[0] = True
        try:
            return launch(self, scheds)
        finally:
            inside[0] = False

    def get(self):
        reads_inside[0] += inside[0] and self._build is packed_rows
        return read(self)

    monkeypatch.setattr(ModelRunner, "execute_model", execute_model)
    monkeypatch.setattr(HostResult, "get", get)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, **params)
    with LLM(model, **_options(model, True, None)) as llm:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [3, 4]}], sampling)
    assert all(len(o.outputs[0].token_ids) >= 4 for o in out)
    assert reads_inside[0] == 0


@pytest.mark.parametrize("graphs", [None, PADDED], ids=["eager", "padded"])
def test_the_attention_plan_is_built_once_a_step(model, monkeypatch, graphs):
    """The step's attention plan (the backend's per-step metadata) is built once and read by every layer: a layer
    that found it built by another backend would build its own again, each step."""
    from brisk.model_runner.runner import ModelRunner

    forwards: list[int] = []
    plans: list[int] = []
    with LLM(model, **_options(model, False, graphs)) as llm:
        runner = llm.engine.executor.runner
        backend = runner.kernels.attention
        prepare, forward = backend.prepare, runner.model.forward
        monkeypatch.setattr(backend, "prepare", lambda meta: (plans.append(1), prepare(meta))[1])
        monkeypatch.setattr(runner.model, "forward", lambda *a, **k: (forwards.append(1), forward(*a, **k))[1])
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    assert isinstance(runner, ModelRunner) and len(forwards) == 5 and len(plans) == len(forwards)


def test_a_repetition_penalty_reads_each_prompt_once(model, monkeypatch):
    """The repetition penalty's view of a prompt is built when its request is first sampled and kept: decoding
    reads only the outputs each step (a step used to rebuild every prompt, host work of the batch's whole context)."""
    from brisk.model_runner import sampling_stage

    built: list[int] = []
    mask = sampling_stage.prompt_token_mask
    monkeypatch.setattr(
        sampling_stage, "prompt_token_mask", lambda prompts, *a: (built.append(len(prompts)), mask(prompts, *a))[1]
    )
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    with LLM(model, **_options(model, True, None)) as llm:
        outs = llm.generate(prompts, params)
        llm.generate([{"prompt_token_ids": [9, 9]}], SamplingParams(max_tokens=2))  # the finished ones leave
        assert not llm.engine.executor.runner.sampling._prompt_masks  # their rows freed
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert sum(built) == len(prompts)
