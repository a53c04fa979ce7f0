"""The host KV tier on a multi-turn workload: prompt tokens recomputed and mean TTFT with it and without, one run.

    python benchmarks/bench_host_tier.py [--model PATH] [--conversations 16] [--turns 8] [--first-len 256]
                                         [--user-len 64] [--output-len 32] [--max-batch-size 4]
                                         [--pool-fraction 0.25] [--host-cache-mib 256] [--load-format auto|dummy]
                                         [--out bench_results/host_tier.json]

Conversations resend their growing history every turn (the previous prompt, the model's answer, a new user
message: token ids, greedy, fixed answer length), all conversations of a turn submitted at once. The device KV pool
(`kv_cache_config.max_blocks`) holds --pool-fraction of the last turn's history (never less than a full batch
needs), so by the time a conversation comes back its prefix has been evicted. Two engines run the same workload in
one process, the turns interleaved (A's turn t, then B's): without the host tier (evicted prefixes are recomputed)
and with `kv_cache_config.host_cache_size` (they are copied back). TTFT is arrival to first token, queueing
included (the batch holds --max-batch-size requests). Prints a table and writes it as JSON, with the share of
requests whose outputs the two engines agree on: all of them on a CPU in fp32; on a GPU in bf16 a copied-back block
and a recomputed one can differ in their last bits (other batch shapes), so a near-tie may go the other way.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from bench_record import write_record  # benchmarks/ is on sys.path when run as a script

from brisk import LLM, SamplingParams
from brisk.engine.messages import EngineCoreRequest
from brisk.kv_cache.manager import cdiv

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "brisk" / "demo_model"


class Conversations:
    def __init__(self, n: int, first_len: int, user_len: int, vocab: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.user_len, self.vocab = user_len, vocab
        self.histories = [self._words(first_len) for _ in range(n)]

    def _words(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab - 10) for _ in range(n)]

    def next_prompts(self) -> list[list[int]]:
        return [h + self._words(self.user_len) for h in self.histories]


def run_turn(llm: LLM, name: str, turn: int, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One turn on an engine: every conversation's request at once; per request its TTFT, cached tokens, tokens."""
    core = llm.engine
    start = time.perf_counter()
    ids = [f"{name}-{turn}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        core.add_request(EngineCoreRequest(rid, prompt, params))
    ttft: dict[str, float] = {}
    cached: dict[str, int] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            if out.new_token_ids and out.request_id not in ttft:
                ttft[out.request_id] = time.perf_counter() - start
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                cached[out.request_id] = out.num_cached_tokens
    return {
        "seconds": time.perf_counter() - start,
        "ttft": [ttft[r] for r in ids],
        "prompt_tokens": sum(len(p) for p in prompts),
        "cached_tokens": sum(cached[r] for r in ids),
        "outputs": [tokens[r] for r in ids],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--first-len", type=int, default=256)
    parser.add_argument("--user-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--pool-fraction", type=float, default=0.25)
    parser.add_argument("--host-cache-mib", type=float, default=256)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--load-format", default="auto", help="dummy: random weights of the model's config")
    parser.add_argument("--out", default="bench_results/host_tier.json")
    args = parser.parse_args()

    final_len = args.first_len + args.turns * (args.user_len + args.output_len)
    # Blocks of the last turn's history; a sliding-window group holds only its window, so this overcounts a little
    # (full-attention blocks per conversation, twice for a model with two groups, is the bound used).
    probe = LLM(  # only read: the layer groups and the vocabulary (no graphs captured for it on a GPU)
        args.model,
        max_seq_len=final_len + 8,
        kv_cache_config={"max_blocks": 8},
        load_format=args.load_format,
        cuda_graph_config=None,
        max_batch_size=1,
    )
    groups = len(probe.engine.kv.groups)
    vocab = probe.engine.model_config.vocab_size
    probe.shutdown()
    per_conversation = groups * cdiv(final_len, args.block_size)
    history_blocks = per_conversation * args.conversations
    pool = max(int(history_blocks * args.pool_fraction), per_conversation * args.max_batch_size + 1)
    common = dict(
        max_seq_len=final_len + 8,
        load_format=args.load_format,
        max_batch_size=args.max_batch_size,
        kv_cache_config={"max_blocks": pool, "tokens_per_block": args.block_size},
    )
    host_bytes = int(args.host_cache_mib * 2**20)
    engines = {
        "device pool only": LLM(args.model, **common),
        "with host tier": LLM(
            args.model, **{**common, "kv_cache_config": {**common["kv_cache_config"], "host_cache_size": host_bytes}}
        ),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    conversations = {
        name: Conversations(args.conversations, args.first_len, args.user_len, vocab, 0) for name in engines
    }
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for name, llm in engines.items():  # untimed: first launches (kernel variants, allocator growth) on both alike
        warm = Conversations(2, args.first_len, args.user_len, vocab, 1)
        run_turn(llm, f"{name}-warm-up", 0, warm.next_prompts(), params)
    for turn in range(args.turns):
        # interleaved, in alternating order: the machine's load drift and the one going first hit both alike
        order = list(engines.items()) if turn % 2 == 0 else list(reversed(engines.items()))
        for name, llm in order:
            conv = conversations[name]
            prompts = conv.next_prompts()
            r = run_turn(llm, name, turn, prompts, params)
            results[name].append(r)
            for h, p, out in zip(conv.histories, prompts, r["outputs"]):
                h[:] = p + out
    rows = []
    for name, llm in engines.items():
        turns = results[name]
        ttfts = [t for r in turns for t in r["ttft"]]
        later = [t for r in turns[1:] for t in r["ttft"]]  # turns that resend a history
        stats = llm.engine.stats()
        prompt = sum(r["prompt_tokens"] for r in turns)
        cached = sum(r["cached_tokens"] for r in turns)
        rows.append(
            {
                "config": name,
                "prompt_tokens": prompt,
                "recomputed_tokens": prompt - cached,
                "host_hit_tokens": stats.host_hits,
                "mean_ttft_s": statistics.fmean(ttfts),
                "mean_ttft_later_turns_s": statistics.fmean(later) if later else None,
                "total_s": sum(r["seconds"] for r in turns),
                "bytes_to_host": stats.host_bytes_to_host,
                "bytes_to_device": stats.host_bytes_to_device,
            }
        )
        llm.shutdown()
    pairs = [
        (a, b)
        for turn_a, turn_b in zip(results["device pool only"], results["with host tier"])
        for a, b in zip(turn_a["outputs"], turn_b["outputs"])
    ]
    agreeing = sum(a == b for a, b in pairs) / len(pairs)
    identical = agreeing == 1.0
    base, tier = rows
    print(
        f"{args.conversations} conversations x {args.turns} turns, last turn {final_len} tokens each; device pool "
        f"{pool} blocks of {args.block_size} (~{pool / history_blocks:.0%} of the last turn's history); outputs "
        f"identical: {identical}"
    )
    header = f"{'config':<18} {'prompt tok':>10} {'recomputed':>10} {'host hits':>10} {'mean TTFT':>10} {'TTFT t>1':>10} {'total s':>8}"
    print(header)
    for r in rows:
        later = r["mean_ttft_later_turns_s"]
        print(
            f"{r['config']:<18} {r['prompt_tokens']:>10} {r['recomputed_tokens']:>10} {r['host_hit_tokens']:>10} "
            f"{r['mean_ttft_s'] * 1000:>8.1f}ms {(later or 0) * 1000:>8.1f}ms {r['total_s']:>8.2f}"
        )
    print(
        f"with the host tier: {tier['recomputed_tokens'] / base['recomputed_tokens']:.2f}x the prompt tokens "
        f"recomputed, mean TTFT {tier['mean_ttft_s'] / base['mean_ttft_s']:.2f}x"
    )
    write_record(
        args.out,
        args,
        device_pool_blocks=pool,
        history_blocks=history_blocks,
        outputs_identical=identical,
        outputs_agreeing=agreeing,
        rows=rows,
    )


if __name__ == "__main__":
    main()
