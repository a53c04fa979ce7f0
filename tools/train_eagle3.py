#!/usr/bin/env python
"""Train a tiny EAGLE3 draft head for a brisk model (by default the bundled demo model) on CPU, in minutes.

    .venv/bin/python tools/train_eagle3.py --out /tmp/demo-eagle3

1. Data: the target's own generations (brisk's offline engine), greedy and sampled, from varied prompts (common
   words as `brisk bench serve` sends them, chat-templated lines, the model's own samples).
2. Targets: a Hugging Face forward of each sequence gives the residual stream entering the head's three aux layers
   (vLLM's indexing: `hidden_states[j]`) and the target's argmax at every position.
3. Training: EAGLE3's layer (brisk's `Eagle3DraftModel`, the target's embedding shared and frozen), cross-entropy
   of the draft vs the target's next token, with EAGLE3's training-time test: pass j (0..k-1) feeds the previous
   pass's pre-norm output back in, attending the first pass's keys causally plus its own chain's, like drafting does.
4. Writes the head in the public layout (config.json + model.safetensors: fc, midlayer.*, norm, lm_head, d2t, t2d),
   then reports the held-out mean accepted length at k = --k (1 + the drafts matching the target's greedy tokens
   in a row, the tokens a verification step yields).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads crawl on shared cores
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from brisk.bench.workload import WORDS
from brisk.model_config import ModelConfig
from brisk.model_runner.loader import initialize_dummy_weights
from brisk.models.eagle3 import Eagle3Config, Eagle3DraftModel, default_aux_layer_ids

DEMO_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "brisk", "demo_model")
CHAT_LINES = [
    "Tell me of the king.",
    "What news from the court?",
    "Speak, my lord, what ails thee?",
    "Who goes there?",
    "Is this a dagger which I see before me?",
    "How fares the queen tonight?",
    "Wherefore art thou so sad?",
    "Give me thy hand, good friend.",
    "What say you to this love?",
    "Shall we to the battle?",
]


def prompts(tokenizer, rng: random.Random, n: int) -> list[list[int]]:
    """Token-id prompts: a third common words, a third chats, a third a few words to continue."""
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
            out.append(tokenizer.encode(text, add_special_tokens=False))
        elif kind == 1:
            line = rng.choice(CHAT_LINES) + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12)))
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": line}], add_generation_prompt=True, tokenize=False
            )
            out.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(rng.choice(CHAT_LINES).split()[0], add_special_tokens=False))
    return out


def generate(model_dir: str, prompt_ids: list[list[int]], max_tokens: int, seed: int) -> list[list[int]]:
    """prompt + the target's continuation, two thirds greedy, one third sampled (brisk's offline engine)."""
    from brisk.llm import LLM
    from brisk.sampling_params import SamplingParams

    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 3 else 1.0, seed=seed + i, ignore_eos=True)
        for i in range(len(prompt_ids))
    ]
    with LLM(model_dir, dtype="float32", disable_overlap_scheduler=True) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompt_ids, outs)]


@torch.no_grad()
def target_features(model_dir: str, seqs: list[list[int]], aux_ids: tuple[int, ...], length: int):
    """Right-padded [N, L] ids, [N, L, 3H] aux hidden states, [N, L] target argmax, [N, L] valid mask."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = len(seqs)
    ids = torch.zeros(n, length, dtype=torch.int64)
    valid = torch.zeros(n, length, dtype=torch.bool)
    for i, s in enumerate(seqs):
        s = s[:length]
        ids[i, : len(s)] = torch.tensor(s)
        valid[i, : len(s)] = True
    aux_all, best_all = [], []
    for a in range(0, n, 32):
        out = model(ids[a : a + 32], output_hidden_states=True)
        aux_all.append(torch.cat([out.hidden_states[j] for j in aux_ids], dim=-1))
        best_all.append(out.logits.argmax(-1))
    return ids, torch.cat(aux_all), torch.cat(best_all), valid


def ttt_forward(head: Eagle3DraftModel, ids: torch.Tensor, aux: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Draft logits [N, L, draft vocab] of passes 0..depth-1. Pass j at chain start s sits at position s + j, reads
    token ids[s + j + 1] and pass j-1's output at s, and attends the first pass's keys at positions <= s plus its
    own chain's keys of passes 1..j: what drafting j tokens after an accepted position s computes."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    n, length = ids.shape
    h_q, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    group = h_q // kvh
    hidden = head.fc(aux)  # [N, L, H]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    keys0 = values0 = None
    chain_k: list[torch.Tensor] = []
    chain_v: list[torch.Tensor] = []
    logits = []
    for j in range(depth):
        tokens = torch.roll(ids, -(j + 1), dims=1)  # token at position s + j + 1 (wraps past the end: masked)
        positions = (torch.arange(length) + j).repeat(n)
        x = torch.cat([layer.input_layernorm(head.embed(tokens)), layer.hidden_norm(hidden)], dim=-1)
        qkv = attn.qkv_proj(x).view(n * length, -1)
        qk, v = qkv.split([attn.q_size + attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb.rotate(positions, qk).split([attn.q_size, attn.kv_size], dim=-1)
        q = q.view(n, length, kvh, group, d)
        k = k.view(n, length, kvh, d)
        v = v.view(n, length, kvh, d)
        if j == 0:
            keys0, values0 = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        assert keys0 is not None and values0 is not None
        scale = d**-0.5
        scores0 = torch.einsum("nqhgd,nkhd->nhgqk", q, keys0) * scale
        scores0 = scores0.masked_fill(~causal, float("-inf"))
        diag = [torch.einsum("nqhgd,nqhd->nhgq", q, ck)[..., None] * scale for ck in chain_k]
        probs = torch.softmax(torch.cat([scores0, *diag], dim=-1), dim=-1)
        out = torch.einsum("nhgqk,nkhd->nqhgd", probs[..., :length], values0)
        for i, cv in enumerate(chain_v):
            out = out + probs[..., length + i].permute(0, 3, 1, 2)[..., None] * cv[:, :, :, None, :]
        residual = layer.hidden_norm(hidden) if layer.norm_before_residual else hidden
        residual = residual + attn.o_proj(out.reshape(n, length, h_q * d))
        hidden = residual + layer.mlp(layer.post_attention_layernorm(residual))
        logits.append(head.compute_draft_logits(head.norm(hidden)))
    return logits


def pass_labels(best: torch.Tensor, valid: torch.Tensor, j: int, t2d_index: torch.Tensor) -> torch.Tensor:
    """Draft-vocab label of pass j at chain start s: the target's argmax at position s + j + 1 (-100: none)."""
    labels = torch.roll(best, -(j + 1), dims=1)
    ok = torch.roll(valid, -(j + 2), dims=1) & valid  # the next token is a real one (no wrap, no padding)
    ok[:, best.shape[1] - (j + 2) :] = False
    draft = t2d_index[labels]
    return torch.where(ok & (draft >= 0), draft, torch.full_like(draft, -100))


def mean_accepted_length(head, ids, aux, best, valid, k, t2d_index, prompt_lens) -> float:
    """1 + the leading drafts equal to the target's greedy tokens, averaged over the positions of generated text."""
    with torch.no_grad():
        logits = ttt_forward(head, ids, aux, k)
    d2t = head.d2t
    accepted = torch.ones(ids.shape, dtype=torch.bool)
    total = torch.zeros(ids.shape)
    for j in range(k):
        labels = torch.roll(best, -(j + 1), dims=1)
        guess = logits[j].argmax(-1)
        accepted &= (guess + d2t[guess]) == labels
        total += accepted.float()
    mask = valid.clone()
    mask[:, ids.shape[1] - (k + 1) :] = False
    for i, p in enumerate(prompt_lens):
        mask[i, : max(p - 1, 0)] = False  # only where the target generates (the positions drafting happens at)
    return 1.0 + float(total[mask].mean())


def write_checkpoint(head: Eagle3DraftModel, config: dict, out: str, t2d: torch.Tensor) -> None:
    from safetensors.torch import save_file

    attn = head.midlayer.self_attn
    tensors: dict[str, torch.Tensor] = {}
    for name, param in head.named_parameters():
        p = param.detach().contiguous()
        if ".qkv_proj." in name:
            q, k, v = p.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
            for part, t in (("q", q), ("k", k), ("v", v)):
                tensors[name.replace(".qkv_proj.", f".{part}_proj.")] = t.contiguous()
        elif ".gate_up_proj." in name:
            gate, up = p.chunk(2, dim=0)
            tensors[name.replace(".gate_up_proj.", ".gate_proj.")] = gate.contiguous()
            tensors[name.replace(".gate_up_proj.", ".up_proj.")] = up.contiguous()
        else:
            tensors[name] = p
    tensors["d2t"] = head.d2t.clone()
    tensors["t2d"] = t2d
    os.makedirs(out, exist_ok=True)
    save_file(
        {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in tensors.items()},
        os.path.join(out, "model.safetensors"),
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEMO_MODEL, help="the target model directory")
    ap.add_argument("--out", required=True, help="where the head goes (config.json + model.safetensors)")
    ap.add_argument("--sequences", type=int, default=480)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--length", type=int, default=160, help="training window (tokens per sequence)")
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ttt", type=int, default=3, help="training-time-test depth (drafting passes trained)")
    ap.add_argument("--k", type=int, default=3, help="draft length of the reported mean accepted length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t0 = time.time()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    target = ModelConfig.from_pretrained(args.model, dtype="float32")
    aux_ids = default_aux_layer_ids(target.num_layers)
    if len(set(aux_ids)) < 3:  # the default picks repeats on a model this shallow: low, middle, high instead
        aux_ids = (1, target.num_layers // 2, target.num_layers - 1)
    prompt_ids = prompts(tokenizer, rng, args.sequences)
    seqs = generate(args.model, prompt_ids, args.gen_tokens, args.seed)
    print(f"generated {len(seqs)} sequences ({sum(map(len, seqs))} tokens) in {time.time() - t0:.0f} s", flush=True)
    ids, aux, best, valid = target_features(args.model, seqs, aux_ids, args.length)
    prompt_lens = [len(p) for p in prompt_ids]

    # Draft vocabulary: the target's most frequent next tokens (d2t: draft id -> target id offset, t2d: membership).
    counts = torch.bincount(best[valid], minlength=target.vocab_size)
    keep = torch.sort(torch.topk(counts, args.draft_vocab).indices).values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[keep] = True
    t2d_index = torch.full((target.vocab_size,), -1, dtype=torch.int64)
    t2d_index[keep] = torch.arange(args.draft_vocab)
    coverage = float(counts[keep].sum()) / float(counts.sum())

    hf = target.hf_config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "target_hidden_size": target.hidden_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": float(getattr(hf, "rms_norm_eps", 1e-5)),
        "max_position_embeddings": target.max_position_embeddings,
        "rope_parameters": dict(getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e4}),
        "vocab_size": target.vocab_size,
        "draft_vocab_size": args.draft_vocab,
        "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True},
        "torch_dtype": "bfloat16",
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f)
    cfg = Eagle3Config.from_pretrained(args.out, target)
    head = Eagle3DraftModel(cfg, own_embedding=False)
    initialize_dummy_weights(head, seed=args.seed)
    head.d2t.copy_(keep - torch.arange(args.draft_vocab))
    from transformers import AutoModelForCausalLM

    from brisk.layers.embedding import VocabParallelEmbedding

    hf_embedding = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).get_input_embeddings()
    embedding = VocabParallelEmbedding(target.vocab_size, target.hidden_size)
    embedding.weight.data.copy_(hf_embedding.state_dict()["weight"])
    head.share_embedding(embedding)  # frozen: not a parameter of the head

    n = ids.shape[0]
    held_out = max(16, n // 10)
    train = torch.arange(held_out, n)
    params = [p for p in head.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    labels_by_pass = [pass_labels(best, valid, j, t2d_index) for j in range(args.ttt)]
    head.train()
    for step in range(args.steps):
        rows = train[torch.randint(len(train), (args.batch,))]
        logits = ttt_forward(head, ids[rows], aux[rows], args.ttt)
        loss = torch.zeros(())
        for j, lg in enumerate(logits):  # EAGLE3's weights: later passes count less
            loss = loss + 0.8**j * F.cross_entropy(
                lg.flatten(0, 1), labels_by_pass[j][rows].flatten(), ignore_index=-100
            )
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  ({time.time() - t0:.0f} s)", flush=True)
    head.eval()
    for p in params:
        p.requires_grad_(False)
    ev = torch.arange(held_out)
    tau = mean_accepted_length(
        head, ids[ev], aux[ev], best[ev], valid[ev], args.k, t2d_index, [prompt_lens[i] for i in ev.tolist()]
    )
    write_checkpoint(head, config, args.out, t2d)
    summary = {
        "mean_accepted_length": round(tau, 3),
        "k": args.k,
        "draft_vocab_coverage": round(coverage, 4),
        "aux_layer_ids": list(aux_ids),
        "sequences": n,
        "seconds": round(time.time() - t0, 1),
        "out": args.out,
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
