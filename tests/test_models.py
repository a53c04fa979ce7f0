"""brisk models vs Hugging Face transformers on tiny random checkpoints (fp32, CPU): logits must match.

Each model runs over a paged KV cache bound by the test itself (one KV group, consecutive blocks per
sequence starting at block 1; block 0 is the null block), through prefill, batched and chunked steps.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from brisk.kernels.cpu_kernels import CpuKernels, load_cpu_kernels
from brisk.layers.attention import Attention, AttentionMetadata
from brisk.layers.backends import make_attention_backend
from brisk.model_config import ModelConfig
from brisk.model_runner import loader
from brisk.model_runner.loader import load_model
from tests.conftest import skip_unless_isa_under_test
from tests.tiny_models import hf_reference, make_tiny_model, tiny_config

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 96
VARIANTS = {
    "llama": dict(arch="llama"),
    "qwen3": dict(arch="qwen3"),
    "gpt_oss": dict(arch="gpt_oss"),
    "gpt_oss_mxfp4": dict(arch="gpt_oss", mxfp4=True),
}


class PagedKV:
    """Binds zeroed KV caches to every Attention layer and builds AttentionMetadata for flat steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int = BLOCK_SIZE,
        num_blocks: int = NUM_BLOCKS,
        kernels: CpuKernels | None = None,
        kv_dtype: torch.dtype = torch.float32,
        sliding_kv_dtype: torch.dtype | None = None,
    ) -> None:
        # kernels: brisk's C kernels (decode attention, norms, matmuls, MoE); None: the PyTorch reference paths.
        # kv_dtype: the caches' (float8_e4m3fn: an FP8 KV cache with the layers' scales); sliding_kv_dtype: that of
        # sliding-window layers where it differs (kv_cache_dtype_skip_layers).
        attention_backend = make_attention_backend("cpu" if kernels else "torch", torch.device("cpu"), kernels)
        for module in model.modules():  # norms and MoE layers
            if hasattr(module, "cpu_kernels"):
                module.cpu_kernels = kernels
        for layer in model.modules():
            if isinstance(layer, Attention):
                dtype = kv_dtype if layer.sliding_window is None or sliding_kv_dtype is None else sliding_kv_dtype
                layer.k_cache = torch.zeros(num_blocks, block_size, layer.num_kv_heads, layer.head_dim, dtype=dtype)
                layer.v_cache = torch.zeros_like(layer.k_cache)
                layer.kv_group = 0
                layer.backend = attention_backend
        self.block_size, self.num_blocks = block_size, num_blocks
        self.next_block = 1  # block 0 is the null block
        self.tables: list[list[int]] = []
        self.lens: list[int] = []

    def add_sequence(self, max_len: int) -> int:
        n = math.ceil(max_len / self.block_size)
        if self.next_block + n > self.num_blocks:
            raise ValueError("test KV cache too small")
        self.tables.append(list(range(self.next_block, self.next_block + n)))
        self.next_block += n
        self.lens.append(0)
        return len(self.tables) - 1

    def step(self, chunks: list[tuple[int, torch.Tensor]]):
        """chunks: (sequence id, its new token ids). Returns (input_ids, positions, meta)."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, new_ids in chunks:
            pos = torch.arange(self.lens[seq], self.lens[seq] + len(new_ids))
            table = torch.tensor(self.tables[seq])
            ids.append(new_ids)
            positions.append(pos)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            self.lens[seq] += len(new_ids)
            starts.append(starts[-1] + len(new_ids))
            seq_lens.append(self.lens[seq])
        width = max(len(self.tables[seq]) for seq, _ in chunks)
        block_table = torch.zeros(len(chunks), width, dtype=torch.int32)
        for row, (seq, _) in enumerate(chunks):
            block_table[row, : len(self.tables[seq])] = torch.tensor(self.tables[seq], dtype=torch.int32)
        meta = AttentionMetadata(starts, seq_lens, [block_table], [torch.cat(slots)])
        return torch.cat(ids), torch.cat(positions), meta


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tmp_path_factory):
    """(brisk model, HF reference, ModelConfig) for one variant."""
    variant = VARIANTS[request.param]
    path = make_tiny_model(variant["arch"], tmp_path_factory.mktemp(request.param), mxfp4=variant.get("mxfp4", False))
    model_config = ModelConfig.from_pretrained(path)
    model = load_model(model_config, device="cpu")
    return model, hf_reference(path), model_config


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    return hf_model(ids[None]).logits[0].float()


@torch.no_grad()
def brisk_logits(model, ids, positions, meta) -> torch.Tensor:
    return model.compute_logits(model(ids, positions, meta))


def test_prefill_matches_hf(models):
    model, hf_model, model_config = models
    ids = random_tokens(40, seed=1)  # longer than the gpt-oss window (8)
    kv = PagedKV(model)
    seq = kv.add_sequence(len(ids))
    logits = brisk_logits(model, *kv.step([(seq, ids)]))
    assert logits.dtype == torch.float32 and logits.shape == (40, model_config.vocab_size)
    torch.testing.assert_close(logits, hf_logits(hf_model, ids), atol=ATOL, rtol=0)


def test_batch_of_three_sequences_in_one_forward(models):
    model, hf_model, _ = models
    prompts = [random_tokens(n, seed=10 + n) for n in (33, 5, 17)]
    kv = PagedKV(model)
    seqs = [kv.add_sequence(len(p)) for p in prompts]
    logits = brisk_logits(model, *kv.step(list(zip(seqs, prompts))))
    offset = 0
    for prompt in prompts:
        expected = hf_logits(hf_model, prompt)
        torch.testing.assert_close(logits[offset : offset + len(prompt)], expected, atol=ATOL, rtol=0)
        offset += len(prompt)


@pytest.mark.parametrize("cpu_path", ["torch", "avx512", "avx2"])
def test_chunked_prefill_then_decode(request, models, cpu_path):
    """Sequence A: prefill in two chunks, then decodes; B joins mid-way so steps mix prefill and decode, and
    ends with a chunk of three while A decodes. Every CPU path: the PyTorch reference and each build of brisk's C
    kernels this run tests."""
    if cpu_path != "torch":
        skip_unless_isa_under_test(request.config, cpu_path)
    model, hf_model, _ = models
    full_a, full_b = random_tokens(37, seed=2), random_tokens(18, seed=3)
    kv = PagedKV(model, kernels=None if cpu_path == "torch" else load_cpu_kernels(cpu_path))
    a, b = kv.add_sequence(len(full_a)), kv.add_sequence(len(full_b))
    steps = [[(a, full_a[:18])], [(a, full_a[18:30]), (b, full_b[:9])]]
    steps += [[(a, full_a[30 + i : 31 + i]), (b, full_b[9 + i : 10 + i])] for i in range(6)]
    steps += [[(a, full_a[36:37]), (b, full_b[15:18])]]
    ref = {a: hf_logits(hf_model, full_a), b: hf_logits(hf_model, full_b)}
    for chunks in steps:
        starts = {seq: kv.lens[seq] for seq, _ in chunks}
        logits = brisk_logits(model, *kv.step(chunks))
        offset = 0
        for seq, new_ids in chunks:
            expected = ref[seq][starts[seq] : starts[seq] + len(new_ids)]
            torch.testing.assert_close(logits[offset : offset + len(new_ids)], expected, atol=ATOL, rtol=0)
            offset += len(new_ids)


def test_attention_layers_follow_layer_types(models):
    model, _, model_config = models
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [m.layer_idx for m in layers] == list(range(model_config.num_layers))
    expected = [model_config.sliding_window if t == "sliding_attention" else None for t in model_config.layer_types]
    assert [m.sliding_window for m in layers] == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_random_mxfp4_experts_give_the_torch_paths_logits_through_the_kernels(
    request, tmp_path, monkeypatch, isa, dtype
):
    """`--load_format dummy` gpt-oss with MXFP4 experts whose scales reach 2^1: gate pre-activations far below
    -88.7 / alpha, where exp(-alpha * gate) overflows fp32. Prefill, then greedy decodes, through the PyTorch
    paths and through each build of brisk's C kernels: finite logits, the same tokens, close logits."""
    skip_unless_isa_under_test(request.config, isa)
    monkeypatch.setattr(loader, "DUMMY_MXFP4_SCALE_RANGE", (118, 128))  # E8M0 2^-9 .. 2^1
    config = tiny_config("gpt_oss").to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(ModelConfig.from_pretrained(str(tmp_path), dtype=dtype), load_format="dummy", device="cpu")
    prompt = random_tokens(12, seed=4)

    def greedy(kernels: CpuKernels | None) -> tuple[list[int], torch.Tensor]:
        kv = PagedKV(model, kernels=kernels)
        seq = kv.add_sequence(len(prompt) + 8)
        steps = [brisk_logits(model, *kv.step([(seq, prompt)]))[-1:]]
        for _ in range(8):
            steps.append(brisk_logits(model, *kv.step([(seq, steps[-1].argmax(-1))])))
        logits = torch.cat(steps)
        return logits.argmax(-1).tolist(), logits

    torch_tokens, torch_logits = greedy(None)
    assert torch.isfinite(torch_logits).all()
    kernel_tokens, kernel_logits = greedy(load_cpu_kernels(isa))
    assert torch.isfinite(kernel_logits).all()
    assert kernel_tokens == torch_tokens
    scale = torch_logits.abs().max().item()
    torch.testing.assert_close(kernel_logits, torch_logits, rtol=0, atol=(1e-4 if dtype == "float32" else 2e-2) * scale)
