"""KV capacity with an FP8 KV cache vs the model's dtype, at a fixed pool size (CPU or GPU, offline engine).

    python benchmarks/bench_kv_fp8.py [--model PATH] [--pool-mib 4] [--requests 64] [--prompt-len 192]
                                      [--output-len 64] [--out bench_results/kv_fp8.json]

For each KV dtype (auto = the model's, fp8, then fp8 with the sliding-window layers kept in the model's dtype:
kv_cache_dtype_skip_layers sliding_window) the engine gets the same pool in bytes (--pool-mib, as
kv_cache_config.max_blocks = bytes / the layout's bytes per block) and the same workload: --requests random prompts
of --prompt-len tokens, each generating --output-len tokens (greedy, ignore_eos), all submitted at once with
max_batch_size = --requests. Reported per dtype: bytes per block, blocks and KV tokens in the pool, the peak number
of requests running at once (read after every step), preemptions, output tokens per second and wall time. The
capacity figures are deterministic; the speed figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from bench_record import write_record  # benchmarks/ is on sys.path when run as a script

from brisk import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "brisk" / "demo_model"


def bytes_per_block(model: str, kv: dict, options: dict) -> int:
    with LLM(model, kv_cache_config={"max_blocks": 2, **kv}, **options) as llm:
        return llm.engine.executor.runner.kv_layout.bytes_per_block


def run(model: str, kv: dict, pool_bytes: int, prompts: list[list[int]], output_len: int, options: dict) -> dict:
    """kv: the kv_cache_config's dtype (and dtype_skip_layers)."""
    per_block = bytes_per_block(model, kv, options)
    blocks = pool_bytes // per_block
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    with LLM(model, kv_cache_config={"max_blocks": blocks, **kv}, **options) as llm:
        engine = llm.engine
        peak = 0
        step = engine.step

        def counted_step():  # the benchmark's probe: requests running after each step
            nonlocal peak
            out = step()
            peak = max(peak, engine.stats().num_running)
            return out

        engine.step = counted_step  # type: ignore[method-assign]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        wall = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        runner = engine.executor.runner
        return {
            "kv_cache_dtype": kv["dtype"] + (" skip sliding" if kv.get("dtype_skip_layers") else ""),
            "stored_as": [str(d).removeprefix("torch.") for d in runner.kv_layout.kv_dtypes],
            "tokens_per_block": list(runner.block_sizes),
            "bytes_per_block": per_block,
            "blocks": blocks,
            "kv_tokens": (blocks - 1) * runner.block_sizes[0],  # of the first (full-attention) group: the context
            "peak_running": peak,
            "preemptions": engine.stats().num_preemptions,
            "output_tokens": generated,
            "output_tok_s": generated / wall,
            "wall_s": wall,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--pool-mib", type=float, default=4.0)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "bench_results" / "kv_fp8.json"))
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    max_seq_len = args.prompt_len + args.output_len
    options = dict(seed=0, max_batch_size=args.requests, max_seq_len=max_seq_len)
    pool_bytes = int(args.pool_mib * (1 << 20))
    kvs: list[dict] = [{"dtype": "auto"}, {"dtype": "fp8"}, {"dtype": "fp8", "dtype_skip_layers": ["sliding_window"]}]
    rows = [run(args.model, kv, pool_bytes, prompts, args.output_len, options) for kv in kvs]
    head = f"{'kv dtype':<18}{'stored as':<34}{'tok/block':>10}{'B/block':>9}{'blocks':>8}{'KV tokens':>11}"
    head += f"{'peak running':>14}"
    head += f"{'preempt':>9}{'out tok/s':>11}{'wall s':>9}"
    print(f"pool {args.pool_mib} MiB; {args.requests} requests x ({args.prompt_len} prompt + {args.output_len} out)")
    print(head)
    for r in rows:
        print(
            f"{r['kv_cache_dtype']:<18}{', '.join(r['stored_as']):<34}{'/'.join(map(str, r['tokens_per_block'])):>10}"
            f"{r['bytes_per_block']:>9,}{r['blocks']:>8,}"
            f"{r['kv_tokens']:>11,}{r['peak_running']:>14}{r['preemptions']:>9}{r['output_tok_s']:>11.1f}"
            f"{r['wall_s']:>9.1f}"
        )
    base = rows[0]
    for row in rows[1:]:
        print(
            f"{row['kv_cache_dtype']} / auto: KV tokens x{row['kv_tokens'] / base['kv_tokens']:.2f}, peak running "
            f"x{row['peak_running'] / max(1, base['peak_running']):.2f}"
        )
    write_record(args.out, args, rows=rows)


if __name__ == "__main__":
    main()
