"""Multi-rank runtime on CPU (gloo, 2 processes): tensor, expert and attention-data parallelism.

Each layout generates greedily with a KV pool small enough to preempt and prompts that share a prefix
(a second pass hits the prefix cache); the tokens must equal the single-rank run. The weights each rank
holds are checked by name and shape against the slice of the checkpoint it should hold. The same tests
run on NCCL when two GPUs are present (device "auto").
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from brisk import LLM, SamplingParams
from brisk.config import ConfigError, EngineConfig
from brisk.model_config import ModelConfig, ParallelConfig
from brisk.model_runner.loader import load_model
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

MAX_NEW = 10
DEVICE = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
# gpt-oss: 4 experts, 4 heads / 2 KV heads, intermediate 64 (MXFP4: 32 per MoE-TP rank, one block).
LAYOUTS = {
    "llama-tp2": ("llama", dict(tp_size=2)),
    "llama-attention_dp2": ("llama", dict(tp_size=2, enable_attention_dp=True)),
    "gpt_oss-tp2": ("gpt_oss", dict(tp_size=2)),
    "gpt_oss-tp2-ep2": ("gpt_oss", dict(tp_size=2, ep_size=2)),
    "gpt_oss-attention_dp2-ep2": ("gpt_oss", dict(tp_size=2, ep_size=2, enable_attention_dp=True)),
    "gpt_oss-attention_dp2-moe_tp2": ("gpt_oss", dict(tp_size=2, enable_attention_dp=True)),
    "gpt_oss_mxfp4-tp2": ("gpt_oss_mxfp4", dict(tp_size=2)),
    # Overlap scheduling and padded decode steps: every rank keeps its batch from the same SchedulerOutputs and
    # takes the sampled tokens on its side (TP: rank 0's broadcast; attention DP: each rank samples its own rows).
    "gpt_oss-tp2-overlap-padded": (
        "gpt_oss",
        dict(tp_size=2, disable_overlap_scheduler=False, cuda_graph_config={"batch_sizes": [1, 2, 4, 8]}),
    ),
    "gpt_oss-attention_dp2-ep2-overlap-padded": (
        "gpt_oss",
        dict(
            tp_size=2,
            ep_size=2,
            enable_attention_dp=True,
            disable_overlap_scheduler=False,
            cuda_graph_config={"batch_sizes": [1, 2, 4, 8]},
        ),
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for arch in ("llama", "gpt_oss", "gpt_oss_mxfp4"):
        path = tmp_path_factory.mktemp(arch)
        make_tiny_model(arch.removesuffix("_mxfp4"), path, seed=0, mxfp4=arch.endswith("_mxfp4"))
        make_tiny_tokenizer(path)
        paths[arch] = str(path)
    return paths


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(1, 512) for _ in range(12)]
    return [prefix + [rng.randrange(1, 512) for _ in range(n)] for n in (3, 9, 14, 20, 5, 27)]


# Small pools: 6 prompts of up to 39 + 10 tokens in 4-token blocks cannot all run at once (preemption).
# Under attention DP each rank has its own pool and half the requests, so its pool is smaller still.
ENGINE_OPTIONS = dict(device=DEVICE, dtype="float32", tokens_per_block=4)
MAX_BLOCKS, MAX_BLOCKS_PER_DP_RANK = 40, 28


def _generate_twice(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # prefix-cache hits
    assert first == second
    return first


@pytest.fixture(scope="module")
def single_rank_tokens(models) -> dict[str, list[list[int]]]:
    tokens = {}
    for arch, path in models.items():
        with LLM(path, **ENGINE_OPTIONS, kv_cache_config={"max_blocks": MAX_BLOCKS}) as llm:
            tokens[arch] = _generate_twice(llm)
    return tokens


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_tokens_match_single_rank(layout, models, single_rank_tokens):
    arch, options = LAYOUTS[layout]
    max_blocks = MAX_BLOCKS_PER_DP_RANK if options.get("enable_attention_dp") else MAX_BLOCKS
    with LLM(models[arch], **ENGINE_OPTIONS, **options, kv_cache_config={"max_blocks": max_blocks}) as llm:
        engine = llm.engine
        parallel = engine.executor.runner.parallel
        assert parallel.world_size == 2
        assert parallel.dp_size == (2 if options.get("enable_attention_dp") else 1)
        tokens = _generate_twice(llm)
        stats = engine.stats()
        assert stats.num_preemptions > 0, "the pool was meant to be too small for the whole batch"
        assert stats.prefix_hits > 0
        assert len(stats.kv_usage_per_dp_rank) == parallel.dp_size  # /metrics' per-rank KV usage
        if parallel.dp_size == 2:  # both ranks served requests, each from its own pool
            assert all(kv.prefix_queries > 0 for kv in engine.kv_managers)
        for kv in engine.kv_managers:
            kv.check_invariants()
            assert kv.pool.num_used == 0
    assert tokens == single_rank_tokens[arch]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_attention_dp_reports_every_ranks_logprobs(models, monkeypatch, overlap):
    """Each attention-DP rank samples its own rows; rank 0 gathers their logprobs, off the step (on its own thread):
    a step never waits for its own kernels to read them, so overlap scheduling holds."""
    from brisk.host import HostResult
    from brisk.model_runner.step_output import packed_rows

    read_in = []
    get = HostResult.get

    def spy(self):
        if self._build is not packed_rows:  # a step's logprobs (the tokens are read in the main thread, as ever)
            read_in.append(threading.current_thread() is threading.main_thread())
        return get(self)

    monkeypatch.setattr(HostResult, "get", spy)  # rank 0's, in this process
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    results = []
    for options in ({}, dict(tp_size=2, enable_attention_dp=True, disable_overlap_scheduler=not overlap)):
        read_in.clear()  # the single rank reads its own when its result is read: only the DP run is watched
        with LLM(models["llama"], **ENGINE_OPTIONS, **options) as llm:
            outs = llm.generate(prompts, params)
            results.append([(c.token_ids, c.logprobs) for o in outs for c in o.outputs])
    assert read_in and not any(read_in)  # every gather read them on the gathering thread
    for (ids, lps), (ref_ids, ref_lps) in zip(results[1], results[0]):
        assert ids == ref_ids and len(lps) == len(ref_lps) == 4
        for lp, ref in zip(lps, ref_lps):
            assert lp.keys() == ref.keys()
            assert all(abs(lp[t] - ref[t]) < 1e-4 for t in ref)


def test_the_extras_gather_thread_works_on_its_ranks_gpu(monkeypatch):
    """CUDA's current device is per thread, GPU 0 on a new one: the gather thread sets its rank's device before its
    first CUDA call (the wait for a copy's event), else each rank of another GPU would open a context on GPU 0."""
    from brisk.model_runner import step_output

    calls = []
    monkeypatch.setattr(step_output.dist, "new_group", lambda **kwargs: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))

    def gather(obj, gathered, dst, group):
        calls.append(("gather", threading.current_thread().name))

    monkeypatch.setattr(step_output.dist, "gather_object", gather)
    gatherer = step_output.ExtrasGather(ParallelConfig(tp_size=1, dp_size=2, dp_rank=1), torch.device("cuda", 1))
    gatherer.submit(step_output.RankExtras(None, None, None)).result()
    gatherer.close()
    assert calls[0] == ("set_device", torch.device("cuda", 1))
    assert calls[1][0] == "gather" and calls[1][1].startswith("brisk-extras-gather")


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_attention_dp_penalties_see_every_ranks_history(models, overlap):
    """Penalties and min_tokens read a request's past outputs, which each attention-DP rank keeps for its own rows
    (no result() is read on ranks > 0): the same tokens as one rank, with and without overlap scheduling."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, repetition_penalty=1.5, frequency_penalty=0.7, min_tokens=6, ignore_eos=True
    )
    results = []
    for options in ({}, dict(tp_size=2, enable_attention_dp=True, disable_overlap_scheduler=not overlap)):
        with LLM(models["llama"], **ENGINE_OPTIONS, **options) as llm:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(models["llama"], **ENGINE_OPTIONS) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, plain)] != results[0]  # the penalties act
    assert results[1] == results[0]


def test_seed_sets_every_attention_dp_ranks_draws(models):
    """--seed is what requests without a seed of their own draw from, on every attention-DP rank: a run repeats
    with the same seed, every request's sample changes with another (requests go to both ranks)."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:4]]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outputs = []
    for seed in (1, 1, 2):
        with LLM(models["llama"], **ENGINE_OPTIONS, tp_size=2, enable_attention_dp=True, seed=seed) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
            assert all(kv.prefix_queries > 0 for kv in llm.engine.kv_managers)  # both ranks served requests
    assert outputs[0] == outputs[1]
    assert all(a != b for a, b in zip(outputs[0], outputs[2])), outputs


# ---------------------------------------------------------------- what each rank holds


def _expected_slice(name: str, full: dict[str, torch.Tensor], p: ParallelConfig, mc: ModelConfig) -> torch.Tensor:
    """The part of the checkpoint rank p must hold under `name`, derived from the layout rules alone."""
    tp, r = p.tp_size, p.tp_rank

    def rows(t, n, i):  # i-th of n equal row blocks
        return t.chunk(n, dim=0)[i]

    if ".qkv_proj." in name:
        q, k, v = (full[name.replace("qkv_proj", proj)] for proj in ("q_proj", "k_proj", "v_proj"))
        kv_rank = r * mc.num_kv_heads // tp if tp > mc.num_kv_heads else r
        kv_parts = max(1, min(tp, mc.num_kv_heads))
        return torch.cat([rows(q, tp, r), rows(k, kv_parts, kv_rank), rows(v, kv_parts, kv_rank)])
    if ".gate_up_proj." in name and ".experts." not in name:
        gate, up = (full[name.replace("gate_up_proj", proj)] for proj in ("gate_proj", "up_proj"))
        return torch.cat([rows(gate, tp, r), rows(up, tp, r)])
    if name.endswith(("o_proj.weight", "mlp.down_proj.weight")):
        return full[name].chunk(tp, dim=1)[r]
    if name.endswith(("embed_tokens.weight", "lm_head.weight", ".sinks")):
        return rows(full[name], tp, r)
    if ".experts." in name:
        t = full[name]
        t = t.chunk(p.ep_size, dim=0)[p.ep_rank]
        if name.endswith("_bias") and "down" in name:
            return t
        if name.endswith(("gate_up_proj", "down_proj")):  # HF [E, in, out] -> brisk [E, out, in]
            t = t.transpose(1, 2)
        dim = 1 if "gate_up" in name else 2
        return t.chunk(p.moe_tp_size, dim=dim)[p.moe_tp_rank]
    return full[name]  # norms, router, o_proj bias (added once), replicated layers


@pytest.mark.parametrize(
    "arch,options",
    [
        ("llama", dict()),
        ("gpt_oss", dict()),
        ("gpt_oss", dict(ep_size=2)),
        ("gpt_oss_mxfp4", dict()),
        ("gpt_oss", dict(ep_size=2, enable_attention_dp=True)),
        ("llama", dict(enable_attention_dp=True)),
    ],
)
def test_each_rank_holds_its_slice_of_every_weight(arch, options, models):
    path = models[arch]
    mc = ModelConfig.from_pretrained(path, "float32")
    full = load_file(str(Path(path) / "model.safetensors"))
    if mc.hf_config.tie_word_embeddings:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    names_per_rank = []
    for rank in range(2):
        p = ParallelConfig.for_rank(rank, 2, options.get("ep_size", 1), options.get("enable_attention_dp", False))
        model = load_model(mc, device="cpu", parallel=p)
        params = dict(model.named_parameters(remove_duplicate=False))
        names_per_rank.append(set(params))
        for name, param in params.items():
            expected = _expected_slice(name, full, p, mc)
            assert param.shape == expected.shape, f"rank {rank} {name}: {tuple(param.shape)} != {tuple(expected.shape)}"
            assert torch.equal(param.data, expected.to(param.dtype)), f"rank {rank} {name}: wrong values"
    assert names_per_rank[0] == names_per_rank[1]


# ---------------------------------------------------------------- layouts refused with a reason


def test_layouts_are_validated(models):
    with pytest.raises(ConfigError, match="ep_size .3. must divide tp_size .4."):
        EngineConfig.build("m", tp_size=4, ep_size=3)
    mc = ModelConfig.from_pretrained(models["gpt_oss"], "float32")
    with pytest.raises(ValueError, match="num_local_experts .4. is not divisible by ep_size .8."):
        load_model(
            mc, device="meta", load_format="dummy", parallel=ParallelConfig.for_rank(0, 8, ep_size=8, attention_dp=True)
        )
    with pytest.raises(ValueError, match="num_heads .4. is not divisible by tp_size .8."):
        load_model(mc, device="meta", load_format="dummy", parallel=ParallelConfig.for_rank(0, 8))


def test_launcher_variables(monkeypatch):
    from brisk.distributed.launch import launcher_env, rank_place

    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.delenv(var, raising=False)
    assert launcher_env() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert launcher_env() == {"RANK": 3, "WORLD_SIZE": 4, "LOCAL_RANK": 1}
    config = EngineConfig.build("m", tp_size=4)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        rank_place(config, launcher_env())
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    place = rank_place(config, launcher_env())
    assert (place.rank, place.world_size, place.local_rank, place.init_method) == (3, 4, 1, "tcp://10.0.0.1:29500")
    with pytest.raises(ConfigError, match="WORLD_SIZE=4 ranks but tp_size is 2"):
        rank_place(EngineConfig.build("m", tp_size=2), launcher_env())


@pytest.mark.parametrize("layout", ["gpt_oss-tp2", "gpt_oss-attention_dp2-ep2-overlap-padded"])
def test_host_kv_tier_greedy_tokens_match_single_rank(layout, models, single_rank_tokens):
    """The host KV tier under TP (every rank copies its KV heads' share of the blocks the one scheduler moves) and
    under attention DP with overlap and padded steps (each rank's scheduler has a tier of its own): prefixes the
    small device pool evicted in the first pass come back from host memory in the second, and the tokens are the
    single-rank ones without a tier."""
    arch, options = LAYOUTS[layout]
    max_blocks = MAX_BLOCKS_PER_DP_RANK if options.get("enable_attention_dp") else MAX_BLOCKS
    kv_config = {"max_blocks": max_blocks, "host_cache_size": 1 << 22}
    with LLM(models[arch], **ENGINE_OPTIONS, **options, kv_cache_config=kv_config) as llm:
        tokens = _generate_twice(llm)
        stats = llm.engine.stats()
        assert stats.host_hits > 0 and stats.host_bytes_to_host > 0 and stats.host_bytes_to_device > 0
        for kv in llm.engine.kv_managers:
            kv.check_invariants()
            assert kv.pool.num_used == 0
    assert tokens == single_rank_tokens[arch]


@pytest.mark.parametrize("layout", ["gpt_oss-tp2", "gpt_oss-attention_dp2-ep2-overlap-padded"])
def test_fp8_kv_greedy_tokens_match_single_rank(layout, models):
    """An FP8 KV cache (each rank its KV heads' share, static scales) under TP and under attention DP with padded
    static-buffer steps: the single-rank FP8-KV tokens, preemption and prefix hits included."""
    arch, options = LAYOUTS[layout]
    with LLM(models[arch], **ENGINE_OPTIONS, kv_cache_dtype="fp8", kv_cache_config={"max_blocks": MAX_BLOCKS}) as llm:
        single = _generate_twice(llm)
    max_blocks = MAX_BLOCKS_PER_DP_RANK if options.get("enable_attention_dp") else MAX_BLOCKS
    with LLM(
        models[arch], **ENGINE_OPTIONS, **options, kv_cache_dtype="fp8", kv_cache_config={"max_blocks": max_blocks}
    ) as llm:
        tokens = _generate_twice(llm)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_hits > 0
        assert llm.engine.executor.runner.kv_cache_spec.kv_dtypes[0] == torch.float8_e4m3fn
        for kv in llm.engine.kv_managers:
            kv.check_invariants()
            assert kv.pool.num_used == 0
    assert tokens == single
