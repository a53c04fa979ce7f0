"""Decode with penalties on CPU: what the sampling stage costs a step when requests carry repetition / presence /
frequency penalties (their history is read every step), against the same requests without penalties.

    python benchmarks/bench_penalties.py [--batch 32] [--prompt-len 1500] [--output-len 64] [--out p.json]

The bundled demo model (a tiny gpt-oss, bf16), one engine; per case, greedy decoding of `--batch` prompts of
`--prompt-len` tokens: the wall time of the generate call, and the median of the sampling stage's own time per
decode step (`SamplingStage.pick`, the prefill steps left out), over `--rounds` rounds (the best round).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import brisk
from brisk import LLM, SamplingParams

CASES = {
    "no penalties": {},
    "repetition_penalty 1.1": {"repetition_penalty": 1.1},
    "presence + frequency 0.5": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=1500)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    demo = str(Path(brisk.__file__).parent / "demo_model")
    prompts = [
        {"prompt_token_ids": [(i * 7 + t) % 4000 + 1 for t in range(args.prompt_len)]} for i in range(args.batch)
    ]
    rows = []
    max_seq_len = args.prompt_len + args.output_len + 8
    with LLM(demo, max_seq_len=max_seq_len, max_batch_size=args.batch, max_num_tokens=8192) as llm:
        stage = llm.engine.executor.runner.sampling
        pick = stage.pick
        times: list[tuple[bool, float]] = []

        def timed(logits, sched, step, *rest):
            start = time.perf_counter()
            out = pick(logits, sched, step, *rest)
            times.append((bool(step.decode_only), time.perf_counter() - start))
            return out

        stage.pick = timed
        for name, penalties in CASES.items():
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, **penalties)
            best = None
            for _ in range(args.rounds):
                times.clear()
                start = time.perf_counter()
                llm.generate(prompts, params)
                wall = time.perf_counter() - start
                decode = [s for decode_only, s in times if decode_only]
                result = (wall, statistics.median(decode) if decode else float("nan"))
                best = result if best is None or result[0] < best[0] else best
            assert best is not None
            rows.append({"case": name, "wall_s": best[0], "pick_ms_per_decode_step": best[1] * 1e3})
    print(f"{'case':<28} {'wall s':>8} {'sampling ms / decode step':>26}")
    for row in rows:
        print(f"{row['case']:<28} {row['wall_s']:>8.3f} {row['pick_ms_per_decode_step']:>26.3f}")
    if args.out:
        meta = dict(vars(args), date=datetime.now(timezone.utc).isoformat(timespec="seconds"), cpu=platform.processor())
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
