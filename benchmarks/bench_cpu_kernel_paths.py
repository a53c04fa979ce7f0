"""Offline decode throughput on CPU for each `cpu_kernels` path: the avx512 and avx2 builds of brisk's C kernels
(those this CPU runs) and the PyTorch ops (`torch`), on the demo model and the side-by-side gpt-oss.

    python benchmarks/bench_cpu_kernel_paths.py [--models demo gptoss-bf16] [--paths avx512 avx2 torch]
        [--dtypes auto float32] [--batch 1 8 32] [--output-len 64] [--threads 1] [--out paths.json]

To see what an AVX2-only CPU runs on an AVX-512 one, limit torch and oneDNN to AVX2 as well (their own variables,
read by them at start-up) and take that CPU's dtype, fp32 (`auto` is bf16 only where the CPU has native bf16):
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_cpu_kernel_paths.py \
        --paths avx2 torch --dtypes float32

Each point: `LLM.generate` of `batch` four-token prompts, `output-len` greedy tokens each (ignore_eos), timed after
a warm-up generate at the same batch; tok/s = output tokens / seconds (prefill of 4 tokens included). One run per
point: on a shared machine read ratios to one decimal; the table also gives tok/s per second of this process's CPU
time (in brackets; with one thread, what the run computed while it held a core). The gpt-oss models are written once into --models-dir by
benchmarks/make_compare_models.py's writer (random weights, the side-by-side shape). The greedy tokens of every
path are compared with the torch path's and the agreement printed (bf16 paths may part after a near tie).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from brisk import LLM, SamplingParams
from brisk.host import cpu_info, cpu_kernel_isas

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_compare_models import DEMO_MODEL, write_gptoss


def model_path(name: str, models_dir: Path) -> str:
    if name == "demo":
        return str(DEMO_MODEL)
    dtype = {"gptoss-bf16": "bfloat16", "gptoss-fp32": "float32"}[name]
    path = models_dir / name
    if not (path / "config.json").exists():
        write_gptoss(path, dtype)
    return str(path)


def run(llm: LLM, batch: int, output_len: int) -> tuple[float, float, list[list[int]]]:
    """(tok/s of wall time, tok/s of this process's CPU time, the tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 50 for j in range(4)]} for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return batch * output_len / wall, batch * output_len / cpu, [o.outputs[0].token_ids for o in outs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["demo", "gptoss-bf16"])
    p.add_argument("--paths", nargs="+", default=[*cpu_kernel_isas(), "torch"])
    p.add_argument("--dtypes", nargs="+", default=["auto"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models-dir", type=Path, default=Path("bench_results/models"))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models:
        path = model_path(model, args.models_dir)
        for dtype_option in args.dtypes:
            tokens: dict[tuple[str, int], list[list[int]]] = {}
            block = []
            for kernels in args.paths:
                llm = LLM(path, cpu_kernels=kernels, dtype=dtype_option, max_batch_size=max(args.batch), seed=0)
                dtype = str(llm.engine.model_config.dtype).removeprefix("torch.")
                for batch in args.batch:
                    tok_s, cpu_tok_s, tokens[kernels, batch] = run(llm, batch, args.output_len)
                    speed = dict(tok_s=round(tok_s, 1), cpu_tok_s=round(cpu_tok_s, 1))
                    block.append(dict(model=model, dtype=dtype, cpu_kernels=kernels, batch=batch, **speed))
                    print(f"{model:12s} {dtype:9s} {kernels:7s} batch {batch:3d}: {speed}", flush=True)
                llm.close()
            for row in block:
                if ("torch", row["batch"]) in tokens:
                    ours, ref = tokens[row["cpu_kernels"], row["batch"]], tokens["torch", row["batch"]]
                    row["same_tokens_as_torch"] = sum(a == b for a, b in zip(ours, ref)) / len(ref)
            rows.append(block)
    print(
        "\n| model | dtype | batch | "
        + " | ".join(f"{k} tok/s" for k in args.paths)
        + " | same greedy tokens as torch |"
    )
    print("|---|---|---:|" + "---:|" * len(args.paths) + "---|")
    for block in rows:
        for batch in args.batch:
            cells = {r["cpu_kernels"]: r for r in block if r["batch"] == batch}
            first = cells[args.paths[0]]
            speeds = " | ".join(f"{cells[k]['tok_s']:,.0f} ({cells[k]['cpu_tok_s']:,.0f})" for k in args.paths)
            same = ", ".join(
                f"{k} {cells[k]['same_tokens_as_torch']:.0%}"
                for k in args.paths
                if k != "torch" and "same_tokens_as_torch" in cells[k]
            )
            print(f"| {first['model']} | {first['dtype']} | {batch} | {speeds} | {same} |")
    if args.out:
        record = dict(
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            machine=dict(cpu=cpu_info().model_name, cpu_count=torch.get_num_threads(), platform=platform.platform()),
            command=" ".join(sys.argv),
            rows=[row for block in rows for row in block],
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
