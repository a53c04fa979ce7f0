"""EAGLE3 speculation end to end: greedy outputs with a random EAGLE3 head (which rejects almost everything) are
token-identical to no speculation on tiny Llama, gpt-oss and Qwen3, under batching, chunked prefill, preemption,
prefix hits, TP 2 and attention DP 2, with every KV block free at the end; and the drafts the engine proposes are
exactly what a dense EAGLE3 reference computes from the target's hidden states (the draft KV, EAGLE's token shift
and the chained passes are right). The perfect head (every draft accepted) is test_eagle3_perfect.py."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from brisk import LLM, SamplingParams
from tests.test_eagle3_model import HEAD_DIM, HEADS, KV_HEADS, head_config, head_weights, rms, rope, write_head
from tests.test_spec_graphs import record_static_steps
from tests.tiny_models import hf_reference, make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

MAX_NEW = 10
K = 3


@pytest.fixture(scope="module", params=["llama", "gpt_oss"])
def tiny(request, tmp_path_factory):
    """A tiny target and a random EAGLE3 head for it (public layout), built once per architecture."""
    from brisk.model_config import ModelConfig

    root = tmp_path_factory.mktemp(request.param)
    path = make_tiny_model(request.param, root / "target", seed=0)
    make_tiny_tokenizer(path)
    target = ModelConfig.from_pretrained(path, dtype="float32")
    weights = head_weights(target, seed=5)
    aux = [1, target.num_layers // 2, target.num_layers - 1]
    config = head_config(target, eagle_config={"eagle_aux_hidden_state_layer_ids": aux})
    head = write_head(root / "head", config, weights)
    return request.param, path, head, weights, aux


def _prompts(n: int = 6) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, 512) for _ in range(length)] for length in (5, 11, 17, 23, 9, 30)[:n]]


def _generate(path: str, head: str | None, repeat: bool = False, **options):
    """Greedy outputs of the six prompts batched (`repeat`: then again, from the prefix cache), and the draft tokens
    the engine verified."""
    spec = {"method": "eagle3", "num_speculative_tokens": K, "model": head} if head else None
    with LLM(path, seed=0, speculative_config=spec, check_kv_invariants=True, **options) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        outs = llm.generate(prompts, params)
        if repeat:
            outs += llm.generate(prompts, params)
            assert llm.engine.kv.prefix_hits > 0
        for kv in llm.engine.kv_managers:  # one per attention-DP rank
            assert kv.pool.num_used == 0
            kv.check_invariants()
        stats = llm.engine.stats()
        preemptions = llm.engine.scheduler.num_preemptions
    return [o.outputs[0].token_ids for o in outs], stats.spec_num_draft_tokens, preemptions


TP2 = {"tp_size": 2}  # two ranks on gloo: the head sharded like the target, every rank drafting
# Attention DP on two ranks: each drafts for its own requests with its own draft KV; gpt-oss's MoE gathers the
# ranks' tokens (a rank with fewer requests or none still runs its part); small budget and blocks.
DP2 = {"tp_size": 2, "enable_attention_dp": True, "max_num_tokens": 12, "tokens_per_block": 4}
CHUNKED = {"max_num_tokens": 12, "tokens_per_block": 4}
PREEMPT = {"tokens_per_block": 4, "kv_cache_config": {"max_blocks": 24}}
PREFIX = {"tokens_per_block": 4, "repeat": True}  # the second round hits the prefix cache
# FP8 full attention in blocks of 16 tokens beside fp32 sliding windows in blocks of 4: the head's KV in the full
# group's blocks, on two attention-DP ranks, chunked, then again from the prefix cache.
FP8_SKIP_SLIDING_DP2 = {
    **DP2,
    "kv_cache_dtype": "fp8",
    "kv_cache_dtype_skip_layers": ["sliding_window"],
    "repeat": True,
}


@pytest.mark.parametrize(
    "tiny, options",
    [
        ("llama", TP2),
        ("gpt_oss", DP2),
        ("llama", CHUNKED),
        ("llama", PREFIX),
        ("gpt_oss", PREEMPT),
        ("qwen3", {}),
        ("gpt_oss", FP8_SKIP_SLIDING_DP2),
    ],
    ids=[
        "llama-tp2",
        "gpt_oss-dp2",
        "llama-chunked",
        "llama-prefix",
        "gpt_oss-preempt",
        "qwen3-batch",
        "gpt_oss-fp8-skip-sliding-dp2",
    ],
    indirect=["tiny"],
)
def test_greedy_identity_with_random_head(tiny, options):
    _, path, head, _, _ = tiny
    single_rank = {k: v for k, v in options.items() if k not in ("tp_size", "enable_attention_dp")}
    plain, _, _ = _generate(path, None, **single_rank)
    spec, num_drafts, preemptions = _generate(path, head, **options)
    assert spec == plain
    assert num_drafts > 0
    if options is PREEMPT:
        assert preemptions > 0


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_bad_head_is_a_startup_error_naming_the_key(tiny, tmp_path):
    from brisk.config import ConfigError

    _, path, _, _, _ = tiny
    bad = {"method": "eagle3", "num_speculative_tokens": K, "model": str(tmp_path / "nowhere")}
    with pytest.raises(ConfigError, match="speculative_model_dir.*not a directory"):
        LLM(path, seed=0, speculative_config=bad)


# ---- the drafts themselves, against a dense reference ------------------------------------------------------


def reference_drafts(w, embed, tokens: list[int], aux: torch.Tensor, k: int) -> list[int]:
    """Draft k tokens after `tokens` (aux: the target's [3, N, H] hidden states at positions 0..N-1) the way EAGLE3
    defines it: position p reads token p + 1 and fc(aux at p); then each draft with the previous output."""
    n = len(tokens)
    ids = torch.tensor(tokens[1:])  # positions 0..n-2
    h = torch.cat(list(aux[:, : n - 1]), -1) @ w["fc.weight"].T
    keys, values = [], []
    rep = HEADS // KV_HEADS

    def layer(ids_, h_, pos):
        x = torch.cat(
            [rms(embed[ids_], w["midlayer.input_layernorm.weight"]), rms(h_, w["midlayer.hidden_norm.weight"])], -1
        )
        t = len(ids_)
        q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, HEADS, HEAD_DIM), pos)
        keys.append(rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM), pos))
        values.append((x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM))
        kk, vv = torch.cat(keys), torch.cat(values)
        mask = torch.arange(len(kk))[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            kk.repeat_interleave(rep, 1).transpose(0, 1),
            vv.repeat_interleave(rep, 1).transpose(0, 1),
            attn_mask=mask,
        )
        r = h_ + o.transpose(0, 1).reshape(t, -1) @ w["midlayer.self_attn.o_proj.weight"].T
        m = rms(r, w["midlayer.post_attention_layernorm.weight"])
        mlp = F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)
        out = r + mlp @ w["midlayer.mlp.down_proj.weight"].T
        best = (rms(out, w["norm.weight"]) @ w["lm_head.weight"].T).argmax(-1)
        return out, best + w["d2t"][best]

    out, guess = layer(ids, h, torch.arange(n - 1))
    drafts = [int(guess[-1])]
    h_last = out[-1:]
    for j in range(1, k):
        h_last, guess = layer(torch.tensor([drafts[-1]]), h_last, torch.tensor([n - 2 + j]))
        drafts.append(int(guess[-1]))
    return drafts


# graphs: decode and verify steps on the static (CUDA graph) buffers, three requests padded to four; the drafter reads
# the step's own metadata and aux hidden states from them.
LAYOUTS = {"whole": {}, "chunked": {"max_num_tokens": 8}, "graphs": {"cuda_graph_config": {"batch_sizes": [1, 2, 4]}}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_drafts_match_dense_reference(tiny, layout):
    """Chunked: the long prompt's first chunks sample nothing, yet the draft KV must cover them."""
    arch, path, head, weights, aux_ids = tiny
    spec = {"method": "eagle3", "num_speculative_tokens": K, "model": head}
    llm = LLM(path, seed=0, speculative_config=spec, **LAYOUTS[layout])
    graphs = llm.engine.executor.runner.graphs
    assert (graphs is not None) == (layout == "graphs")
    if graphs is not None:
        shapes = record_static_steps(graphs)
    proposer = llm.engine.executor.runner.drafter.proposer
    recorded: list[tuple[list[int], list[int]]] = []
    original = proposer.propose

    def recording(inputs):
        proposal = original(inputs)
        for row, n, drafts in zip(inputs.rows.tolist(), inputs.num_tokens.tolist(), proposal.token_ids):
            recorded.append((inputs.token_ids[row, :n].tolist(), list(drafts)))
        return proposal

    proposer.propose = recording
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # chunked: 30 tokens alone; else batched
    prompts = [_prompts()[-1]] if layout == "chunked" else _prompts(3 if layout == "graphs" else 2)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert len(recorded) >= 4
    if graphs is not None:
        assert any(b == 3 and padded == 4 and t == K + 1 for b, padded, t in shapes), shapes
    hf = hf_reference(path)
    embed = hf.get_input_embeddings().weight.detach()
    with torch.no_grad():
        for tokens, drafts in recorded:
            hidden = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            aux = torch.stack([hidden[j][0] for j in aux_ids])
            assert drafts == reference_drafts(weights, embed, tokens, aux, K), (arch, len(tokens))


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_serve_with_eagle3(tiny):
    """`brisk serve --speculative-config '{"method": "eagle3", ...}'`: greedy text as without speculation, plain
    and streamed, and the draft counters in /metrics."""
    import json

    import httpx

    from tests.server_utils import RunningServer

    _, path, head, _, _ = tiny
    prompt = _prompts()[1]
    plain_llm = LLM(path, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    want = plain_llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].text
    plain_llm.close()
    spec = json.dumps({"method": "eagle3", "num_speculative_tokens": K, "model": head})
    server = RunningServer(path, "--speculative-config", spec)
    try:
        body = {"model": path, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want
        streamed = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed.extend(c["text"] for c in json.loads(line[6:])["choices"])
        assert "".join(streamed) == want
        metrics = server.metrics()
        drafts = sum(v for k, v in metrics.items() if k.startswith("brisk:spec_decode_num_draft_tokens"))
        assert drafts > 0
    finally:
        assert server.stop() == 0
