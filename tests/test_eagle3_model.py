"""EAGLE3 draft head: public checkpoint layout -> brisk's head -> the same numbers as a plain torch EAGLE3 layer
written here; bad heads fail naming the file, key or size; the targets expose their aux hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from brisk.layers.attention import AttentionMetadata, TorchAttentionBackend
from brisk.layers.embedding import VocabParallelEmbedding
from brisk.model_config import ModelConfig
from brisk.model_runner.loader import load_model
from brisk.models.eagle3 import Eagle3CheckpointError, load_eagle3_head
from tests.tiny_models import make_tiny_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, DRAFT_VOCAB = 64, 4, 2, 16, 96, 100
EPS = 1e-5
ROPE_THETA = 10000.0


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> ModelConfig:
    path = make_tiny_model("llama", tmp_path_factory.mktemp("target"))
    return ModelConfig.from_pretrained(path, dtype="float32")


def head_config(target: ModelConfig, **overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "vocab_size": target.vocab_size,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": target.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1], "use_aux_hidden_state": True},
    }
    config.update(overrides)
    return config


def head_weights(target: ModelConfig, seed: int = 0, embed: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    th, v = target.hidden_size, target.vocab_size
    d2t_targets = torch.sort(torch.randperm(v, generator=g)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[d2t_targets] = True
    w = {
        "fc.weight": rnd(HIDDEN, 3 * th),
        "midlayer.input_layernorm.weight": 1 + rnd(HIDDEN),
        "midlayer.hidden_norm.weight": 1 + rnd(HIDDEN),
        "midlayer.post_attention_layernorm.weight": 1 + rnd(HIDDEN),
        "midlayer.self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": rnd(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": rnd(INTER, HIDDEN),
        "midlayer.mlp.up_proj.weight": rnd(INTER, HIDDEN),
        "midlayer.mlp.down_proj.weight": rnd(HIDDEN, INTER),
        "norm.weight": 1 + rnd(HIDDEN),
        "lm_head.weight": rnd(DRAFT_VOCAB, HIDDEN, scale=1.0),
        "d2t": d2t_targets - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    if embed:
        w["embed_tokens.weight"] = rnd(v, HIDDEN, scale=1.0)
    return w


def write_head(path: Path, config: dict, weights: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: t.contiguous() for k, t in weights.items()}, str(path / "model.safetensors"))
    return str(path)


# ---- the reference: EAGLE3's layer in plain torch, one sequence, dense causal attention ----------------------


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [T, heads, D], neox halves
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    f = positions[:, None].float() * inv
    cos, sin = torch.cat([f.cos(), f.cos()], -1)[:, None], torch.cat([f.sin(), f.sin()], -1)[:, None]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference(w, embed_w, ids, aux, hidden=None, norm_before_residual=False):
    """(target ids of the draft argmax, pre-norm output) of one sequence at positions 0..T-1."""
    t = len(ids)
    h = torch.cat(aux, -1) @ w["fc.weight"].T if hidden is None else hidden
    x = torch.cat(
        [rms(embed_w[ids], w["midlayer.input_layernorm.weight"]), rms(h, w["midlayer.hidden_norm.weight"])], -1
    )
    pos = torch.arange(t)
    q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, HEADS, HEAD_DIM), pos)
    k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM), pos)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
    rep = HEADS // KV_HEADS
    o = (
        F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(rep, 1).transpose(0, 1),
            v.repeat_interleave(rep, 1).transpose(0, 1),
            is_causal=True,
        )
        .transpose(0, 1)
        .reshape(t, HEADS * HEAD_DIM)
    )
    residual = rms(h, w["midlayer.hidden_norm.weight"]) if norm_before_residual else h
    r = residual + o @ w["midlayer.self_attn.o_proj.weight"].T
    m = rms(r, w["midlayer.post_attention_layernorm.weight"])
    out = (
        r
        + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T))
        @ w["midlayer.mlp.down_proj.weight"].T
    )
    logits = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    best = logits.argmax(-1)
    return best + w["d2t"][best], out, logits


def paged_forward(head, ids, positions, hidden, seq_lens, qsl, block_size=4):
    """Run the head's paged path over sequences laid out back to back, each with its own blocks."""
    attn = head.attn
    blocks_per_seq = -(-max(seq_lens) // block_size)
    num_blocks = 1 + len(seq_lens) * blocks_per_seq
    if attn.k_cache.numel() == 0:
        attn.k_cache = torch.zeros(num_blocks, block_size, KV_HEADS, HEAD_DIM)
        attn.v_cache = torch.zeros(num_blocks, block_size, KV_HEADS, HEAD_DIM)
        attn.backend = TorchAttentionBackend()
    table = torch.tensor([[1 + i * blocks_per_seq + b for b in range(blocks_per_seq)] for i in range(len(seq_lens))])
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.diff(torch.tensor(qsl)))
    slots = table[rows, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(qsl, seq_lens, [table.int()], [slots])
    return head(ids, positions, hidden, meta)


def test_checkpoint_round_trip_matches_reference(target, tmp_path):
    weights = head_weights(target)
    path = write_head(tmp_path / "head", head_config(target), weights)
    embedding = VocabParallelEmbedding(target.vocab_size, target.hidden_size)
    torch.nn.init.normal_(embedding.weight)
    head = load_eagle3_head(path, target, embedding, device="cpu")
    assert head.config.aux_layer_ids == (0, 1, 1)
    g = torch.Generator().manual_seed(1)
    lengths = [7, 3]  # two sequences in one paged step
    aux_per_seq = [[torch.randn(n, target.hidden_size, generator=g) for _ in range(3)] for n in lengths]
    ids_per_seq = [torch.randint(0, target.vocab_size, (n,), generator=g) for n in lengths]
    ids = torch.cat(ids_per_seq)
    positions = torch.cat([torch.arange(n) for n in lengths])
    hidden = head.combine_hidden_states([torch.cat([a[j] for a in aux_per_seq]) for j in range(3)])
    with torch.no_grad():
        normed, pre_norm = paged_forward(head, ids, positions, hidden, lengths, [0, 7, 10])
        draft = head.compute_draft_logits(normed)
        got_targets = head.draft_to_target(draft.argmax(-1))
    start = 0
    for n, seq_ids, aux in zip(lengths, ids_per_seq, aux_per_seq):
        want_targets, want_out, want_logits = reference(weights, embedding.weight.detach(), seq_ids, aux)
        torch.testing.assert_close(pre_norm[start : start + n], want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(draft[start : start + n], want_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(got_targets[start : start + n], want_targets)
        start += n
    # Every draft id maps into the target vocabulary where t2d says the draft vocabulary lives.
    assert bool(weights["t2d"][got_targets].all())


def test_own_embedding_and_norm_before_residual(target, tmp_path):
    weights = head_weights(target, seed=3, embed=True)
    config = head_config(target, norm_before_residual=True, architectures=["Eagle3LlamaForCausalLM"])
    path = write_head(tmp_path / "head", config, weights)
    shared = VocabParallelEmbedding(target.vocab_size, target.hidden_size)  # must not be used
    head = load_eagle3_head(path, target, shared, device="cpu")
    assert head.embed_tokens is not None
    ids = torch.randint(0, target.vocab_size, (5,))
    hidden = torch.randn(5, HIDDEN)
    with torch.no_grad():
        _, pre_norm = paged_forward(head, ids, torch.arange(5), hidden, [5], [0, 5])
    # norm_before_residual: the residual is the normed hidden state.
    _, want, _ = reference(weights, weights["embed_tokens.weight"], ids, None, hidden=hidden, norm_before_residual=True)
    torch.testing.assert_close(pre_norm, want, rtol=1e-4, atol=1e-4)


def test_bad_heads_name_what_is_wrong(target, tmp_path):
    embedding = VocabParallelEmbedding(target.vocab_size, target.hidden_size)

    def load(path):
        return load_eagle3_head(str(path), target, embedding, device="cpu")

    with pytest.raises(Eagle3CheckpointError, match="not a directory"):
        load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(head_config(target)))
    with pytest.raises(Eagle3CheckpointError, match=r"no \*\.safetensors files"):
        load(tmp_path / "empty")
    weights = head_weights(target)
    missing = {k: t for k, t in weights.items() if k != "midlayer.mlp.down_proj.weight"}
    with pytest.raises(Eagle3CheckpointError, match=r"missing weights: midlayer\.mlp\.down_proj\.weight"):
        load(write_head(tmp_path / "missing", head_config(target), missing))
    with pytest.raises(Eagle3CheckpointError, match="target hidden size of 32.*hidden_size 64"):
        load(write_head(tmp_path / "hidden", head_config(target, target_hidden_size=32), weights))
    wrong_fc = dict(weights, **{"fc.weight": torch.zeros(HIDDEN, 3 * 32)})
    with pytest.raises(Eagle3CheckpointError, match="fc.weight"):
        load(write_head(tmp_path / "fc", head_config(target), wrong_fc))
    with pytest.raises(Eagle3CheckpointError, match="not an EAGLE3 head"):
        load(write_head(tmp_path / "arch", head_config(target, architectures=["LlamaForCausalLM"]), weights))
    with pytest.raises(Eagle3CheckpointError, match="vocab_size"):
        load(write_head(tmp_path / "vocab", head_config(target, vocab_size=7), weights))
    no_d2t = {k: t for k, t in weights.items() if k not in ("d2t", "t2d")}
    with pytest.raises(Eagle3CheckpointError, match="missing weights: d2t"):
        load(write_head(tmp_path / "d2t", head_config(target), no_d2t))
    bad_t2d = dict(weights, t2d=torch.ones(target.vocab_size, dtype=torch.bool))
    with pytest.raises(Eagle3CheckpointError, match="t2d and d2t"):
        load(write_head(tmp_path / "t2d", head_config(target), bad_t2d))
    with pytest.raises(Eagle3CheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        bad_ids = head_config(target, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]})
        load(write_head(tmp_path / "ids", bad_ids, weights))


@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "qwen3"])
def test_targets_expose_aux_hidden_states(arch, tmp_path):
    """The residual stream entering the chosen layers, by reference (the tensors the layers consumed)."""
    config = ModelConfig.from_pretrained(make_tiny_model(arch, tmp_path), dtype="float32")
    model = load_model(config, device="cpu")
    seen: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    model.model.aux_layer_ids = (1, 0, 1)
    t = 6
    table = torch.tensor([[1, 2]])
    meta = AttentionMetadata([0, t], [t], [table.int()] * 2, [torch.arange(4, 4 + t)] * 2)
    for layer in model.modules():
        if hasattr(layer, "k_cache") and hasattr(layer, "kv_group"):
            layer.k_cache = torch.zeros(3, 4, config.num_kv_heads, config.head_dim)
            layer.v_cache = torch.zeros(3, 4, config.num_kv_heads, config.head_dim)
    with torch.no_grad():
        model(torch.arange(t), torch.arange(t), meta)
    aux = model.model.aux_hidden_states
    assert [a is seen[i] for a, i in zip(aux, (1, 0, 1))] == [True, True, True]
    assert aux[0].shape == (t, config.hidden_size)
