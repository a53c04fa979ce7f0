"""KV pool sizing by profiling (brisk/model_runner/memory.py): the arithmetic and the start-up error with injected
measurements, the runner's profiling step on the CPU with a stand-in for torch.cuda's memory counters, and, by
calculation, that default settings fit dummy gpt-oss-120b on one 80 GB H100 with >= 100k tokens of KV."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from brisk import LLM, SamplingParams
from brisk.config import ConfigError, EngineConfig
from brisk.model_config import ModelConfig
from brisk.model_runner.interface import kv_groups_for
from brisk.model_runner.memory import (
    GIB,
    InsufficientKVMemoryError,
    KVGroupLayout,
    MemoryMeasurement,
    available_host_memory,
    blocks_for_one_request,
    measure_profile_run,
    out_of_memory_as,
    plan_kv_cache,
    profile_batch_shape,
)
from brisk.model_runner.sampling_batch import needs_history, samples_plain_greedy
from brisk.model_runner.setup import num_kv_blocks_by_profiling, profile_sampling_params
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(REPO, "..", "shared", "models")
GPT_OSS_GROUPS = (KVGroupLayout("sliding_attention", 18, 32, 128), KVGroupLayout("full_attention", 18, 32))
H100_80GB_BYTES = 81559 << 20  # what nvidia-smi and torch report for an H100 80GB HBM3


def test_plan_is_the_fraction_of_what_is_left():
    m = MemoryMeasurement(total=80 * GIB, weights=60 * GIB, activations=3 * GIB, graphs=GIB // 2, other=GIB // 2)
    plan = plan_kv_cache(
        m,
        fraction=0.9,
        bytes_per_block=1 << 20,
        groups=GPT_OSS_GROUPS,
        max_seq_len=4096,
        max_num_tokens=8192,
    )
    assert m.left == 16 * GIB
    assert plan.kv_bytes == int(16 * GIB * 0.9)
    assert plan.num_blocks == int(16 * GIB * 0.9) // (1 << 20)
    assert plan.tokens == (plan.num_blocks - 1) * 32
    text = plan.describe()
    for figure in ("total 80.00", "weights 60.00", "activations 3.00", "graphs 0.50", "KV cache 14.40"):
        assert figure in text
    assert f"full_attention (18 layers): {plan.tokens:,} tokens" in text


def test_one_request_needs_every_full_block_and_a_window_of_sliding_blocks():
    # full: 4096 / 32 = 128 blocks; sliding: (128 + 512) / 32 + 1 = 21; plus the null block
    assert blocks_for_one_request(GPT_OSS_GROUPS, max_seq_len=4096, max_num_tokens=512) == 128 + 21 + 1
    # a short max_seq_len bounds the sliding group too
    assert blocks_for_one_request(GPT_OSS_GROUPS, max_seq_len=64, max_num_tokens=512) == 2 + 3 + 1
    # FP8 full attention beside bf16 sliding windows (kv_cache_dtype_skip_layers): 64 tokens a full block, half
    # the full blocks
    mixed = (KVGroupLayout("sliding_attention", 18, 32, 128), KVGroupLayout("full_attention", 18, 64))
    assert blocks_for_one_request(mixed, max_seq_len=4096, max_num_tokens=512) == 64 + 21 + 1


@pytest.mark.parametrize(
    "measured",
    [
        MemoryMeasurement(total=80 * GIB, weights=79 * GIB, activations=2 * GIB),  # nothing left at all
        MemoryMeasurement(total=80 * GIB, weights=60 * GIB, activations=19 * GIB),  # 1 GiB left: < one request
    ],
    ids=["weights-exceed", "kv-too-small"],
)
def test_too_little_memory_is_a_start_up_error_naming_the_settings(measured):
    with pytest.raises(InsufficientKVMemoryError) as err:
        plan_kv_cache(
            measured,
            fraction=0.9,
            bytes_per_block=1 << 20,
            groups=GPT_OSS_GROUPS,
            max_seq_len=131072,
            max_num_tokens=8192,
        )
    message = str(err.value)
    assert isinstance(err.value, ConfigError)  # reported like any bad setting, not as a crash
    for setting in ("kv_cache_free_gpu_memory_fraction", "max_seq_len=131072", "max_num_tokens=8192", "tp_size"):
        assert setting in message


def test_profile_batch_spreads_max_num_tokens_over_the_batch():
    assert profile_batch_shape(8192, 256) == [32] * 256
    shape = profile_batch_shape(100, 8)
    assert sum(shape) == 100 and len(shape) == 8 and max(shape) - min(shape) <= 1
    assert profile_batch_shape(3, 256) == [1, 1, 1]


def _bytes_of_gpt_oss(name: str) -> tuple[int, int, ModelConfig]:
    """(exact weight bytes of brisk's model on one GPU, KV bytes per block, config), built on the meta device."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        from memory_per_rank import rank_bytes
    finally:
        sys.path.pop(0)
    from brisk.model_config import ParallelConfig

    mc = ModelConfig.from_pretrained(os.path.join(MODELS, name), "auto", "cuda")
    weights, kv_per_token = rank_bytes(mc, ParallelConfig())
    return weights, kv_per_token, mc


@pytest.mark.skipif(not os.path.isdir(os.path.join(MODELS, "gpt-oss-120b")), reason="needs ../shared/models")
def test_default_settings_fit_gpt_oss_120b_on_one_h100_with_100k_tokens():
    defaults = EngineConfig(model="gpt-oss-120b")
    weights, kv_per_token, mc = _bytes_of_gpt_oss("gpt-oss-120b")
    assert 60 * GIB < weights < 62 * GIB  # MXFP4 experts, bf16 rest: ~61 GiB (ANCHORS.md)
    # An upper bound of the profiling step's activations at the default max_num_tokens, every intermediate counted
    # as live at once in fp32: per token the residual stream and norms (4 x hidden), q/k/v and the attention output
    # (2 x (64 + 2 x 8) x 64), the router logits (128) and, for each of the 4 experts it picks, gate_up (2 x 2880),
    # the activation and down's output (2 x 2880); plus the logits of a full batch (max_batch_size x vocab) and two
    # sampler copies of them. Twice that for the allocator's rounding and fragmentation.
    h, per_expert = mc.hidden_size, 4 * 2880
    per_token = 4 * (4 * h + 2 * (64 + 16) * 64 + 128 + 4 * per_expert)
    logits = defaults.max_batch_size * mc.vocab_size * 4 * 3
    activations = 2 * (defaults.max_num_tokens * per_token + logits)
    assert activations < 8 * GIB
    measured = MemoryMeasurement(
        total=H100_80GB_BYTES,
        weights=weights,
        activations=activations,
        graphs=GIB,  # CUDA graphs of decode batches up to cuda_graph_config.max_batch_size (256): a bound
        other=GIB,  # CUDA context, cuBLAS workspaces
    )
    block_size = defaults.block_size
    groups = [
        KVGroupLayout(
            "sliding_attention" if g.sliding_window else "full_attention",
            len(g.layer_ids),
            block_size,
            g.sliding_window,
        )
        for g in kv_groups_for(mc)
    ]
    plan = plan_kv_cache(
        measured,
        fraction=defaults.memory_fraction,
        bytes_per_block=kv_per_token * block_size,
        groups=groups,
        max_seq_len=mc.max_position_embeddings,  # the default max_seq_len: one 131k request must fit
        max_num_tokens=defaults.max_num_tokens,
    )
    assert plan.tokens >= 100_000, plan.describe()


class FakeCudaMemory:
    """torch.cuda's memory counters as a GPU with `total` bytes would report them around the profiling step."""

    def __init__(self, total: int, weights: int, activations: int, other: int) -> None:
        self.total, self.weights, self.activations, self.other = total, weights, activations, other

    def install(self, monkeypatch) -> None:
        for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.weights)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.weights + self.activations)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: self.weights)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (self.total - self.weights - self.other, self.total))


def test_runner_profiles_one_step_at_max_num_tokens_then_sizes_the_pool(tmp_path, monkeypatch):
    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0)
    make_tiny_tokenizer(path)
    llm = LLM(path, max_num_tokens=96, max_batch_size=8, max_seq_len=256, tokens_per_block=16, dtype="float32")
    runner = llm.engine.executor.runner
    seen: list[int] = []
    forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda ids, *a: (seen.append(len(ids)), forward(ids, *a))[1])
    fake = FakeCudaMemory(total=GIB, weights=100 << 20, activations=50 << 20, other=30 << 20)
    fake.install(monkeypatch)

    num_blocks = num_kv_blocks_by_profiling(runner)

    assert seen == [96]  # one forward pass of max_num_tokens tokens
    left = GIB - (100 << 20) - (50 << 20) - (30 << 20)
    expected = int(left * runner.config.memory_fraction) // runner.kv_layout.bytes_per_block
    window = next(g.sliding_window for g in runner.kv_groups if g.sliding_window)
    # the full-attention group: 8 requests of 256 tokens; the sliding one: 8 windows and a step's 96 new tokens
    most_useful = 1 + (256 // 16) * 8 + -(-(8 * (window - 1) + 96) // 16) + 2 * 8
    assert len(runner.kv_groups) == 2 and most_useful < 1 + 2 * (256 // 16) * 8
    assert num_blocks == min(expected, most_useful)
    assert all(layer.k_cache.numel() == 0 for layer in runner.attn_layers)  # the temporary cache is gone

    fake.activations = GIB  # a step that leaves nothing: the error names the setting
    with pytest.raises(InsufficientKVMemoryError, match="kv_cache_free_gpu_memory_fraction"):
        num_kv_blocks_by_profiling(runner)


def test_gpu_memory_utilization_sizes_the_pool_by_vllms_rule(tmp_path, monkeypatch):
    """vLLM's rule: weights, activations, the CUDA context and the KV cache within u of the whole device, from
    what start-up measures (no estimate from the checkpoint's files, right for dummy weights too)."""
    m = MemoryMeasurement(total=80 * GIB, weights=60 * GIB, activations=3 * GIB, graphs=GIB // 2, other=GIB // 2)
    shape = dict(bytes_per_block=1 << 20, groups=GPT_OSS_GROUPS, max_seq_len=4096, max_num_tokens=8192)
    plan = plan_kv_cache(m, fraction=0.9, utilization=0.9, **shape)
    assert plan.kv_bytes == 72 * GIB - (80 * GIB - m.left)  # 72 GiB less the 64 measured: 8 GiB, not 0.9 of 16
    assert m.weights + m.activations + m.graphs + m.other + plan.kv_bytes == round(0.9 * m.total)
    assert "gpu_memory_utilization 0.9: what is left of 90% of the total" in plan.describe()
    with pytest.raises(InsufficientKVMemoryError, match="Raise gpu_memory_utilization"):
        plan_kv_cache(m, fraction=0.9, utilization=0.79, **shape)  # 63.2 GiB < the 64 measured

    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0)
    make_tiny_tokenizer(path)
    llm = LLM(path, max_num_tokens=96, max_batch_size=8, max_seq_len=256, tokens_per_block=16, dtype="float32")
    runner = llm.engine.executor.runner
    runner.config = runner.config.model_copy(update={"gpu_memory_utilization": 0.5})
    fake = FakeCudaMemory(total=GIB, weights=100 << 20, activations=50 << 20, other=30 << 20)
    fake.install(monkeypatch)
    monkeypatch.setattr(type(runner.kv_layout), "most_useful_blocks", lambda *a: 1 << 30)  # the plan alone decides
    expected = (round(0.5 * GIB) - (100 << 20) - (50 << 20) - (30 << 20)) // runner.kv_layout.bytes_per_block
    assert num_kv_blocks_by_profiling(runner) == expected


def test_the_profiling_step_samples_on_the_costliest_path(tmp_path, monkeypatch):
    """Its sampling temporaries ([rows, vocabulary] sorts, softmaxes, logprobs) are part of the measured peak: it
    samples with temperature, top-k, top-p, min-p, the penalties and the most logprobs a request may ask for."""
    params = profile_sampling_params(20)
    assert not samples_plain_greedy(params) and needs_history(params) and params.logprobs == 20
    assert params.temperature > 0 and params.top_k > 0 and params.top_p < 1 and params.min_p > 0
    params.validate()
    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0)
    make_tiny_tokenizer(path)
    llm = LLM(path, max_num_tokens=64, max_batch_size=8, max_seq_len=128, tokens_per_block=16, dtype="float32")
    runner = llm.engine.executor.runner
    seen: list[SamplingParams] = []
    execute = runner.execute_model
    monkeypatch.setattr(
        runner,
        "execute_model",
        lambda scheds: (seen.extend(r.params for r in scheds[0].new_requests), execute(scheds))[1],
    )
    FakeCudaMemory(total=GIB, weights=100 << 20, activations=50 << 20, other=30 << 20).install(monkeypatch)
    num_kv_blocks_by_profiling(runner)
    assert len(seen) == 8 and all(p == profile_sampling_params(runner.config.max_logprobs) for p in seen)


def test_a_profiling_step_that_runs_out_of_memory_is_a_start_up_error():
    class OutOfMemoryError(RuntimeError):  # what torch.cuda raises, by name
        pass

    def step():
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    fake = FakeCudaMemory(total=80 * GIB, weights=75 * GIB, activations=0, other=0)
    with pytest.MonkeyPatch.context() as patch:
        fake.install(patch)
        with pytest.raises(InsufficientKVMemoryError, match="max_num_tokens") as err:
            measure_profile_run("cuda:0", 75 * GIB, step)
    assert "75.00 of 80.00 GiB" in str(err.value)
    with pytest.raises(ValueError):  # any other error is not turned into advice
        measure_profile_run("cuda:0", 0, lambda: (_ for _ in ()).throw(ValueError("bug")), cuda=_NoopCuda())


class _NoopCuda:
    def __getattr__(self, name):
        return lambda *a, **k: 0


def test_cpu_kv_budget_counts_reclaimable_page_cache(monkeypatch):
    # On a CPU the KV cache takes kv_cache_free_gpu_memory_fraction of MemAvailable: the page cache a just-loaded
    # checkpoint leaves (gpt-oss-20b: 13 GB) is reclaimable, not used. Without /proc/meminfo: the free pages.
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/meminfo") as f:
        listed = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert 0 < available_host_memory() <= physical
    assert abs(available_host_memory() - listed) < physical // 10  # the same figure, give or take what moved since

    def no_meminfo(*args, **kwargs):
        raise OSError("no /proc")

    monkeypatch.setattr("builtins.open", no_meminfo)
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert abs(available_host_memory() - free) < physical // 10


@pytest.mark.parametrize("batch", [1, 4, 64])
@pytest.mark.parametrize("max_num_tokens", [16, 8192])
@pytest.mark.parametrize("max_seq_len", [100, 4096])
def test_most_useful_blocks_holds_a_full_batch_and_counts_sliding_windows_once(batch, max_num_tokens, max_seq_len):
    from brisk.kv_cache.manager import KVGroupSpec
    from brisk.model_runner.kv_tensors import KVTensorLayout

    groups = [KVGroupSpec(tuple(range(12))), KVGroupSpec(tuple(range(12)), 128)]  # gpt-oss-20b's
    layout = KVTensorLayout(groups, 32, 8, 64, torch.bfloat16)
    useful = layout.most_useful_blocks(max_seq_len, batch, max_num_tokens)
    full = -(-max_seq_len // 32) * batch
    sliding = useful - 1 - full
    # never less than one request of max_seq_len needs (the start-up check), nor than the batch's windows
    one = blocks_for_one_request(
        [KVGroupLayout("f", 12, 32), KVGroupLayout("s", 12, 32, 128)], max_seq_len, max_num_tokens
    )
    assert useful >= one and sliding >= batch * min(-(-max_seq_len // 32), 4)
    assert sliding <= full + batch
    if (batch, max_num_tokens, max_seq_len) == (4, 8192, 4096):
        assert (full, sliding) == (512, 280)  # gpt-oss-20b served at batch 4: 232 blocks (0.18 GB) fewer


def test_a_graph_capture_that_runs_out_of_memory_is_a_start_up_error():
    class OutOfMemoryError(RuntimeError):  # what torch.cuda raises, by name
        pass

    with pytest.raises(InsufficientKVMemoryError, match="kv_cache_free_gpu_memory_fraction") as err:
        with out_of_memory_as(lambda: "capturing CUDA graphs ran out: lower kv_cache_free_gpu_memory_fraction"):
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
    assert isinstance(err.value.__cause__, OutOfMemoryError)
    with pytest.raises(KeyError):  # any other error passes unchanged
        with out_of_memory_as(lambda: "advice"):
            raise KeyError("bug")
