"""Layer-level checks: MXFP4 vs HF, tensor-parallel weight slicing (tp_size 2 and 4), RoPE and RMSNorm vs HF,
the MoE reference backend vs HF's experts and vs a per-slot loop, prepacked CPU bf16 weights, the few row counts
half-precision CPU matmuls run at."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import brisk
from brisk import LLM, SamplingParams
from brisk.layers.attention import Attention
from brisk.layers.backends import make_attention_backend, make_moe_backend
from brisk.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from brisk.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    get_weight_loader,
    linear,
    onednn_rows,
    prepack_cpu_weight,
    prepack_weights,
)
from brisk.layers.moe import FusedMoE, clamped_swiglu, select_experts
from brisk.layers.mxfp4 import dequantize_mxfp4
from brisk.layers.norm import RMSNorm
from brisk.layers.rotary import RotaryEmbedding
from brisk.model_config import ModelConfig, ParallelConfig
from brisk.model_runner.binding import Kernels, bind
from brisk.model_runner.loader import load_model
from brisk.models.registry import get_model_class
from tests.tiny_models import make_tiny_model, quantize_mxfp4, with_config_swiglu_clamps


def ranks(tp_size: int) -> list[ParallelConfig]:
    return [ParallelConfig.for_rank(r, tp_size) for r in range(tp_size)]


def load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard_id: object = None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


# ---------------------------------------------------------------- MXFP4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_mxfp4_matches_hf(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 8, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, out, in]
    hf = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    assert ours.shape == (3, 8, 128) and ours.dtype == dtype
    assert torch.equal(ours, hf.transpose(1, 2))


def test_dequantize_mxfp4_nibble_order_and_scale():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2F  # low nibble 0xF = -6 (element 0), high nibble 0x2 = 1.0 (element 1)
    scales = torch.tensor([[129]], dtype=torch.uint8)  # 2^2
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out[0, :2].tolist() == [-24.0, 4.0] and out[0, 2:].abs().sum() == 0


def test_test_quantizer_round_trips_representable_values():
    weight = torch.tensor([0.5, -1.5, 3.0, 6.0, 0.0, -4.0, 2.0, 1.0] * 4).repeat(2, 1) * 2.0**-3
    blocks, scales = quantize_mxfp4(weight)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), weight)


def test_dequantize_mxfp4_rejects_bad_inputs():
    with pytest.raises(ValueError):
        dequantize_mxfp4(torch.zeros(2, 4, 16), torch.zeros(2, 4, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError):
        dequantize_mxfp4(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), torch.float32)


# ---------------------------------------------------------------- tensor-parallel slicing


def test_column_parallel_slices_output_rows():
    full_w, full_b = torch.arange(48.0).view(8, 6), torch.arange(8.0)
    x = torch.randn(3, 6)
    outs = []
    for p in ranks(2):
        layer = ColumnParallelLinear(6, 8, bias=True, parallel=p)
        load(layer, "weight", full_w)
        load(layer, "bias", full_b)
        rows = slice(4 * p.tp_rank, 4 * p.tp_rank + 4)
        assert torch.equal(layer.weight, full_w[rows]) and torch.equal(layer.bias, full_b[rows])
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, -1), torch.nn.functional.linear(x, full_w, full_b))


def test_row_parallel_slices_input_columns_and_adds_bias_once():
    full_w, full_b = torch.randn(5, 6), torch.randn(5)
    x = torch.randn(3, 6)
    total = torch.zeros(3, 5)
    for p in ranks(2):
        layer = RowParallelLinear(6, 5, bias=True, parallel=p, reduce_results=False)
        load(layer, "weight", full_w)
        load(layer, "bias", full_b)
        cols = slice(3 * p.tp_rank, 3 * p.tp_rank + 3)
        assert torch.equal(layer.weight, full_w[:, cols]) and torch.equal(layer.bias, full_b)
        total += layer(x[:, cols])  # what the all-reduce would compute
    torch.testing.assert_close(total, torch.nn.functional.linear(x, full_w, full_b))


def test_merged_column_parallel_keeps_gate_and_up_shards_together():
    gate, up = torch.arange(24.0).view(4, 6), 100 + torch.arange(24.0).view(4, 6)
    for p in ranks(2):
        layer = MergedColumnParallelLinear(6, [4, 4], parallel=p)
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
        rows = slice(2 * p.tp_rank, 2 * p.tp_rank + 2)
        assert torch.equal(layer.weight, torch.cat([gate[rows], up[rows]]))
    with pytest.raises(ValueError):
        load(MergedColumnParallelLinear(6, [4, 4]), "weight", gate, 2)


def qkv_weights(num_heads: int, num_kv_heads: int, head_dim: int, hidden: int):
    # Row values encode (projection, head): q rows 0.., k rows 1000.., v rows 2000..
    def proj(base, heads):
        return (base + torch.arange(heads * head_dim, dtype=torch.float32))[:, None].expand(-1, hidden).clone()

    return proj(0, num_heads), proj(1000, num_kv_heads), proj(2000, num_kv_heads)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_qkv_parallel_splits_heads_and_replicates_kv_heads(tp_size):
    heads, kv_heads, d, hidden = 8, 2, 2, 3
    q, k, v = qkv_weights(heads, kv_heads, d, hidden)
    for p in ranks(tp_size):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, bias=True, parallel=p)
        for shard_id, w in zip("qkv", (q, k, v)):
            load(layer, "weight", w, shard_id)
            load(layer, "bias", w[:, 0], shard_id)
        q_heads = heads // tp_size
        kv_head = p.tp_rank // (tp_size // kv_heads) if tp_size >= kv_heads else None
        q_rows = slice(p.tp_rank * q_heads * d, (p.tp_rank + 1) * q_heads * d)
        kv_rows = slice(kv_head * d, (kv_head + 1) * d)
        expected = torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
        assert layer.num_kv_heads == 1 and layer.num_kv_head_replicas == tp_size // kv_heads
        assert torch.equal(layer.weight, expected) and torch.equal(layer.bias, expected[:, 0])


def test_qkv_parallel_tp2_with_more_kv_heads_than_ranks():
    q, k, v = qkv_weights(4, 2, 2, 3)
    for p in ranks(2):
        layer = QKVParallelLinear(3, 2, 4, 2, parallel=p)
        for shard_id, w in zip("qkv", (q, k, v)):
            load(layer, "weight", w, shard_id)
        r = p.tp_rank
        assert torch.equal(layer.weight, torch.cat([q[4 * r : 4 * r + 4], k[2 * r : 2 * r + 2], v[2 * r : 2 * r + 2]]))


def test_parallel_layers_reject_indivisible_sizes():
    with pytest.raises(ValueError, match="tp_size"):
        ColumnParallelLinear(4, 6, parallel=ParallelConfig(0, 4))
    with pytest.raises(ValueError, match="tp_size"):
        QKVParallelLinear(8, 2, 6, 3, parallel=ParallelConfig(0, 4))
    with pytest.raises(ValueError, match="shape"):
        load(ReplicatedLinear(4, 2), "weight", torch.zeros(2, 5))


def test_vocab_parallel_embedding_and_lm_head_shard_rows():
    full = torch.arange(15.0).view(5, 3)
    for p in ranks(2):
        emb = VocabParallelEmbedding(5, 3, parallel=p)
        load(emb, "weight", full)
        expected = full[:3] if p.tp_rank == 0 else torch.cat([full[3:], torch.zeros(1, 3)])
        assert torch.equal(emb.weight, expected)
    head = ParallelLMHead(5, 3)
    load(head, "weight", full)
    x = torch.randn(2, 3)
    torch.testing.assert_close(head(x), x @ full.T)
    emb = VocabParallelEmbedding(5, 3)
    load(emb, "weight", full)
    assert torch.equal(emb(torch.tensor([4, 0])), full[[4, 0]])


@pytest.mark.parametrize("mxfp4,i", [(False, 64), (True, 64), (True, 32)])
def test_fused_moe_tp2_slices_intermediate_dim_and_sums_to_full(mxfp4, i):
    # MXFP4 with i = 32: each rank's 16 columns are not a whole 32-value block, so I is zero-padded to 64.
    e, h = 3, 32
    gen = torch.Generator().manual_seed(0)
    hf_gate_up, hf_down = torch.randn(e, h, 2 * i, generator=gen), torch.randn(e, i, h, generator=gen)  # HF layout
    gate_up_bias, down_bias = torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen)
    if mxfp4:
        tensors = dict(zip(("gate_up_proj_blocks", "gate_up_proj_scales"), quantize_mxfp4(hf_gate_up.transpose(1, 2))))
        tensors.update(zip(("down_proj_blocks", "down_proj_scales"), quantize_mxfp4(hf_down.transpose(1, 2))))
    else:
        tensors = dict(gate_up_proj=hf_gate_up, down_proj=hf_down)
    tensors.update(gate_up_proj_bias=gate_up_bias, down_proj_bias=down_bias)

    def build(p):
        moe = FusedMoE(e, 2, h, i, quantization="mxfp4" if mxfp4 else None, parallel=p)
        for name, tensor in tensors.items():
            load(moe, name, tensor)
        return moe

    x = torch.randn(5, h, generator=gen)
    ids, weights = select_experts(torch.randn(5, e, generator=gen), 2)
    full = build(ParallelConfig())
    total = torch.zeros(5, h)
    gu_full, down_full = full.expert_weights(1, torch.float32)
    padded = -(-i // 64) * 64 if mxfp4 else i
    gu_full = torch.cat([gu_full, gu_full.new_zeros(2 * (padded - i), h)])
    down_full = torch.cat([down_full, down_full.new_zeros(h, padded - i)], dim=1)
    for p in ranks(2):
        part = build(p)
        per_rank = padded // 2
        assert part.intermediate_size == per_rank
        gu, down = part.expert_weights(1, torch.float32)
        # whole (gate, up) pairs
        assert torch.equal(gu, gu_full[p.moe_tp_rank * 2 * per_rank : (p.moe_tp_rank + 1) * 2 * per_rank])
        assert torch.equal(down, down_full[:, p.moe_tp_rank * per_rank : (p.moe_tp_rank + 1) * per_rank])
        total += part.backend.forward(part, x, ids, weights)  # what the all-reduce would compute
    torch.testing.assert_close(total, full.backend.forward(full, x, ids, weights), atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- MoE vs HF


def test_torch_moe_backend_matches_hf_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(
        hidden_size=32, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = with_config_swiglu_clamps(GptOssMLP(cfg), cfg)
    for param in hf.parameters():
        torch.nn.init.normal_(param, std=0.3)
    moe = FusedMoE(4, 2, 32, 16, swiglu_limit=1.0)
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        load(moe, name, getattr(hf.experts, name).detach())
    x = torch.randn(7, 32)
    with torch.no_grad():
        expected, _ = hf(x[None])
        router_logits = torch.nn.functional.linear(x, hf.router.weight, hf.router.bias)
        torch.testing.assert_close(moe(x, router_logits), expected[0], atol=1e-5, rtol=1e-5)


def naive_moe(moe: FusedMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Slot by slot: sum_k weights[t, k] * expert_{ids[t, k]}(x[t]); -1 slots contribute nothing."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            gate_up, down = moe.expert_weights(e, x.dtype)
            act = clamped_swiglu(x[t] @ gate_up.T + moe.gate_up_proj_bias[e], moe.swiglu_alpha, moe.swiglu_limit)
            out[t] += weights[t, k] * (act @ down.T + moe.down_proj_bias[e])
    return out


@pytest.mark.parametrize("num_tokens, one_token_ids", [(0, None), (1, None), (9, None), (1, [2, 0, 3])])
def test_torch_moe_backend_matches_slot_loop_with_foreign_slots(num_tokens, one_token_ids):
    # Slots routed to another expert-parallel rank's experts arrive as -1: they must add nothing, and a batch
    # where some experts get no token (or there are no tokens at all, an idle attention-DP rank) must work.
    # one_token_ids: a single token on local experts only (the one-token path, no sorting).
    gen = torch.Generator().manual_seed(3)
    moe = FusedMoE(4, 3, 16, 8)
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        load(
            moe,
            name,
            torch.randn(
                getattr(moe, name).transpose(-1, -2).shape if name.endswith("proj") else getattr(moe, name).shape,
                generator=gen,
            ),
        )
    x = torch.randn(num_tokens, 16, generator=gen)
    ids = torch.randint(-1, 3, (num_tokens, 3), generator=gen)  # expert 3 never picked, -1 = another rank
    if one_token_ids is not None:
        ids = torch.tensor([one_token_ids])
    weights = torch.rand(num_tokens, 3, generator=gen)
    got = moe.backend.forward(moe, x, ids, weights)
    torch.testing.assert_close(got, naive_moe(moe, x, ids, weights), atol=1e-5, rtol=1e-5)


def test_prepacked_bf16_weights_give_the_same_outputs():
    # CPU bf16 weights reordered for oneDNN must compute exactly what the plain matmul computes.
    if prepack_cpu_weight(torch.zeros(8, 8, dtype=torch.bfloat16)) is None:
        pytest.skip("this CPU's torch has no oneDNN bf16 matmul")
    gen = torch.Generator().manual_seed(5)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = torch.nn.ModuleDict(
                dict(
                    qkv=QKVParallelLinear(64, 16, 4, 2, bias=True),
                    row=RowParallelLinear(64, 48, bias=True),
                    merged=MergedColumnParallelLinear(64, [32, 32]),
                    head=ParallelLMHead(100, 64),
                    moe=FusedMoE(4, 2, 64, 32),
                )
            )
        finally:
            torch.set_default_dtype(torch.float32)
    for param in model.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen))
    inputs = [
        (torch.randn(rows, 64, generator=gen).bfloat16(), torch.randn(rows, 4, generator=gen).bfloat16())
        for rows in (1, 5, 32)
    ]

    def outputs():
        return [
            [model[n](x) for n in ("qkv", "row", "merged", "head")] + [model["moe"](x, router)] for x, router in inputs
        ]

    plain = outputs()
    assert prepack_weights(model) == 4 + 2 * 4  # four dense layers, two matrices per expert
    assert model["moe"].packed_experts is not None and model["head"].packed_weight is not None
    for before, after in zip(plain, outputs()):
        for name, a, b in zip(("qkv", "row", "merged", "head", "moe"), before, after):
            assert torch.equal(a, b), name
    # fp32 weights and MXFP4 experts are left as they are
    assert prepack_cpu_weight(torch.zeros(8, 8)) is None
    assert FusedMoE(2, 1, 32, 32, quantization="mxfp4").prepack() == 0


def _bf16_rows(rows: int) -> int:
    return onednn_rows(torch.empty(rows, 1, dtype=torch.bfloat16))


def test_half_precision_cpu_matmuls_run_at_a_few_row_counts():
    # oneDNN makes and keeps a kernel for every matmul shape it meets: up to 16 rows as given, then 8 sizes an
    # octave, each at most 1/8 more rows than asked for
    sizes = [_bf16_rows(rows) for rows in range(1, 8193)]
    assert sizes[:16] == list(range(1, 17))
    assert all(rows <= padded <= rows * 9 / 8 for rows, padded in enumerate(sizes, 1))
    assert sorted(set(sizes))[16:26] == [18, 20, 22, 24, 26, 28, 30, 32, 36, 40]
    assert len(set(sizes)) == 16 + 8 * 9  # 16 exact, then 8 in each octave from 16-32 to 4096-8192
    assert onednn_rows(torch.empty(100, 4)) == 100  # fp32 (MKL) as given
    assert onednn_rows(torch.empty(2, 100, 4, dtype=torch.bfloat16)) == 2  # only [rows, in] inputs are padded
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(48, 64, generator=gen).bfloat16(), torch.randn(48, generator=gen).bfloat16()
    packed = prepack_cpu_weight(weight)
    for rows in (0, 5, 17, 100, 300):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        padded = torch.cat([x, torch.zeros(_bf16_rows(rows) - rows, 64, dtype=torch.bfloat16)])
        expected = F.linear(padded, weight, bias)[:rows]
        for got in [linear(x, weight, bias)] + ([] if packed is None else [linear(x, weight, bias, packed)]):
            assert got.shape == (rows, 48) and torch.equal(got, expected)
            # oneDNN's rows are computed each on its own (exactly so on AVX512-BF16; to a rounding elsewhere)
            torch.testing.assert_close(got, F.linear(x, weight, bias))


def test_a_served_model_runs_its_bf16_matmuls_at_the_few_row_counts(monkeypatch):
    # Every bf16 matmul of the bundled demo model (dense layers prepacked, the experts, the LM head) over prompts of
    # many lengths, chunked and batched, goes to oneDNN at one of onednn_rows' sizes.
    seen: list[int] = []

    def recording(original):
        def call(x, *args, **kwargs):
            if x.dtype == torch.bfloat16 and x.dim() == 2:
                seen.append(x.shape[0])
            return original(x, *args, **kwargs)

        return call

    monkeypatch.setattr(F, "linear", recording(F.linear))
    if torch.backends.mkldnn.is_available():
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording(torch.ops.mkldnn._linear_pointwise))
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 4000, (n,), generator=gen).tolist()} for n in range(1, 250, 6)]
    with LLM(str(Path(brisk.__file__).parent / "demo_model"), max_num_tokens=192, max_batch_size=8) as llm:
        assert llm.engine.model_config.dtype == torch.bfloat16
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        for prompt in prompts[::2]:  # alone: a step of each prompt's length
            llm.generate(prompt, params)
        llm.generate(prompts[1::2], params)  # batched and chunked
    assert max(seen) > 16 and len(set(seen)) > 10  # steps of many sizes reached the matmuls
    assert {rows for rows in seen if _bf16_rows(rows) != rows} == set()


def test_moe_backend_choice_is_bound_like_attention(tmp_path):
    """The registry picks a backend by name; the runner binds one MoE backend (and one attention backend) to every
    layer, as it binds attention; a layer built alone computes with the torch reference."""
    assert FusedMoE(2, 1, 32, 32).backend.name == "torch"
    assert make_moe_backend("triton").name == "triton" and make_moe_backend("torch").name == "torch"
    with pytest.raises(ValueError, match="auto, torch, triton"):
        make_moe_backend("cuda-magic")
    assert make_moe_backend("auto").name == ("triton" if torch.cuda.is_available() else "torch")
    config = ModelConfig.from_pretrained(make_tiny_model("gpt_oss", tmp_path / "m"))
    model = load_model(config, load_format="dummy", device="cpu")
    kernels = Kernels(make_attention_backend("torch", torch.device("cpu")), make_moe_backend("triton"), None)
    bind(model, kernels)
    moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert moe_layers and all(m.backend is kernels.moe for m in moe_layers)
    assert attention_layers and all(m.backend is kernels.attention for m in attention_layers)


def test_a_gpu_without_triton_says_auto_runs_the_torch_reference(monkeypatch, caplog):
    """Without Triton (brisk-llm's gpu extra) auto picks the torch reference backends on a GPU too: slow (a host
    sync every layer, no CUDA graphs), so start-up warns and says what to install; asked for by name, no warning."""
    import logging

    from brisk.config import EngineConfig
    from brisk.layers import backends
    from brisk.layers.attention import TorchAttentionBackend
    from brisk.layers.attention_cpu import CpuAttentionBackend
    from brisk.layers.moe import TorchMoEBackend
    from brisk.model_runner.binding import make_kernels

    monkeypatch.setattr(
        backends, "_attention_backends", lambda: {"cpu": CpuAttentionBackend, "torch": TorchAttentionBackend}
    )
    monkeypatch.setattr(backends, "_moe_backends", lambda: {"torch": TorchMoEBackend})
    gpu = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="brisk.model_runner.binding"):
        kernels = make_kernels(EngineConfig(model="m"), gpu)
        assert not kernels.graph_safe and "pip install 'brisk-llm[gpu]'" in caplog.text
        caplog.clear()
        make_kernels(EngineConfig(model="m", attn_backend="torch", moe_config={"backend": "torch"}), gpu)
        make_kernels(EngineConfig(model="m"), torch.device("cpu"))
    assert not caplog.text


# ---------------------------------------------------------------- RoPE and RMSNorm vs HF


def rope_configs():
    from transformers import GptOssConfig, LlamaConfig

    yarn = GptOssConfig(head_dim=64, num_attention_heads=8, hidden_size=512)  # the real gpt-oss YaRN defaults
    default = LlamaConfig(
        hidden_size=256, num_attention_heads=4, rope_parameters=dict(rope_type="default", rope_theta=10000.0)
    )
    llama3 = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    return {"yarn": yarn, "default": default, "llama3": llama3}


@pytest.mark.parametrize("kind", ["yarn", "default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_hf(kind, dtype):
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.llama import modeling_llama

    config = rope_configs()[kind]
    hf_module = modeling_gpt_oss if kind == "yarn" else modeling_llama
    hf_rope_class = modeling_gpt_oss.GptOssRotaryEmbedding if kind == "yarn" else modeling_llama.LlamaRotaryEmbedding
    hf_rope = hf_rope_class(config)
    d = config.head_dim
    heads, kv_heads = 4, 2
    positions = torch.tensor([0, 1, 7, 127, 128, 4095, 4097, 70000, 131071])
    t = len(positions)
    q, k = torch.randn(t, heads * d).to(dtype), torch.randn(t, kv_heads * d).to(dtype)

    ours = RotaryEmbedding(config, d)
    if kind == "yarn":
        assert ours.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)
    q_ours, k_ours = ours(positions, q, k)
    cos, sin = hf_rope(q, positions[None])
    q_hf, k_hf = hf_module.apply_rotary_pos_emb(
        q.view(1, t, heads, d).transpose(1, 2), k.view(1, t, kv_heads, d).transpose(1, 2), cos, sin
    )
    assert torch.equal(q_ours, q_hf.transpose(1, 2).reshape(t, -1))
    assert torch.equal(k_ours, k_hf.transpose(1, 2).reshape(t, -1))


def test_rotary_step_positions_are_computed_once_and_renewed_each_step():
    # The model sets a step's positions once (cos/sin shared by all layers); a buffer rewritten in place for
    # the next step (as a captured graph's static input would be) is set again, and gets new values.
    config = rope_configs()["yarn"]
    rope = RotaryEmbedding(config, config.head_dim)
    q, k = torch.randn(3, 4 * config.head_dim), torch.randn(3, 2 * config.head_dim)
    with torch.inference_mode():
        positions = torch.tensor([0, 5, 9])
        standalone = rope(positions, q, k)  # no step set: computed on the spot
        rope.set_step_positions(positions, q.dtype)
        assert all(torch.equal(a, b) for a, b in zip(rope(positions, q, k), standalone))
        positions.copy_(torch.tensor([100, 200, 300]))
        rope.set_step_positions(positions, q.dtype)
        expected = RotaryEmbedding(config, config.head_dim)(torch.tensor([100, 200, 300]), q, k)
        assert all(torch.equal(a, b) for a, b in zip(rope(positions, q, k), expected))
        assert all(torch.equal(a, b) for a, b in zip(rope(torch.tensor([0, 5, 9]), q, k), standalone))


def test_unsupported_rope_type_is_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    )
    with pytest.raises(ValueError, match="dynamic"):
        RotaryEmbedding(config, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for rows, hidden in ((5, 64), (300, 2880)):  # 2880: gpt-oss's hidden size
        x = (3 * torch.randn(rows, hidden)).to(dtype)
        weight = (1 + torch.randn(hidden) * 0.1).to(dtype)
        for hf_class, fp32_weight in ((LlamaRMSNorm, False), (GptOssRMSNorm, True)):
            hf = hf_class(hidden, eps=1e-5).to(dtype)
            ours = RMSNorm(hidden, 1e-5, weight_in_fp32=fp32_weight).to(dtype)
            with torch.no_grad():
                hf.weight.copy_(weight)
                ours.weight.copy_(weight)
            assert torch.equal(ours(x), hf(x))


def test_registry_lists_supported_architectures():
    assert get_model_class("GptOssForCausalLM").__name__ == "GptOssForCausalLM"
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class("MistralForCausalLM")


# A prompt through a real-size MXFP4 MoE layer's torch path (32 experts of 2,048, 512 tokens, top 4: ~64 rows an
# expert, so every expert is dequantized), in a process whose C heap keeps what it frees, as a CPU rank's does
# (host.py). Prints the growth of its resident memory over the prompt, in [2I, H] bf16 projections.
PROMPT_RSS_SCRIPT = """
import sys, torch
from brisk.host import keep_freed_memory_in_the_heap
from brisk.kernels.cpu_kernels import load_cpu_kernels
from brisk.layers.moe import FusedMoE, select_experts

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

keep_freed_memory_in_the_heap()
torch.set_num_threads(1)
experts, hidden, tokens = 32, 2048, 512
moe = FusedMoE(experts, 4, hidden, hidden, quantization="mxfp4")
g = torch.Generator().manual_seed(0)
for name, p in moe.named_parameters():
    if p.dtype == torch.uint8:
        p.data.random_(118, 122, generator=g) if name.endswith("scales") else p.data.random_(0, 256, generator=g)
    else:
        p.data = p.data.bfloat16().normal_(0, 0.02, generator=g)
moe.cpu_kernels = load_cpu_kernels(sys.argv[1])
x = torch.randn(tokens, hidden, generator=g).bfloat16()
ids, weights = select_experts(torch.randn(tokens, experts, generator=g).bfloat16(), 4)
moe.backend.forward(moe, x[:64], ids[:64], weights[:64])  # the libraries' first-call set-up
before = rss()
moe.backend.forward(moe, x, ids, weights)
print((rss() - before) / (2 * hidden * hidden * 2))
"""


def test_mxfp4_prompt_leaves_no_dequantized_expert_in_the_heap(default_cpu_kernels):
    # Each expert's dequantized weight was a new tensor, freed around the small outputs kept beside it: the heap
    # kept one hole per expert (31 projections of growth with the kernels, 19 with torch ops; ~1 GB a prompt at
    # gpt-oss-20b's size). Dequantized into one buffer the growth is the outputs' (4-7 projections).
    result = subprocess.run(
        [sys.executable, "-c", PROMPT_RSS_SCRIPT, default_cpu_kernels], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) < 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantized_into_the_prompt_buffer_is_dequantize_mxfp4(default_cpu_kernels, dtype):
    # I = 160: 320 gate_up rows, DEQUANTIZE_ROWS and a shorter rest for the torch ops; the down projection in the
    # same buffer after it. With the kernels: one C pass into the buffer. Both equal dequantize_mxfp4 exactly.
    from brisk.kernels.cpu_kernels import load_cpu_kernels
    from brisk.layers.moe import DEQUANTIZE_ROWS

    moe = FusedMoE(3, 2, 64, 160, quantization="mxfp4")
    gen = torch.Generator().manual_seed(4)
    for name, param in moe.named_parameters():
        if param.dtype == torch.uint8:
            param.data.random_(100, 140, generator=gen) if name.endswith("scales") else param.data.random_(
                0, 256, generator=gen
            )
    moe.cpu_kernels = load_cpu_kernels(default_cpu_kernels)
    assert 2 * 160 % DEQUANTIZE_ROWS and 2 * 160 > DEQUANTIZE_ROWS
    buffer = moe.dequantize_buffer(dtype, None)
    assert buffer is not None and buffer.numel() == 2 * 160 * 64
    assert moe.dequantize_buffer(dtype, buffer) is buffer  # kept from layer to layer
    for expert in range(3):
        for which, blocks, scales in (
            ("gate_up", moe.gate_up_proj_blocks, moe.gate_up_proj_scales),
            ("down", moe.down_proj_blocks, moe.down_proj_scales),
        ):
            out = moe._dequantized(expert, which, dtype, buffer)
            assert out.data_ptr() == buffer.data_ptr()
            assert torch.equal(out, dequantize_mxfp4(blocks[expert], scales[expert], dtype))


@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "bf16"])
def test_moe_tp_ranks_take_their_rows_and_pad_only_their_own(mxfp4):
    """MoE split 4 ways by intermediate size: each rank holds the rows of the full tensor (transposed from HF's
    [E, in, out] for bf16) padded with zero rows past the stored ones (MXFP4: 3 blocks of 32 over 4 ranks, the last
    rank all padding), as padding the whole tensor and taking the rank's rows would; padding never copies more than
    the rank's own rows (a checkpoint tensor is a view of the file: padding it whole would read every expert)."""
    e, h, i, tp = 2, 64, 96, 4
    gen = torch.Generator().manual_seed(7)
    if mxfp4:
        full = {
            "gate_up_proj_blocks": ((e, 2 * i, h // 32, 16), 1, False),
            "gate_up_proj_scales": ((e, 2 * i, h // 32), 1, False),
            "down_proj_blocks": ((e, h, i // 32, 16), 2, False),
            "down_proj_scales": ((e, h, i // 32), 2, False),
        }
    else:
        full = {"gate_up_proj": ((e, h, 2 * i), 1, True), "down_proj": ((e, i, h), 2, True)}
    full |= {"gate_up_proj_bias": ((e, 2 * i), 1, False), "down_proj_bias": ((e, h), None, False)}
    tensors = {
        name: torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        if mxfp4 and not name.endswith("bias")
        else torch.randn(shape, generator=gen)
        for name, (shape, _, _) in full.items()
    }
    padded_rows = []

    class Pads(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "constant_pad_nd":
                padded_rows.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    for rank in range(tp):
        layer = FusedMoE(
            e, 2, h, i, quantization="mxfp4" if mxfp4 else None, parallel=ParallelConfig.for_rank(rank, tp)
        )
        params = dict(layer.named_parameters())
        for name, tensor in tensors.items():
            param = params[name]
            padded_rows.clear()
            with Pads():
                get_weight_loader(param)(param, tensor)
            _, tp_dim, transpose = full[name]
            expected = tensor.transpose(1, 2) if transpose else tensor  # the way before: pad all, then narrow
            if tp_dim is not None:
                size = param.shape[tp_dim]
                missing = size * tp - expected.shape[tp_dim]
                if missing > 0:
                    expected = torch.nn.functional.pad(expected, [0, 0] * (expected.dim() - 1 - tp_dim) + [0, missing])
                expected = expected.narrow(tp_dim, rank * size, size)
            assert torch.equal(param.data, expected.to(param.dtype)), (rank, name)
            assert all(n <= param.numel() for n in padded_rows), (rank, name, padded_rows)
        if mxfp4 and rank == tp - 1:
            assert not layer.gate_up_proj_blocks.any() and not layer.down_proj_scales.any()  # all padding
