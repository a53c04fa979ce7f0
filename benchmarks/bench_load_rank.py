"""Loading one rank of a tensor-parallel gpt-oss job on the CPU: seconds per rank, page cache warm.

    python benchmarks/bench_load_rank.py [--layers 4] [--tp 1 2 4 8] [--repeats 3] [--model-dir /tmp/brisk_load]
                                         [--out bench_results/load_rank.json]

Writes (once, into --model-dir) a checkpoint of gpt-oss-20b's shapes cut to --layers layers, in the public MXFP4
layout (tests/gpt_oss_checkpoint.py), loads it once to warm the page cache (disk speed is out of it), then loads
rank 0 of each --tp layout (attention, dense and MoE weights split tp ways; MoE by intermediate size, with MXFP4
padding where 2,880 does not split into blocks of 32) --repeats times. Prints the best seconds per layout and
writes them as JSON; run it at two commits for a before / after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from brisk.model_config import ModelConfig, ParallelConfig  # noqa: E402
from brisk.model_runner.loader import load_model  # noqa: E402
from tests.gpt_oss_checkpoint import write_gpt_oss_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", default="/tmp/brisk_load")
    parser.add_argument("--out", default="bench_results/load_rank.json")
    args = parser.parse_args()
    path = write_gpt_oss_checkpoint(Path(args.model_dir) / f"gpt-oss-20b-{args.layers}l", num_layers=args.layers)
    config = ModelConfig.from_pretrained(str(path))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    load_model(config, device="cpu")  # the files into the page cache
    rows = []
    for tp in args.tp:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            load_model(config, device="cpu", parallel=ParallelConfig.for_rank(0, tp))
            times.append(time.perf_counter() - start)
        rows.append({"tp": tp, "seconds": round(min(times), 3)})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    print(f"gpt-oss-20b shapes, {args.layers} layers ({size / 1e9:.2f} GB), rank 0, CPU, page cache warm")
    print(f"{'tp':>3} {'s (best)':>9}")
    for r in rows:
        print(f"{r['tp']:>3} {r['seconds']:>9}")
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.node(),
        "commit": commit.stdout.strip(),
        "command": " ".join(sys.argv),
        "checkpoint_gb": round(size / 1e9, 3),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
