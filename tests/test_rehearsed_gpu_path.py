"""The engine's GPU path rehearsed on the CPU: the Triton attention and MoE backends bound to the model (no CPU
kernels), Triton kernels in the interpreter, and decode / verification steps replayed from "captured" calls.

A GPU run of brisk must not find its first bug in the glue between the kernels and the runner: the kernels are
checked one by one (test_triton_attention.py, test_triton_moe.py, test_kv_fp8.py), and this checks the whole step
path a GPU takes, end to end against the CPU reference engine:

- greedy tokens identical to the reference with MXFP4 experts, FP8 KV, n-gram and EAGLE3 speculation (verification
  steps on the static buffers), overlap scheduling, chunked prefill (a chunk reads the earlier ones' KV as a prefix hit does), preemption and
  the host KV tier;
- what a CUDA graph does, emulated: each static shape's call is made once with the metadata `capture_all` builds
  (the attention plans come from the shape alone) and that same call is what every "replay" runs, so a plan that
  depended on the step it was captured at would give wrong tokens here;
- nothing in the captured forward synchronises with the host (`.item()`, `.tolist()`, `bool(tensor)`, `nonzero`,
  host data to the device...), which on a GPU fails the capture ("operation not permitted when stream is
  capturing") or freezes a value into the graph. A TorchFunctionMode sees every such call made from brisk's code;
  that it sees the torch backends' (`graph_safe = False`) is checked too.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import brisk
from brisk import LLM, SamplingParams
from brisk.host import HostCopy, HostResult
from brisk.kernels.triton_norm import rms_norm as triton_rms_norm
from brisk.layers.attention import TorchAttentionBackend
from brisk.layers.attention_triton import TritonAttentionBackend
from brisk.layers.moe import TorchMoEBackend
from brisk.layers.moe_triton import TritonMoEBackend
from brisk.model_runner import setup
from brisk.model_runner.binding import Kernels
from brisk.model_runner.cuda_graph import DecodeGraphs, aux_hidden_states
from brisk.model_runner.step_output import host_rows, packed_rows
from brisk.models.registry import BriskModel
from tests.test_spec_graphs import record_static_steps
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rehearsal; test_gpu_e2e.py runs the GPU")

K = 3
BRISK_DIR = str(Path(brisk.__file__).parent)
TORCH_DIR = str(Path(torch.__file__).parent)
GRAPHS = {"batch_sizes": [1, 2, 4, 8], "enable_padding": True}
OPTIONS = dict(
    seed=0, dtype="float32", tokens_per_block=16, max_num_tokens=64, max_seq_len=64, check_kv_invariants=True
)
NGRAM = {"decoding_type": "NGram", "max_draft_len": K, "max_matching_ngram_size": 2}
# Calls that make the host wait for the device (or copy host data to it): none may run inside a captured graph.
HOST_SYNCS = {
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero", "argwhere",
    "masked_select", "unique", "unique_consecutive", "bincount", "tensor", "as_tensor", "from_numpy",
}  # fmt: skip


@dataclass
class HostSyncs:
    """Where brisk's code made a host-synchronising call: (call, file, line) of every one seen."""

    seen: list[tuple[str, str, int]] = field(default_factory=list)

    def guard(self) -> TorchFunctionMode:
        return _HostSyncGuard(self.seen)


class _HostSyncGuard(TorchFunctionMode):
    def __init__(self, seen: list[tuple[str, str, int]]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        boolean_index = name in ("__getitem__", "__setitem__") and _has_bool_tensor(args[1:2])
        # CUDA checks an accumulating index_put's index range on the host (.item() of the indices' max and min)
        accumulate = name in ("index_put_", "index_put") and ((kwargs or {}).get("accumulate") or args[3:4] == (True,))
        interleave = name == "repeat_interleave" and "output_size" not in (kwargs or {})
        if name in HOST_SYNCS or boolean_index or accumulate or interleave:
            frame: FrameType | None = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
                frame = frame.f_back
            # Only brisk's own calls: Triton's interpreter copies tensors to the host to run kernels on the CPU.
            if frame is not None and frame.f_code.co_filename.startswith(BRISK_DIR):
                self.seen.append((name, frame.f_code.co_filename, frame.f_lineno))
        return func(*args, **(kwargs or {}))


def _has_bool_tensor(index) -> bool:
    items = index[0] if index and isinstance(index[0], tuple) else index
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def watched(model: Callable[..., torch.Tensor], syncs: HostSyncs) -> Callable[..., torch.Tensor]:
    """`model`, its host syncs noted in `syncs`."""

    def call(*args) -> torch.Tensor:
        with syncs.guard():
            return model(*args)

    return call


@dataclass
class ReplayedCall:
    """Stands in for a captured CUDA graph: the call the capture made (the same static buffers, metadata and
    attention plans), made again at every replay, watched for host syncs."""

    model: BriskModel
    args: tuple
    syncs: HostSyncs

    def replay(self) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        return watched(self.model, self.syncs)(*self.args), aux_hidden_states(self.model)


def capture_on_cpu(graphs: DecodeGraphs, syncs: HostSyncs) -> None:
    """What `capture_all` does on a GPU, with calls for graphs: per shape the warm-up call, then the capture call
    (watched), whose arguments every replay reuses."""
    model = graphs.target.model
    for size, t in graphs.graph_shapes():
        args = graphs.capture_args(size, t)
        model(*args)  # warm-up: builds the attention plans, outside the capture as on a GPU
        watched(model, syncs)(*args)  # the capture
        graphs.captured[size, t] = ReplayedCall(model, args, syncs)
    graphs.capture = True


def _prompts() -> list[dict]:
    """Five prompts (a batch padded to 8), two of them copy-heavy (prompt lookup drafts their continuation)."""
    rng = random.Random(11)
    prompts = []
    for n in (6, 11):
        passage = [rng.randrange(1, 512) for _ in range(n)]
        prompts.append(passage + passage[: n // 2] + passage[:3])
    prompts += [[rng.randrange(1, 512) for _ in range(n)] for n in (3, 9, 20)]
    return [{"prompt_token_ids": p} for p in prompts]


def _eagle3_head(target_path: str, root: Path) -> dict:
    from brisk.model_config import ModelConfig
    from tests.test_eagle3_model import head_config, head_weights, write_head

    target = ModelConfig.from_pretrained(target_path, dtype="float32")
    aux = [1, target.num_layers // 2, target.num_layers - 1]
    config = head_config(target, eagle_config={"eagle_aux_hidden_state_layer_ids": aux})
    head = write_head(root / "head", config, head_weights(target, seed=5))
    return {"method": "eagle3", "num_speculative_tokens": K, "model": head}


def _generate_on_the_gpu_path(path: str, kernels: Kernels, monkeypatch, capture: bool = True, **options):
    """Greedy outputs of `_prompts()` with `kernels` bound and the static steps replayed from emulated captures
    (capture=False: run on the static buffers, watched, as a GPU runs backends it cannot capture); also (requests,
    padded requests, tokens per request) of every static step, the host syncs seen and the engine's stats."""
    syncs = HostSyncs()
    with monkeypatch.context() as patch:
        patch.setattr(setup, "make_kernels", lambda config, device: kernels)
        llm = LLM(path, **{**OPTIONS, **options}, cuda_graph_config=GRAPHS)
    with llm:
        runner = llm.engine.executor.runner
        assert runner.kernels is kernels and runner.graphs is not None
        if capture:
            capture_on_cpu(runner.graphs, syncs)
        else:
            target = runner.graphs.target
            runner.graphs.target = replace(target, model=watched(target.model, syncs))
        shapes = record_static_steps(runner.graphs)
        tokens = _greedy_tokens(llm)
        assert llm.engine.kv.pool.num_used == 0
        stats = llm.engine.stats()
    return tokens, shapes, syncs.seen, stats


def _greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params)]


def _reference(path: str, **options) -> list[list[int]]:
    with LLM(path, **{**OPTIONS, **options}) as llm:
        return _greedy_tokens(llm)


def _triton_kernels(split_k: bool = True) -> Kernels:
    """The GPU's backends. split_k: decode in partitions of 16 keys, so the replays' split-K is sized by the
    captured bound (max_seq_len) as on a GPU with long contexts (else the fp32 tiles, one partition here)."""
    attention = (
        TritonAttentionBackend(decode_block_n=16, decode_partition_size=16) if split_k else TritonAttentionBackend()
    )
    return Kernels(attention, TritonMoEBackend(), None, triton_rms_norm)  # the norm a GPU binds too


CASES: dict[str, tuple[str, bool, bool, dict[str, Any]]] = {  # (architecture, MXFP4 experts, split-K decode, options)
    "gpt_oss-mxfp4-overlap": ("gpt_oss", True, False, dict(disable_overlap_scheduler=False)),
    "gpt_oss-fp8-kv": ("gpt_oss", False, True, dict(kv_cache_config={"dtype": "fp8"})),
    "gpt_oss-ngram": ("gpt_oss", False, True, dict(speculative_config=NGRAM)),
    "llama-ngram": ("llama", False, True, dict(speculative_config=NGRAM)),
    "gpt_oss-eagle3": ("gpt_oss", False, True, dict(speculative_config="eagle3")),
    # Prompts chunked (32 tokens a step), a pool too small for the batch: preemption, the host KV tier keeping
    # evicted blocks.
    "gpt_oss-chunks-preemption": (
        "gpt_oss",
        True,
        True,
        dict(max_num_tokens=32, kv_cache_config={"max_blocks": 10, "host_cache_size": 2**20}),
    ),
    # FP8 full attention in blocks of 4x the tokens (64) beside fp32 sliding windows (16), the same bytes a block:
    # the Triton kernels read each group's block size off its cache; chunks, preemption and the host tier on both.
    "gpt_oss-fp8-skip-sliding-preemption": (
        "gpt_oss",
        True,
        True,
        dict(
            max_num_tokens=32,
            kv_cache_config={
                "dtype": "fp8",
                "dtype_skip_layers": ["sliding_window"],
                "max_blocks": 10,
                "host_cache_size": 2**20,
            },
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_gpu_step_path_generates_what_the_cpu_reference_does(case, tmp_path, monkeypatch):
    arch, mxfp4, split_k, options = CASES[case]
    path = make_tiny_model(arch, tmp_path / "m", seed=0, mxfp4=mxfp4)
    make_tiny_tokenizer(path)
    if options.get("speculative_config") == "eagle3":
        options = {**options, "speculative_config": _eagle3_head(path, tmp_path)}
    # The reference: the CPU engine's own kernels and the case's KV dtype; no speculation (speculation keeps greedy
    # output exact), a pool for everything, no chunks.
    kv_dtypes = {k: v for k, v in options.get("kv_cache_config", {}).items() if k in ("dtype", "dtype_skip_layers")}
    reference = _reference(path, **({"kv_cache_config": kv_dtypes} if kv_dtypes else {}))
    kernels = _triton_kernels(split_k)
    assert kernels.graph_safe  # a GPU captures these
    tokens, shapes, syncs, stats = _generate_on_the_gpu_path(path, kernels, monkeypatch, **options)
    assert tokens == reference
    if "max_blocks" in options.get("kv_cache_config", {}):
        assert stats.num_preemptions > 0 and stats.host_bytes_to_host > 0
    assert not syncs, f"host syncs in the captured forward: {sorted(set(syncs))}"
    assert any(padded > b and t == 1 for b, padded, t in shapes), "no padded decode step was replayed"
    if "speculative_config" in options:
        assert any(t == K + 1 for _, _, t in shapes), "no verification step was replayed"


def _watched_sampling(tmp_path: Path, monkeypatch, syncs: HostSyncs, **options) -> LLM:
    """An engine over a tiny gpt-oss with the GPU's backends bound, whose sampling stage is watched for host syncs."""
    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0)
    make_tiny_tokenizer(path)
    with monkeypatch.context() as patch:
        patch.setattr(setup, "make_kernels", lambda config, device: _triton_kernels())
        llm = LLM(path, **OPTIONS, **options)
    sampling = llm.engine.executor.runner.sampling
    pick = sampling.pick
    monkeypatch.setattr(sampling, "pick", lambda *args: watched(pick, syncs)(*args))
    return llm


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, logit_bias={5: 2.0, 9: -3.0}),
        dict(temperature=0.0, logit_bias={7: 1.5}, logprobs=2),
        dict(temperature=0.7, logprobs=3, seed=4),
        dict(temperature=0.5, logprob_token_ids=[4, 8, 1]),
        dict(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=3),
        dict(temperature=0.9, allowed_token_ids=[3, 5, 9, 12], min_tokens=2),
    ],
    ids=[
        "truncation-logit-bias",
        "greedy-bias-logprobs",
        "seeded-logprobs",
        "chosen-logprob-ids",
        "penalties",
        "allowed-min-tokens",
    ],
)
def test_sampling_under_overlap_never_waits_for_the_device(tmp_path, monkeypatch, params):
    """A step's sampling runs right behind its forward on a GPU, before the previous step's result is read
    (overlap scheduling): a host sync there would make the host wait for the forward. With the GPU's backends bound
    (no C kernels), sampling with temperature, top-k / top-p / min-p, logit_bias, logprobs, a seed, penalties,
    min_tokens, allowed_token_ids and logprob_token_ids makes none; its results reach the host through the step's
    one copy (HostCopy). Penalties count the previous step's token where it is, on the device."""
    syncs = HostSyncs()
    with _watched_sampling(tmp_path, monkeypatch, syncs, disable_overlap_scheduler=False) as llm:
        outputs = llm.generate(_prompts(), SamplingParams(max_tokens=6, ignore_eos=True, **params))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    if params.get("logprobs") or params.get("logprob_token_ids"):
        assert all(len(o.outputs[0].logprobs) == 6 for o in outputs)
    if params.get("allowed_token_ids"):
        assert all(set(o.outputs[0].token_ids) <= set(params["allowed_token_ids"]) for o in outputs)
    assert not syncs.seen, f"host syncs in sampling: {sorted(set(syncs.seen))}"


def test_the_checks_see_what_the_backends_a_gpu_does_not_capture_do(tmp_path, monkeypatch):
    """The torch backends (`graph_safe = False`: a GPU runs their static steps uncaptured) sync with the host, the
    MoE sizing its work with `.tolist()`, and plan attention from the step's host lists: the guard sees the former
    and replays of their captures give wrong tokens, so both checks' silence on the Triton backends means
    something."""
    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0)
    make_tiny_tokenizer(path)
    reference = _reference(path)
    kernels = Kernels(TorchAttentionBackend(), TorchMoEBackend(), None)
    assert not kernels.graph_safe
    tokens, shapes, syncs, _ = _generate_on_the_gpu_path(path, kernels, monkeypatch, capture=False)
    assert tokens == reference and shapes
    assert any(name == "tolist" and file.endswith("moe.py") for name, file, _ in syncs)
    replayed, _, _, _ = _generate_on_the_gpu_path(path, kernels, monkeypatch)
    assert replayed != reference


class _CopyInFlight:
    """Stands in for the CUDA event behind a step's copy to the host: the copy lands in the buffer when the host
    waits for it (`synchronize`), as a pinned buffer's rows are only valid after the event."""

    def __init__(self, buffer: torch.Tensor, rows: torch.Tensor) -> None:
        self.buffer, self.rows, self.waits = buffer, rows, 0

    def synchronize(self) -> None:
        self.waits += 1
        self.buffer.copy_(self.rows)


def test_a_steps_host_rows_wait_for_its_own_copy_once():
    """Overlap scheduling on a GPU: each step's packed rows go to a host buffer of their own behind an event, and
    reading them waits for that event (this step's copy), once; a later step's copy never touches them."""
    step_n, step_n1 = torch.tensor([[5, 0], [7, 1]]), torch.tensor([[9, 0]])
    buffers = [torch.full_like(step_n, -1), torch.full_like(step_n1, -1)]
    events = [_CopyInFlight(buffers[0], step_n), _CopyInFlight(buffers[1], step_n1)]
    # N+1 launched before N is read
    rows_n = HostResult(HostCopy((buffers[0],), events[0]), packed_rows)
    rows_n1 = HostResult(HostCopy((buffers[1],), events[1]), packed_rows)
    assert rows_n.get() == [[5, 0], [7, 1]] and events[0].waits == 1 and events[1].waits == 0
    assert rows_n.get() == [[5, 0], [7, 1]] and events[0].waits == 1  # read once
    assert rows_n1.get() == [[9, 0]] and events[1].waits == 1


def test_host_rows_on_the_cpu_are_the_packed_tensor_read_when_asked():
    packed = torch.tensor([[3, 0], [4, 0]])
    rows = host_rows(packed)  # no pinned buffer, no event: pinning needs CUDA
    packed[1, 0] = 6
    assert rows.get() == [[3, 0], [6, 0]]
    assert host_rows(None).get() == []


def test_greedy_verification_rows_built_on_the_host_are_read_there(tmp_path, monkeypatch):
    """Greedy verification builds its packed rows on the host (after its argmax's one sync): the step reads those,
    with no copy of the uploaded tensor back to the host (on a GPU: an upload, a download and a second wait)."""
    import numpy as np

    from brisk.model_runner import runner as runner_module

    on_host = np.array([[4, 5, 2, 0]])
    rows = host_rows(torch.tensor([[-1, -1, -1, -1]]), on_host)
    assert rows.get() == [[4, 5, 2, 0]]
    started: list[bool] = []
    read = runner_module.host_rows
    monkeypatch.setattr(runner_module, "host_rows", lambda p, h=None: (started.append(h is not None), read(p, h))[1])
    path = make_tiny_model("llama", tmp_path / "m", seed=0)
    make_tiny_tokenizer(path)
    with LLM(path, **OPTIONS, speculative_config=NGRAM) as llm:
        tokens = _greedy_tokens(llm)
    assert any(started) and tokens == _reference(path)  # verification steps read their host-built rows


@pytest.mark.parametrize("options", [{}, dict(speculative_config=NGRAM)], ids=["plain", "ngram"])
def test_the_warm_up_runs_the_eager_variants_and_leaves_nothing_behind(tmp_path, monkeypatch, options):
    """A GPU's start-up warm-up (setup.warm_up_eager_steps): a prompt of each MoE tile tier's largest batch below
    max_num_tokens (the tiny model: 4 experts, top 2: tiers up to 16, 48, 192 tokens), then a mixed step whose decode
    runs through the decode kernel eagerly. Afterwards the runner holds no request and generates what the CPU
    reference does."""
    import brisk.layers.attention_triton as attention_triton
    import brisk.layers.moe_triton as moe_triton

    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0, mxfp4=True)
    make_tiny_tokenizer(path)
    reference = _reference(path)
    kernels = _triton_kernels(split_k=False)
    with monkeypatch.context() as patch:
        patch.setattr(setup, "make_kernels", lambda config, device: kernels)
        llm = LLM(path, **OPTIONS, **options, cuda_graph_config=GRAPHS)
    with llm:
        runner = llm.engine.executor.runner
        moe_batches: list[int] = []
        decodes: list[int] = []
        fused, decode = moe_triton.fused_experts, attention_triton.paged_decode_attention
        with monkeypatch.context() as patch:
            patch.setattr(
                moe_triton, "fused_experts", lambda h, *a, **k: (moe_batches.append(len(h)), fused(h, *a, **k))[1]
            )
            patch.setattr(
                attention_triton,
                "paged_decode_attention",
                lambda q, *a, **k: (decodes.append(len(q)), decode(q, *a, **k))[1],
            )
            setup.warm_up_eager_steps(runner)
        assert sorted(set(moe_batches)) == [2, 3, 16, 48]  # the decode's first prompt, the mixed step, the tiers
        assert decodes and runner.batch.num_rows == 0 and not runner.states
        assert _greedy_tokens(llm) == reference
        assert llm.engine.kv.pool.num_used == 0


@pytest.mark.parametrize("seed", [None, 4], ids=["unseeded", "seeded"])
def test_sampled_verification_never_waits_for_the_device(tmp_path, monkeypatch, seed):
    """Rejection sampling of n-gram drafts (sampled rows beside a greedy one, drafts of sampled rows rejected and the
    residual drawn there, the bonus token after all accepted) makes no host sync in the sampling stage: its result
    reaches the host through the step's one copy."""
    from brisk.model_runner import rejection_sampler

    syncs = HostSyncs()
    sampled_rejections = []  # per residual draw: whether a sampled row's draft was rejected (read by the test)
    resample = rejection_sampler._resample

    def spy(final, probs, final_rows, num_accepted, num_drafts, token_ids, draft_probs, batch, generators):
        out = resample(final, probs, final_rows, num_accepted, num_drafts, token_ids, draft_probs, batch, generators)
        sampled = ~rejection_sampler._greedy_rows(batch, probs.device)[final_rows]
        sampled_rejections.append(bool(((num_accepted < torch.from_numpy(num_drafts)) & sampled).any()))
        return out

    with _watched_sampling(tmp_path, monkeypatch, syncs, speculative_config=NGRAM) as llm:
        monkeypatch.setattr(rejection_sampler, "_resample", spy)
        # A low temperature: sampled rows fall into the random model's loops as greedy ones do, so the n-gram
        # lookup drafts for them too, and sampling rejects some drafts.
        sampled = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.3, seed=seed)
        greedy = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
        outputs = llm.generate(_prompts(), [sampled, sampled, greedy, sampled, sampled])
    assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)
    assert any(sampled_rejections), "no sampled row's draft was rejected: the residual was never drawn"
    assert not syncs.seen, f"host syncs in verification: {sorted(set(syncs.seen))}"
