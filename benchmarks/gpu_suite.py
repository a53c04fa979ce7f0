"""One command that proves brisk on a GPU: environment, correctness, kernel benchmarks, offline and served speed.

    python benchmarks/gpu_suite.py --out DIR                 # on a GPU: the quick plan, at most 8 minutes on one H100
    python benchmarks/gpu_suite.py --out DIR --quick --smoke # the quick plan on a CPU at toy sizes, under 2 minutes
    python benchmarks/gpu_suite.py --out DIR --steps e2e,served_120b      # some of the quick plan's steps
    python benchmarks/gpu_suite.py --out DIR --steps env,kv_fp8           # bf16 vs FP8 KV on dummy 120b (7 min)
    python benchmarks/gpu_suite.py --out DIR --steps host_tier            # the host KV tier on dummy 20b
    python benchmarks/gpu_suite.py --out DIR --phases a,b,c,d,e          # the long phases, about 25 minutes
    python benchmarks/gpu_suite.py --out DIR --smoke         # the long phases on a CPU, toy sizes, under 3 minutes

The quick plan (benchmarks/suite_quick.py; the default where nvidia-smi is found and no phases are named): env,
kernels, e2e, speed_120b, served_120b, then speed_20b with whatever the 8-minute window has left. Its budgets are
printed up front. Two steps run only when named (a window's second command): `kv_fp8` (dummy gpt-oss-120b with bf16
KV, then FP8 KV, decode at 16 x 8k context and the largest throughput point each pool holds, side by side) and
`host_tier` (benchmarks/bench_host_tier.py on dummy gpt-oss-20b, without and with the host KV tier). --work DIR keeps models, logs and raw results out of --out, which then holds report.md,
report.json and logs.tar.gz only (benchmarks/gpu_window.sh does so for a lent GPU's $OUT).

Long phases (each a subprocess with its own time budget, as every quick step is: one that overruns is stopped,
marked "timeout", and the next starts; report.json and report.md are rewritten after every phase or step, so a
killed run still leaves a report):
  a  environment: GPU, driver, torch / triton versions, packages against brisk's ranges; measured copy bandwidth
     and bf16 matmul TFLOP/s (ceilings)
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
phase or step on a toy gpt-oss on the CPU (CI does, tests/test_suite_smoke.py): GPU-only checks say "skipped: no GPU".
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import suite_quick  # noqa: E402
from suite_phases import BODIES, PHASES, run_phase_body  # noqa: E402
from suite_report import write_report  # noqa: E402

# Seconds per phase on one H100 (sum 1,500 = 25 minutes) and in --smoke on 2 CPU cores (sum 180).
GPU_BUDGETS = {"a": 60, "b": 360, "c": 180, "d": 480, "e": 420}
SMOKE_BUDGETS = {"a": 15, "b": 35, "c": 10, "d": 60, "e": 60}
KILL_GRACE_S = 5


def phase_env() -> dict[str, str]:
    """The checkout's brisk and benchmarks/ first on the path, unbuffered output for the logs."""
    path = os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


TITLES = dict(PHASES, **{step.name: step.title for step in suite_quick.STEPS})
RUNNABLE = dict(BODIES, **{step.name: step.body for step in suite_quick.STEPS})  # what --run-phase runs
LOG_SUFFIXES = (".log", ".json", ".jsonl")  # what logs.tar.gz keeps of the work folder (not the model folders)
LOG_FILE_LIMIT = 8 << 20  # a larger log goes into logs.tar.gz as its last LOG_TAIL_BYTES, with a line saying so
LOG_TAIL_BYTES = 1 << 20


def run_phase(letter: str, out: Path, budget: float, smoke: bool) -> dict[str, Any]:
    """Run one phase or quick step in its own process group; kill the group when the budget is spent."""
    start = time.monotonic()
    command = [sys.executable, str(Path(__file__)), "--run-phase", letter, "--out", str(out), "--budget", str(budget)]
    command += ["--kill-at", repr(start + budget)]  # the step's one deadline, on the clock both processes share
    if smoke:
        command.append("--smoke")
    result_path = out / f"phase_{letter}.json"
    result_path.unlink(missing_ok=True)
    log_path = out / f"phase_{letter}.log"
    status = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=phase_env(), start_new_session=True)
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            status = f"timeout: stopped after its budget of {budget:.0f} s"
        finally:  # also when the suite itself is stopped (SIGTERM): its own session would outlive it
            _end_group(proc)  # and whatever the phase left behind (a server, pytest workers)
        returncode = proc.returncode
    seconds = time.monotonic() - start
    result: dict[str, Any] = {"sections": []}
    if result_path.exists():
        try:
            result = json.loads(result_path.read_text())
        except json.JSONDecodeError:
            pass
    if status is None and returncode != 0:
        recorded = str(result.get("status", ""))  # the step's own account of its failure, where it wrote one
        status = recorded if recorded.startswith("failed") else f"failed: exit code {returncode} (see {log_path.name})"
    if status is None:
        status = result.get("status", "failed: the phase wrote no result")
    result.update(
        phase=letter,
        title=TITLES[letter],
        status=status,
        seconds=round(seconds, 1),
        budget_s=round(budget),
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
    p.add_argument("--out", required=True, help="folder for report.json and report.md (and logs.tar.gz with --work)")
    p.add_argument("--work", help="folder for models, logs and raw results (default: --out)")
    p.add_argument("--quick", action="store_true", help="the quick plan (the default where a GPU is found)")
    p.add_argument(
        "--steps",
        help=f"steps of the quick plan ({','.join(suite_quick.PLAN_STEP_NAMES)}) or run by name only "
        f"({','.join(n for n in suite_quick.STEP_NAMES if n not in suite_quick.PLAN_STEP_NAMES)})",
    )
    p.add_argument("--phases", help="comma-separated subset of the long phases a-e (f, the report, always runs)")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the pipeline, measures nothing")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every time budget (and the window)")
    p.add_argument("--budget", type=float, help=argparse.SUPPRESS)  # a phase's own budget (internal)
    p.add_argument("--kill-at", type=float, help=argparse.SUPPRESS)  # when the suite stops it (time.monotonic())
    p.add_argument("--run-phase", choices=sorted(RUNNABLE), help=argparse.SUPPRESS)  # internal: run one here
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else out
    for folder in {out, work}:
        folder.mkdir(parents=True, exist_ok=True)
    if args.run_phase:
        # its own SIGTERM handler (run_phase_body): the record saved as far as it got, then exit
        return run_phase_body(
            args.run_phase, RUNNABLE[args.run_phase], out, args.smoke, args.budget or 60.0, args.kill_at
        )
    signal.signal(signal.SIGTERM, _stopped)  # `timeout` around the suite: end the running step, keep the report

    quick = bool(args.quick or args.steps) or (not args.phases and shutil.which("nvidia-smi") is not None)
    if quick and args.phases:
        p.error("--phases names long phases; the quick plan's are --steps")
    if quick:
        names = [x.strip() for x in (args.steps or ",".join(suite_quick.PLAN_STEP_NAMES)).split(",") if x.strip()]
        choices = suite_quick.STEP_NAMES
    else:
        names = [x.strip() for x in (args.phases or "a,b,c,d,e").split(",") if x.strip() and x.strip() != "f"]
        choices = tuple(GPU_BUDGETS)
    unknown = [x for x in names if x not in choices]
    if unknown:
        p.error(f"unknown {'step' if quick else 'phase'}(s) {', '.join(unknown)}; choose from {', '.join(choices)}")
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
        plan="quick" if quick else "phases",
        phases_run=names,
    )
    if quick:
        failed = run_quick(names, out, work, report, args.smoke, args.budget_scale)
    else:
        failed = run_phases(names, out, work, report, args.smoke, args.budget_scale)
    print(f"wrote {out / 'report.md'} and {out / 'report.json'}")
    return 1 if failed else 0


def run_phases(letters: list[str], out: Path, work: Path, report: dict[str, Any], smoke: bool, scale: float) -> int:
    budgets = SMOKE_BUDGETS if smoke else GPU_BUDGETS
    report["suite"]["order"] = sorted(set(report.get("phases", {})) | set(letters))
    write_report(out, report)
    for letter in letters:
        budget = budgets[letter] * scale
        print(f"phase {letter} ({PHASES[letter]}): budget {budget:.0f} s", flush=True)
        result = run_phase(letter, work, budget, smoke)
        report["phases"][letter] = result
        _save(out, work, report)
        print(f"phase {letter}: {result['status']} in {result['seconds']:.0f} s", flush=True)
    return sum(not _passed(report["phases"][x]) for x in letters)


def run_quick(names: list[str], out: Path, work: Path, report: dict[str, Any], smoke: bool, scale: float) -> int:
    """The quick plan: budgets printed and written up front, every step within the window, the report rewritten
    after each. A step with too little of the window left is marked as not run and the plan goes on."""
    steps = suite_quick.plan(names, smoke, scale)
    window = suite_quick.window_s(smoke, scale)
    deadline = time.monotonic() + window
    print(f"quick plan: {len(steps)} steps within {window:.0f} s{' (--smoke)' if smoke else ''}", flush=True)
    report["suite"].update(window_s=window, order=[step.name for step, _ in steps])
    for step, nominal in steps:
        shown = f"{nominal:.0f} s" if nominal else "the rest of the window"
        print(f"  {step.name:<12} {shown:>22}  {step.title}", flush=True)
        report["phases"][step.name] = dict(
            phase=step.name, title=step.title, status="pending", seconds="", budget_s=nominal or "rest", sections=[]
        )
    write_report(out, report)
    for step, nominal in steps:
        budget = suite_quick.step_budget(step, nominal, deadline, smoke, scale, KILL_GRACE_S)
        if budget <= 0:
            left = max(0.0, deadline - time.monotonic())
            report["phases"][step.name].update(status=f"not run: {left:.0f} s left of the {window:.0f} s window")
            _save(out, work, report)
            print(f"{step.name}: not run ({left:.0f} s left)", flush=True)
            continue
        print(f"{step.name}: budget {budget:.0f} s", flush=True)
        try:
            result = run_phase(step.name, work, budget, smoke)
        except SystemExit:
            stopped: dict[str, Any] = dict(status="stopped: the suite itself was stopped (SIGTERM)")
            saved = work / f"phase_{step.name}.json"  # what the step saved of its rows when it was stopped in turn
            try:
                stopped = {**json.loads(saved.read_text()), **stopped}
            except (OSError, json.JSONDecodeError):
                pass
            report["phases"][step.name].update(stopped)
            _save(out, work, report)
            raise
        report["phases"][step.name] = result
        _save(out, work, report)
        print(f"{step.name}: {result['status']} in {result['seconds']:.0f} s", flush=True)
    return sum(not _passed(report["phases"][step.name]) for step, _ in steps)


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _passed(result: dict[str, Any]) -> bool:
    """ok, skipped (no GPU), or not run because the window had no time left for it (the report says so)."""
    return str(result["status"]).startswith(("ok", "skipped", "not run"))


def _save(out: Path, work: Path, report: dict[str, Any]) -> None:
    """The report, and where the work folder is elsewhere, its logs and raw results as one archive beside it."""
    write_report(out, report)
    if work == out:
        return
    tmp = out / "logs.tar.gz.tmp"
    cut = []
    with tarfile.open(tmp, "w:gz") as archive:
        for path in sorted(work.rglob("*")):
            if "models" in path.relative_to(work).parts or path.suffix not in LOG_SUFFIXES or not path.is_file():
                continue
            name = str(path.relative_to(work))
            size = path.stat().st_size
            if size <= LOG_FILE_LIMIT:
                archive.add(path, arcname=name)
                continue
            with open(path, "rb") as f:  # too large to keep whole: its last MB, after a line saying so
                f.seek(size - LOG_TAIL_BYTES)
                data = f.read(LOG_TAIL_BYTES)
            head = f"[gpu_suite.py: {name} is {size} bytes; only its last {LOG_TAIL_BYTES} bytes are kept]\n"
            data = head.encode() + data
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            archive.addfile(info, io.BytesIO(data))
            cut.append(f"{name} ({size} bytes): its last {LOG_TAIL_BYTES} bytes")
    os.replace(tmp, out / "logs.tar.gz")
    if cut:  # the report says which logs.tar.gz holds only in part
        report.setdefault("suite", {})["logs_cut"] = cut
        write_report(out, report)


if __name__ == "__main__":
    sys.exit(main())
