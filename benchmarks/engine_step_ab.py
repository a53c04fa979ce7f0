"""Before/after of the engine step, A/B interleaved: engine_overhead.py's engine-core measurement run in turns
against two brisk source trees, so that both see the same machine load (on a shared machine, figures taken at
different times are not comparable).

    git archive <base commit> brisk | tar -x -C /tmp/brisk-base      # the "before" tree
    python benchmarks/engine_step_ab.py --before /tmp/brisk-base [--after .] [--rounds 3]
        [--batch-sizes 640,1024] [--steps 32] [--vocab-size 4096] [--no-overlap] [--out engine_step_ab.json]

Each round runs `engine_overhead.py --skip-http --skip-offline [--overlap]` once per tree (order alternating
between rounds), with the tree first on PYTHONPATH. The table gives, per batch size, each tree's median over
rounds of the step's wall milliseconds and CPU milliseconds (each a median over `--steps` steps; CPU also as a
mean, which counts the rare long steps such as full garbage collections), and after / before; then the mean
over rounds of the garbage collector's milliseconds per step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def run_once(tree: str, args: argparse.Namespace, out: str) -> dict[int, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [
        sys.executable,
        os.path.join(HERE, "engine_overhead.py"),
        "--skip-http",
        "--skip-offline",
        *(["--overlap"] if args.overlap else []),
        "--batch-sizes",
        args.batch_sizes,
        "--steps",
        str(args.steps),
        "--vocab-size",
        str(args.vocab_size),
        "--out",
        out,
    ]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        report = json.load(f)
    return {row["batch"]: row["engine"] for row in report["results"] if row["engine"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="engine_step_ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the brisk source tree before (holds brisk/)")
    p.add_argument("--after", default=os.path.dirname(HERE), help="the brisk source tree after (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-sizes", default="640,1024")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="overlap scheduling on, as on a GPU (--no-overlap: the CPU's default, as engine_overhead.py runs)",
    )
    p.add_argument("--out", help="write the results as JSON to this path")
    args = p.parse_args(argv)
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict[int, dict[str, float]]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="brisk-engine-step-ab-") as work:
        for r in range(args.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for name in order:
                runs[name].append(run_once(trees[name], args, os.path.join(work, f"{name}-{r}.json")))
                print(f"round {r + 1}: {name} done", file=sys.stderr)
    batches = sorted(runs["before"][0])

    def median_of(name: str, batch: int, key: str) -> float:
        return statistics.median(run[batch][key] for run in runs[name])

    lines = [
        "| batch | wall ms before | after | ratio | CPU ms before | after | ratio | CPU mean before | after | ratio "
        "| GC ms/step before | after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary: list[dict[str, Any]] = []
    for b in batches:
        row = {
            "batch": b,
            **{
                f"{n}_{key}": median_of(n, b, f"step_{key}")
                for n in trees
                for key in ("ms_median", "cpu_ms_median", "cpu_ms_mean")
            },
            **{f"{n}_gc_ms_per_step": statistics.mean(run[b]["gc_ms_per_step"] for run in runs[n]) for n in trees},
        }
        summary.append(row)
        cells = [f"| {b} "]
        for key in ("ms_median", "cpu_ms_median", "cpu_ms_mean"):
            before, after = row[f"before_{key}"], row[f"after_{key}"]
            cells.append(f"| {before:.2f} | {after:.2f} | {after / before:.2f} ")
        cells.append(f"| {row['before_gc_ms_per_step']:.2f} | {row['after_gc_ms_per_step']:.2f} ")
        lines.append("".join(cells) + "|")
    table = "\n".join(lines)
    print(table)
    if args.out:
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python benchmarks/engine_step_ab.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
            "rounds": runs,
            "summary": summary,
            "table": table,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
