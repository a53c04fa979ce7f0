"""Decode steps on the static (CUDA graph) buffers under attention data parallelism, two ranks over gloo.

Every DP rank pads its decode batch to one common captured size per step (the largest of the ranks' padded
sizes) and an idle rank joins with padding rows only, so the MoE all-gather / reduce-scatter has the shapes a
captured graph holds. On a CPU the same buffers run uncaptured (what a GPU replays). The padding rows of BOTH
ranks are poisoned (the last token id, the last position): rank 1 is started here as a launcher-started worker
with the poison applied in its own process. Greedy tokens must equal a single-rank run and eager attention DP,
and both ranks must have run every static step at the same shape.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
from pathlib import Path

import pytest

from brisk import LLM, SamplingParams
from brisk.config import EngineConfig
from brisk.distributed.launch import free_port, launcher_env, rank_place
from brisk.distributed.worker import run_worker
from brisk.model_runner.cuda_graph import DecodeGraphs
from brisk.scheduler.output import SchedulerOutput
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

OPTIONS = dict(device="cpu", dtype="float32", tokens_per_block=4, seed=0)
DP2 = dict(tp_size=2, ep_size=2, enable_attention_dp=True, disable_overlap_scheduler=False)
GRAPHS = {"batch_sizes": [1, 2, 4, 8], "enable_padding": True}
POISON_TOKEN = 511  # the tiny models' last token id (vocab 512)
# Requests go to the rank with fewer unfinished ones, rank 0 first: rank 0 gets requests 0, 2, 4 (short) and rank
# 1 requests 1 and 3 (long), so the ranks pad to each other's sizes and rank 0 idles while rank 1 decodes.
MAX_TOKENS = [3, 12, 5, 14, 4]


def _requests() -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(11)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(n)]} for n in (5, 9, 7, 12, 6)]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def _generate(llm: LLM) -> list[list[int]]:
    prompts, params = _requests()
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def instrument(shapes: list[tuple[int, int, int]]) -> None:
    """Poison every DecodeGraphs' padding rows (the last token id at the last position) and record each static
    step as (the rank's requests, padded requests, tokens per request)."""
    init, run = DecodeGraphs.__init__, DecodeGraphs.run

    def poisoned_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pad_input_id, self.pad_position = POISON_TOKEN, self.target.max_seq_len - 1

    def recording_run(self, step, last_sampled, shape):
        shapes.append((step.num_rows, *shape))
        return run(self, step, last_sampled, shape)

    DecodeGraphs.__init__ = poisoned_init  # type: ignore[method-assign]
    DecodeGraphs.run = recording_run  # type: ignore[method-assign]


def rank1(model: str, env: dict[str, str], record: str, cpu_kernels: str = "auto") -> None:
    """Rank 1 as a launcher starts it (torchrun's variables), its padding rows poisoned in its own process;
    `cpu_kernels`: rank 0's (this session's `--cpu-kernels`, which a fresh process does not see)."""
    os.environ.update(env)
    shapes: list[tuple[int, int, int]] = []
    instrument(shapes)
    config = EngineConfig.build(
        model, None, find_model=True, **OPTIONS, **DP2, cuda_graph_config=GRAPHS, cpu_kernels=cpu_kernels
    )
    place = launcher_env()
    assert place is not None
    run_worker(config, rank_place(config, place))
    Path(record).write_text(json.dumps(shapes))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gpt_oss")
    make_tiny_model("gpt_oss", path, seed=0)
    make_tiny_tokenizer(path)
    return str(path)


def test_common_shape_is_the_largest_padded_shape_and_idle_ranks_join():
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.sizes, graphs.max_size, graphs.enable_padding, graphs.query_lens = [1, 2, 4, 8], 8, True, [1, 4]

    def sched(counts: list[int], sampled: int | None = None) -> SchedulerOutput:
        ids = [f"r{i}" for i in range(len(counts))]
        n = len(counts) if sampled is None else sampled
        return SchedulerOutput(
            num_scheduled_tokens=dict(zip(ids, counts)), total_num_scheduled_tokens=sum(counts), sampled_req_ids=ids[:n]
        )

    assert graphs.common_shape([sched([1] * 3), sched([1])]) == (4, 1)
    assert graphs.common_shape([sched([]), sched([1] * 5)]) == (8, 1)  # the idle rank joins
    assert graphs.common_shape([sched([4, 4]), sched([4])]) == (2, 4)  # verification steps
    assert graphs.common_shape([sched([1] * 3), sched([7])]) is None  # a prefill on one rank: all eager
    assert graphs.common_shape([sched([1]), sched([4])]) is None  # decode vs verification: all eager
    assert graphs.common_shape([sched([1] * 9), sched([1])]) is None  # past the largest size
    assert graphs.common_shape([sched([]), sched([])]) is None  # nobody runs a token


def test_poisoned_padding_under_attention_dp_is_token_identical(model, tmp_path, monkeypatch):
    with LLM(model, **OPTIONS) as llm:
        single_rank = _generate(llm)
    with LLM(model, **OPTIONS, **DP2) as llm:
        assert llm.engine.executor.runner.graphs is None
        eager_dp = _generate(llm)
    assert eager_dp == single_rank

    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    record = tmp_path / "rank1_shapes.json"
    worker = multiprocessing.get_context("spawn").Process(
        target=rank1,
        args=(
            model,
            {**env, "RANK": "1", "LOCAL_RANK": "1"},
            str(record),
            EngineConfig.model_fields["cpu_kernels"].default,
        ),
    )
    worker.start()
    try:
        for key, value in {**env, "RANK": "0", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        shapes: list[tuple[int, int, int]] = []
        with monkeypatch.context() as patch:
            patch.setattr(DecodeGraphs, "__init__", DecodeGraphs.__init__)  # restored after the run
            patch.setattr(DecodeGraphs, "run", DecodeGraphs.run)
            instrument(shapes)
            with LLM(model, **OPTIONS, **DP2, cuda_graph_config=GRAPHS) as llm:
                graphs = llm.engine.executor.runner.graphs
                assert graphs is not None and graphs.dp_size == 2 and graphs.pad_input_id == POISON_TOKEN
                padded_dp = _generate(llm)
        worker.join(timeout=120)
        assert worker.exitcode == 0
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
    assert padded_dp == single_rank
    rank1_shapes = [tuple(s) for s in json.loads(record.read_text())]
    # One shape per step on both ranks: their MoE collectives matched (a mismatch would hang or garble tokens).
    assert [s[1:] for s in shapes] == [s[1:] for s in rank1_shapes]
    every = shapes + rank1_shapes
    assert any(own == 0 and padded > 0 for own, padded, _ in shapes), "rank 0 never joined with padding only"
    own_size = {n: min(s for s in GRAPHS["batch_sizes"] if s >= n) for n in range(1, 9)}
    assert any(own and padded > own_size[own] for own, padded, _ in every), "no rank padded to the other's size"
    assert len(shapes) >= max(MAX_TOKENS) - 1  # every decode step after the first ran on the static buffers
