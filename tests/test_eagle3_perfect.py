"""EAGLE3 with a perfect head: a target and a head built by hand so that every draft is right, so speculation
takes the full-accept path every step (k drafts plus the bonus token, the head's KV over all k + 1 verified
positions, drafts cut by max_tokens, a stop token inside an accepted run); the output must be token-identical to no
speculation with an acceptance rate of exactly 1 and every KV block free at the end.

The construction (one Llama layer, RoPE base 100): every token's embedding is [1, u_t, 0...] with u_t a random unit
vector in 31 dimensions, so RMSNorm leaves dimension 0 the same constant for every token. Queries and keys read only
that constant: with key = query rotated by one RoPE step, the attention score peaks at a distance of exactly one
position, by far (a hard "previous token" attention). Values read u_t, o_proj moves it to dimensions 32..62 and the
lm_head reads only those: the target's next token is f(previous token), f a permutation of an alphabet A.

The head does the same with its own attention over its own paged KV: at position p it reads token p + 1, attends to
position p - 1 (whose KV it wrote from token p) and predicts f(token p), the target's token at p + 2. It ignores the
target's hidden states (hidden_norm weight 0, norm_before_residual) and predicts over a draft vocabulary of A
through d2t. So a draft is right only if the head's KV at the previous position holds the right token at the right
position: after a full accept, the bonus token's KV (the last verified position) and the chained draft passes.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from brisk import LLM, SamplingParams
from tests.test_eagle3_model import write_head
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 4, 2, 16, 512
ROPE_BASE = 100.0
ALPHABET_SIZE = 100
K = 3
# Attention score per unit of the peak's margin (cos sums over the 8 RoPE frequencies: the peak beats every other
# distance up to 300 by 0.686): softmax leaks e^-40 to the other positions.
SCORE_SCALE = 60.0 / 0.686


def _unit_vectors(n: int, dim: int, g: torch.Generator) -> torch.Tensor:
    u = torch.randn(n, dim, generator=g)
    return u / u.norm(dim=-1, keepdim=True)


def _previous_token_qkv(in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v weights over a normed input whose dimension 0 is the constant sqrt(HIDDEN / 2) (embedding [1, u, 0]
    normed with weight 1): q . rope k peaks when the key is one position before the query; kv head 0's values are
    input dimensions 1..16, kv head 1's 17..31."""
    const = math.sqrt(HIDDEN / 2)
    half = HEAD_DIM // 2
    theta = ROPE_BASE ** (-torch.arange(half, dtype=torch.float64) / half)
    amp = math.sqrt(SCORE_SCALE * math.sqrt(HEAD_DIM))  # score = q.k / sqrt(d) = SCORE_SCALE * sum(cos)
    q_head = torch.zeros(HEAD_DIM, dtype=torch.float64)
    q_head[:half] = amp
    k_head = torch.cat([amp * theta.cos(), amp * theta.sin()])  # the query's pair rotated by one step
    q = torch.zeros(HEADS * HEAD_DIM, in_features)
    k = torch.zeros(KV_HEADS * HEAD_DIM, in_features)
    v = torch.zeros(KV_HEADS * HEAD_DIM, in_features)
    for h in range(HEADS):
        q[h * HEAD_DIM : (h + 1) * HEAD_DIM, 0] = (q_head / const).float()
    for h in range(KV_HEADS):
        k[h * HEAD_DIM : (h + 1) * HEAD_DIM, 0] = (k_head / const).float()
    v[:16, 1:17] = torch.eye(16)
    v[16:31, 17:32] = torch.eye(15)
    return q, k, v


def _o_proj() -> torch.Tensor:
    """Query head 0 (kv head 0) -> dimensions 32..47, query head 2 (kv head 1) -> 48..62; heads 1 and 3 unused."""
    o = torch.zeros(HIDDEN, HEADS * HEAD_DIM)
    o[32:48, 0:16] = torch.eye(16)
    o[48:63, 2 * HEAD_DIM : 2 * HEAD_DIM + 15] = torch.eye(15)
    return o


def _readout(u: torch.Tensor, f_inverse: list[int]) -> torch.Tensor:
    """lm_head rows reading dimensions 32..62: row j matches u of the token f maps to j."""
    rows = torch.zeros(len(f_inverse), HIDDEN)
    rows[:, 32:63] = u[f_inverse]
    return rows


@pytest.fixture(scope="module")
def perfect(tmp_path_factory):
    """(target path, head path, alphabet, f as a dict)."""
    root = tmp_path_factory.mktemp("perfect")
    g = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    alphabet = sorted(rng.sample(range(2, VOCAB), ALPHABET_SIZE))
    image = alphabet[:]
    rng.shuffle(image)
    f = dict(zip(alphabet, image))
    f_inverse = {b: a for a, b in f.items()}
    u = _unit_vectors(VOCAB, 31, g)

    path = make_tiny_model(
        "llama",
        root / "target",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_BASE},
    )
    make_tiny_tokenizer(path)
    weights = load_file(f"{path}/model.safetensors")
    embed = torch.zeros(VOCAB, HIDDEN)
    embed[:, 0] = 1.0
    embed[:, 1:32] = u
    q, k, v = _previous_token_qkv(HIDDEN)
    lm_head = torch.zeros(VOCAB, HIDDEN)  # tokens outside the alphabet score 0, below the winner's ~|u|^2 > 0
    lm_head[alphabet] = _readout(u, [f_inverse[t] for t in alphabet])
    layer = "model.layers.0."
    weights.update(
        {
            "model.embed_tokens.weight": embed,
            layer + "input_layernorm.weight": torch.ones(HIDDEN),
            layer + "self_attn.q_proj.weight": q,
            layer + "self_attn.k_proj.weight": k,
            layer + "self_attn.v_proj.weight": v,
            layer + "self_attn.o_proj.weight": _o_proj(),
            layer + "mlp.down_proj.weight": torch.zeros_like(weights[layer + "mlp.down_proj.weight"]),
            "model.norm.weight": torch.ones(HIDDEN),
            "lm_head.weight": lm_head,
        }
    )
    save_file(weights, f"{path}/model.safetensors")

    # The head: the same attention over [embedding, hidden] inputs (the hidden half has weight 0).
    hq, hk, hv = _previous_token_qkv(2 * HIDDEN)
    d2t = torch.tensor(alphabet) - torch.arange(ALPHABET_SIZE)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[alphabet] = True
    head_weights = {
        "fc.weight": torch.randn(HIDDEN, 3 * HIDDEN, generator=g),  # ignored: hidden_norm weight 0
        "midlayer.input_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.hidden_norm.weight": torch.zeros(HIDDEN),
        "midlayer.post_attention_layernorm.weight": torch.ones(HIDDEN),
        "midlayer.self_attn.q_proj.weight": hq,
        "midlayer.self_attn.k_proj.weight": hk,
        "midlayer.self_attn.v_proj.weight": hv,
        "midlayer.self_attn.o_proj.weight": _o_proj(),
        "midlayer.mlp.gate_proj.weight": torch.randn(32, HIDDEN, generator=g),
        "midlayer.mlp.up_proj.weight": torch.randn(32, HIDDEN, generator=g),
        "midlayer.mlp.down_proj.weight": torch.zeros(HIDDEN, 32),
        "norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": _readout(u, [f_inverse[t] for t in alphabet]),
        "d2t": d2t,
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": ROPE_BASE,
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "draft_vocab_size": ALPHABET_SIZE,
        "target_hidden_size": HIDDEN,
        "norm_before_residual": True,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 0], "use_aux_hidden_state": True},
    }
    head = write_head(root / "head", config, head_weights)
    return path, head, alphabet, f


def _run(path: str, head: str | None, prompts, params, **options):
    spec = {"method": "eagle3", "num_speculative_tokens": K, "model": head} if head else None
    with LLM(path, seed=0, speculative_config=spec, check_kv_invariants=True, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for kv in llm.engine.kv_managers:  # one per attention-DP rank
            assert kv.pool.num_used == 0
            kv.check_invariants()
        stats = llm.engine.stats()
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_tokens": 16, "tokens_per_block": 4},
        {"tp_size": 2, "enable_attention_dp": True},
        {"cuda_graph_config": {"batch_sizes": [1, 2, 4, 8]}},  # the static (CUDA graph) buffers: 5 requests pad to 8
    ],
    ids=["batched", "chunked-small-blocks", "attention-dp2", "graphs"],
)
def test_perfect_head_accepts_every_draft(perfect, options):
    path, head, alphabet, f = perfect
    rng = random.Random(11)
    prompts = [[rng.choice(alphabet) for _ in range(n)] for n in (2, 7, 13, 21, 30)]
    # max_tokens 1 + 4j + r: the last step's drafts are cut to what max_tokens leaves (r = 1..3), or none (r = 0)
    max_tokens = [12, 14, 15, 16, 9]
    # Request 3 stops on its 7th output token, in the middle of the run its second speculative step accepts.
    stop_at = 6
    expected = []
    for prompt, n in zip(prompts, max_tokens):
        seq = list(prompt)
        while len(seq) < len(prompt) + n:
            seq.append(f[seq[-2]] if len(seq) > 1 else f[seq[-1]])
        expected.append(seq[len(prompt) :])
    stop_token = expected[3][stop_at]
    assert stop_token not in expected[3][:stop_at]
    expected[3] = expected[3][: stop_at + 1]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop_token_ids=[stop_token] if i == 3 else [])
        for i, n in enumerate(max_tokens)
    ]

    if "tp_size" not in options:  # (two ranks: the same target, already checked against `expected` single-rank)
        plain, _ = _run(path, None, prompts, params, **options)
        assert plain == expected  # the construction: the target's next token is f(the token before the last)
    spec, stats = _run(path, head, prompts, params, **options)
    assert spec == expected
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens  # acceptance rate exactly 1
    # Every request's middle steps verify k drafts, all accepted: each request has full runs.
    assert stats.spec_accepted_per_pos[K - 1] >= len(prompts)
    # Fewer verifications than half the tokens: each full run emits k + 1 tokens.
    assert stats.spec_num_drafts < sum(len(o) for o in spec) / 2
