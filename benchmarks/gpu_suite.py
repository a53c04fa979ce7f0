"""One command that proves brisk on a GPU: environment, GPU tests, kernel benchmarks, offline and served speed.

    python benchmarks/gpu_suite.py --out DIR                 # every phase, about 25 minutes on one H100
    python benchmarks/gpu_suite.py --out DIR --phases a,b,c  # a subset; DIR's earlier phases are kept in the report
    python benchmarks/gpu_suite.py --out DIR --smoke         # the same pipeline on a CPU, toy sizes, under 3 minutes

Phases (each a subprocess with its own time budget: one that overruns is stopped, marked "timeout", and the next
starts; DIR/report.json and DIR/report.md are rewritten after every phase, so a killed run still leaves a report):
  a  environment: GPU, driver, torch / triton versions; measured copy bandwidth and bf16 matmul TFLOP/s (ceilings)
  b  GPU tests: the kernel-vs-torch tests at real gpt-oss shapes and the end-to-end Triton-vs-torch and graph tests
     (tests/test_triton_*.py, tests/test_gpu_*.py, tests/test_cuda_*.py), pass/fail per test
  c  kernel microbenchmarks (benchmarks/bench_attention.py, bench_moe.py): GB/s and TFLOP/s against (a)'s ceilings
  d  offline latency (batch 1, 4, 8, 16) and throughput (1k in / 1k out) of dummy gpt-oss-20b and -120b with the
     fraction of the bandwidth roofline, transformers generate on dummy 20b as the baseline, and a torch-profiler
     per-kernel share of a decode step where brisk is short of the roofline target (benchmarks/suite_offline.py)
  e  `brisk serve` on dummy 20b with examples/low_latency.yaml, then max_throughput.yaml, measured by
     `brisk bench serve` at concurrency 1, 4, 16, 64
  f  the report: tables per phase, pass/fail, each figure with the command that produced it

Every phase fits one 10-minute command of a GPU lease; run with PYTHONUNBUFFERED=1 to watch it. --smoke runs every
phase on a toy gpt-oss on the CPU (CI does, tests/test_suite_smoke.py): GPU-only checks say "skipped: no GPU".
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from suite_phases import PHASES, run_phase_body  # noqa: E402
from suite_report import write_report  # noqa: E402

# Seconds per phase on one H100 (sum 1,500 = 25 minutes) and in --smoke on 2 CPU cores (sum 180).
GPU_BUDGETS = {"a": 60, "b": 360, "c": 180, "d": 480, "e": 420}
SMOKE_BUDGETS = {"a": 15, "b": 35, "c": 10, "d": 60, "e": 60}
KILL_GRACE_S = 10


def phase_env() -> dict[str, str]:
    """The checkout's brisk and benchmarks/ first on the path, unbuffered output for the logs."""
    path = os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


def run_phase(letter: str, out: Path, budget: float, smoke: bool) -> dict[str, Any]:
    """Run one phase in its own process group; kill the group when the budget is spent."""
    command = [sys.executable, str(Path(__file__)), "--run-phase", letter, "--out", str(out), "--budget", str(budget)]
    if smoke:
        command.append("--smoke")
    result_path = out / f"phase_{letter}.json"
    result_path.unlink(missing_ok=True)
    log_path = out / f"phase_{letter}.log"
    start = time.monotonic()
    status = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=phase_env(), start_new_session=True)
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            status = f"timeout: stopped after its budget of {budget:.0f} s"
        _end_group(proc)  # also whatever the phase left behind (a server, pytest workers)
        returncode = proc.returncode
    seconds = time.monotonic() - start
    result: dict[str, Any] = {"sections": []}
    if result_path.exists():
        try:
            result = json.loads(result_path.read_text())
        except json.JSONDecodeError:
            pass
    if status is None and returncode != 0:
        status = f"failed: exit code {returncode} (see {log_path.name})"
    if status is None:
        status = result.get("status", "failed: the phase wrote no result")
    result.update(
        phase=letter,
        title=PHASES[letter],
        status=status,
        seconds=round(seconds, 1),
        budget_s=budget,
        returncode=returncode,
        log=log_path.name,
        log_tail=_tail(log_path) if not status.startswith(("ok", "skipped")) else "",
    )
    return result


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the phase's process group, then SIGKILL to what is left of it after a grace period."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the phase and all its children are gone
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # anyone left in the group?
        except ProcessLookupError:
            return
        time.sleep(0.2)  # polling for the group's exit, not synchronisation
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for report.json, report.md, logs and raw results")
    p.add_argument("--phases", default="a,b,c,d,e", help="comma-separated subset of a-e (f, the report, always runs)")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the pipeline, measures nothing")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every phase's time budget")
    p.add_argument("--budget", type=float, help=argparse.SUPPRESS)  # a phase's own budget (internal)
    p.add_argument("--run-phase", choices=sorted(PHASES), help=argparse.SUPPRESS)  # internal: run one phase here
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.run_phase:
        return run_phase_body(args.run_phase, out, args.smoke, args.budget or 60.0)

    letters = [x.strip() for x in args.phases.split(",") if x.strip() and x.strip() != "f"]
    unknown = [x for x in letters if x not in GPU_BUDGETS]
    if unknown:
        p.error(f"unknown phase(s) {', '.join(unknown)}; choose from a, b, c, d, e")
    budgets = SMOKE_BUDGETS if args.smoke else GPU_BUDGETS
    report_path = out / "report.json"
    report: dict[str, Any] = {"phases": {}}
    if report_path.exists():  # an earlier command's phases stay in the report unless run again
        try:
            report = json.loads(report_path.read_text())
        except json.JSONDecodeError:
            pass
    invocation = "python benchmarks/gpu_suite.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    report["suite"] = dict(
        command=invocation,
        started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        smoke=args.smoke,
        phases_run=letters,
    )
    write_report(out, report)
    for letter in letters:
        budget = budgets[letter] * args.budget_scale
        print(f"phase {letter} ({PHASES[letter]}): budget {budget:.0f} s", flush=True)
        result = run_phase(letter, out, budget, args.smoke)
        report["phases"][letter] = result
        write_report(out, report)
        print(f"phase {letter}: {result['status']} in {result['seconds']:.0f} s", flush=True)
    print(f"wrote {out / 'report.md'} and {out / 'report.json'}")
    failed = [x for x in letters if not report["phases"][x]["status"].startswith(("ok", "skipped"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
