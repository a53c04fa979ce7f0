"""The bodies of benchmarks/gpu_suite.py's phases a-e; each runs in its own process and writes DIR/phase_X.json
after every section, so a phase stopped by its budget keeps what it measured."""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PHASES = {
    "a": "environment and ceilings",
    "b": "GPU tests",
    "c": "kernel microbenchmarks",
    "d": "offline latency and throughput",
    "e": "served: brisk serve + brisk bench serve",
}
NO_GPU = "skipped: no GPU"
GPU_TEST_PATTERNS = ("tests/test_triton_*.py", "tests/test_gpu_*.py", "tests/test_cuda_*.py")
# In --smoke, the GPU-only tests (skipped on a CPU, reported as such) and one quick interpreter test that passes.
SMOKE_TEST_FILTER = "real or gpu or cuda or test_mxfp4_nibble_order_low_first"
PRESETS = ("low_latency", "max_throughput")
# Beside brisk's runtime dependencies (pyproject.toml), what the suite runs: triton (the gpu extra), the GPU tests
# (pytest, hypothesis; jsonschema, imported by the structured-output tests), `brisk bench serve` (httpx;
# matplotlib draws its plots, without it phase e is skipped).
SUITE_TOOLS = ("triton", "pytest", "hypothesis", "jsonschema", "httpx", "matplotlib")
OPTIONAL_TOOLS = ("matplotlib",)
# ../shared/docs/ANCHORS.md: output tok/s targets, by GPU.
TARGETS = {
    ("gpt-oss-120b", "batch 1 tok/s/user"): {"H100": 420, "H200": 600},
    ("gpt-oss-120b", "1k/1k tok/s/GPU"): {"H200": 7000},
    ("gpt-oss-20b", "1k/1k tok/s/GPU"): {"H100": 12000},
}
# What a step keeps at the end of its budget to write its record: its inner timeouts end this long before the suite's
# kill (a fraction of it for a short step, whose record is quick to write).
RECORD_RESERVE_S = 10.0


class PhaseRecord:
    """A phase's result file: sections of tables, each with the command that produced its figures."""

    def __init__(self, out: Path, letter: str, deadline: float | None = None) -> None:
        self.path = out / f"phase_{letter}.json"
        self.data: dict[str, Any] = {"status": "running", "sections": [], "notes": []}
        # the step's one deadline (time.monotonic()): its inner timeouts end here, RECORD_RESERVE_S before its kill
        self.deadline = time.monotonic() + 3600 if deadline is None else deadline
        # what a SIGTERM at the step's budget still records (the running command's partial results), else None
        self.on_stop: Callable[[], Any] | None = None
        self.save()

    def left(self) -> float:
        """Seconds to the step's deadline (at least 1: a command started now gets a moment before its timeout)."""
        return max(1.0, self.deadline - time.monotonic())

    def section(self, title: str, command: str, rows: list[dict[str, Any]], note: str = "") -> None:
        self.data["sections"].append(dict(title=title, command=command, rows=rows, note=note))
        self.save()

    def finish(self, status: str = "ok", **extra: Any) -> int:
        self.data.update(status=status, **extra)
        self.save()
        return 0

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def load_phase(out: Path, letter: str) -> dict[str, Any]:
    try:
        return json.loads((out / f"phase_{letter}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def ceilings(out: Path) -> dict[str, float]:
    """The measured ceilings of this folder's environment step: phase a, or the quick plan's `env`."""
    return load_phase(out, "a").get("ceilings") or load_phase(out, "env").get("ceilings", {})


def run_logged(command: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """Run a step of a phase, its output into the phase's log (our stdout)."""
    print("$ " + shlex.join(command), flush=True)
    return subprocess.run(command, timeout=max(1.0, timeout), cwd=REPO, **kwargs)


# ---- a: environment and ceilings --------------------------------------------------------------------------
def phase_a(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    import torch

    shown = f"python benchmarks/gpu_suite.py {'--steps env' if rec.path.stem == 'phase_env' else '--phases a'}"
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "brisk commit": _git_commit(),
        "cpu": platform.processor() or platform.machine(),
        "cpu cores": os.cpu_count(),
    }
    cuda = torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(),
            gpus=torch.cuda.device_count(),
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 2),
            cuda_runtime=torch.version.cuda,
            driver=_nvidia_smi("driver_version"),
        )
    else:
        env.update(gpu=NO_GPU, driver=NO_GPU)
    rec.section("Environment", shown, [{"item": k, "value": v} for k, v in env.items()])
    packages = package_rows()
    missing = [p["package"] for p in packages if p["ok"] != "yes" and p["package"] not in OPTIONAL_TOOLS]
    note = f"missing or outside brisk's range: {', '.join(missing)} (tools/wheelhouse.sh: README, On a GPU)"
    rec.section(
        "Python packages brisk and the suite import (against pyproject.toml's ranges)",
        "python -m pip list",
        packages,
        note if missing else "",
    )
    copy = copy_gbps(torch, cuda, smoke)
    matmul = matmul_tflops(torch, cuda, smoke)
    rows: list[dict[str, Any]] = [
        dict(ceiling="device copy (read + write)", value=round(copy, 1), unit="GB/s", on="gpu" if cuda else "cpu"),
        dict(
            ceiling="bf16 matmul" if cuda else "fp32 matmul",
            value=round(matmul, 2),
            unit="TFLOP/s",
            on="gpu" if cuda else "cpu",
        ),
    ]
    how = "torch copy_ of 2 GiB, CUDA events; 8192^3 bf16 torch.matmul on random data, mean of 10 after 3 warm-ups"
    if not cuda:
        how = "CPU stand-ins (no GPU): torch copy_ of 64 MB and a 512^3 fp32 matmul; the GPU ceilings: " + NO_GPU
    rec.section("Ceilings (measured)", shown, rows, how)
    status = "ok" if not missing else f"failed: packages missing or outside brisk's range: {', '.join(missing)}"
    return rec.finish(
        status, ceilings={"copy_gbps": copy, "matmul_tflops": matmul, "device": env["gpu"]}, environment=env
    )


def copy_gbps(torch, cuda: bool, smoke: bool) -> float:
    if cuda:
        from gpu_timing import copy_gbps as gpu_copy

        return gpu_copy()
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * src.numel() * 5 / (time.perf_counter() - start) / 1e9


def matmul_tflops(torch, cuda: bool, smoke: bool) -> float:
    n = 8192 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, dtype=dtype, device="cuda" if cuda else "cpu")
    b = torch.randn(n, n, dtype=dtype, device=a.device)
    if cuda:
        from gpu_timing import time_ms

        # ~0.1 s of matmuls: the best of five rounds of ten
        ms = time_ms(lambda: a @ b, iters=10, graph=False, rounds=5)
        return 2 * n**3 / ms / 1e9
    a @ b
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    return 2 * n**3 * 5 / (time.perf_counter() - start) / 1e12


def package_rows() -> list[dict[str, str]]:
    """brisk's dependencies and the suite's tools: the version installed here against the range pyproject.toml asks
    for (an image's own torch or transformers can be older or newer than brisk was tested with)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = [r for extra in ("gpu", "dev") for r in project["optional-dependencies"].get(extra, [])]
    requirements = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    for r in map(Requirement, extras):
        if r.name in SUITE_TOOLS:
            requirements.setdefault(r.name, r)
    rows = []
    for name, req in requirements.items():
        version = _version(name)
        ok = (
            "missing"
            if version == "not installed"
            else "yes"
            if req.specifier.contains(version, prereleases=True)
            else "no"
        )
        rows.append(dict(package=name, version=version, wanted=str(req.specifier), ok=ok))
    return rows


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str:
    """The checkout's commit; where it has no .git (a copy on a lent GPU), BRISK_COMMIT as the caller passed it."""
    given = os.environ.get("BRISK_COMMIT", "").strip()
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return f"{given} (BRISK_COMMIT; no git)" if given else "unknown (no git)"
    found = out.stdout.strip()
    if found and given and not found.startswith(given) and not given.startswith(found):
        # the first H100 run's copy carried a .git of an earlier commit: the caller's word is the checkout's
        return f"{given} (BRISK_COMMIT; the copy's git says {found})"
    if found:
        return found
    return f"{given} (BRISK_COMMIT; not a git checkout)" if given else "unknown (not a git checkout; no BRISK_COMMIT)"


def _nvidia_smi(field: str) -> str:
    if shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi)"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


# ---- b: GPU tests -----------------------------------------------------------------------------------------
def phase_b(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    files = sorted({f for pattern in GPU_TEST_PATTERNS for f in glob.glob(str(REPO / pattern))})
    targets = [os.path.relpath(f, REPO) for f in files]
    if smoke or not has_cuda():
        targets += ["-k", SMOKE_TEST_FILTER]
    return run_tests(rec, targets, budget, files=", ".join(Path(f).name for f in files))


def run_tests(rec: PhaseRecord, targets: list[str], budget: float, **summary: str) -> int:
    """pytest on `targets` (files, node ids, options) until the step's deadline, one row per test as each ends; on
    a timeout the tests that finished are reported and the node ids named in `targets` that never ran are listed."""
    status, counts = test_status(rec, targets, rec.left(), **summary)
    return rec.finish(status, **({"counts": counts} if counts else {}))


def test_status(
    rec: PhaseRecord, targets: list[str], limit: float, **summary: str
) -> tuple[str, dict[str, int] | None]:
    """run_tests' pytest run, within `limit` seconds, its sections added to `rec`: its status and counts."""
    results = rec.path.parent / f"{rec.path.stem.removeprefix('phase_')}_results.jsonl"
    results.unlink(missing_ok=True)
    base = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "suite_pytest_plugin"]
    base.append(f"--suite-results={results}")
    command = [*base, *targets]
    shown = shlex.join(["python", *command[1:]]).replace(str(results), f"DIR/{results.name}")
    cuda = False

    def stopped() -> None:  # SIGTERM at the budget: the tests that finished so far (none before pytest started)
        rec.data["notes"].append("pytest was stopped at the step's budget: the tests that finished are below")
        _test_sections(rec, results, targets, shown, cuda, summary)

    rec.on_stop = stopped
    cuda = has_cuda()  # torch imported now, not after pytest: the time left after it is the record's
    overran = False
    deadline = time.monotonic() + min(limit, rec.left())

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    try:
        # until the deadline; the reserve after it: the time to write the report
        if run_logged(command, left()).returncode == USAGE_ERROR and not read_results(results):
            # A node id pytest cannot collect here (its module skipped at import: a package this machine lacks)
            # stops the whole run before any test: the others run without it.
            collectable = collectable_targets(targets, left())
            missing = [t for t in targets if t not in collectable]
            if missing and any("::" in t for t in collectable):
                rec.data["notes"].append("not collected here (see the log), left out: " + ", ".join(missing))
                targets = collectable
                run_logged([*base, *collectable], left())
    except subprocess.TimeoutExpired:
        overran = True
        rec.data["notes"].append("pytest overran the step's budget: the tests that finished are below")
    rec.on_stop = None
    tests, counts, not_run = _test_sections(rec, results, targets, shown, cuda, summary)
    failed = counts.get("failed", 0) + counts.get("error", 0)
    if not tests:
        return (
            "timeout: no test ended within the budget" if overran else "failed: no test results (see the log)"
        ), None
    if failed:
        return f"failed: {failed} test(s) failed", counts
    return ("ok" if not not_run else f"timeout: {len(not_run)} test(s) not run"), counts


USAGE_ERROR = 4  # pytest's exit code for a command line it refuses, such as a node id it cannot collect


def collectable_targets(targets: list[str], timeout: float) -> list[str]:
    """`targets` less the node ids pytest does not collect from their files (options and files kept)."""
    files = sorted({t.split("::")[0] for t in targets if "::" in t})
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        capture_output=True,
        text=True,
        timeout=max(1.0, timeout),
        cwd=REPO,
    )
    collected = {line.strip() for line in listed.stdout.splitlines() if "::" in line}
    return [t for t in targets if "::" not in t or any(c == t or c.startswith((t + "[", t + "::")) for c in collected)]


def _test_sections(
    rec: PhaseRecord, results: Path, targets: list[str], shown: str, cuda: bool, summary: dict[str, str]
) -> tuple[list[dict[str, Any]], dict[str, int], list[str]]:
    """The Summary and Per test sections from the plugin's results so far: (tests, counts, listed ids not run)."""
    tests = read_results(results)
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["result"]] = counts.get(t["result"], 0) + 1
    ran = {t["test"] for t in tests}
    not_run = [t for t in targets if "::" in t and not any(covers(short_test_id(t), r) for r in ran)]
    if not_run:
        counts["not run"] = len(not_run)
        rec.data["notes"].append("not run (no time left): " + ", ".join(not_run))
    note = "" if cuda else f"GPU-only tests: {NO_GPU} (CUDA is not available; the Triton tests' CPU runs are in CI)"
    rec.section("Summary", shown, [dict(counts, **summary)], note)
    rec.section("Per test", shown, tests)
    return tests, counts, not_run


def read_results(path: Path) -> list[dict[str, Any]]:
    """The plugin's JSON lines; GPU-only skips are marked as such."""
    tests = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            t = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if t["result"] == "skipped" and ("CUDA" in t["detail"] or "GPU" in t["detail"]):
            t["detail"] = f"{NO_GPU} ({t['detail']})"
        t["test"] = short_test_id(t["test"])
        tests.append(t)
    return tests


def short_test_id(nodeid: str) -> str:
    return nodeid.removeprefix("tests/").replace(".py::", "::")


def covers(listed: str, test: str) -> bool:
    """Whether a listed test id names this test: itself, or the function whose parameter case it is."""
    return test == listed or ("[" not in listed and test.startswith(listed + "["))


# ---- c: kernel microbenchmarks ----------------------------------------------------------------------------
def phase_c(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    if not has_cuda():
        rec.section(
            "Kernel microbenchmarks", "python benchmarks/bench_attention.py; python benchmarks/bench_moe.py", [], NO_GPU
        )
        return rec.finish(NO_GPU)
    ceil = ceilings(rec.path.parent)
    out = rec.path.parent
    attention_cmd = [sys.executable, "benchmarks/bench_attention.py", "--out", str(out / "c_attention.json")]
    shown = "python benchmarks/bench_attention.py --out DIR/c_attention.json"
    try:  # a failed or overrun attention benchmark costs its rows, not the MoE's
        run_logged(attention_cmd, min(rec.left(), budget * 0.5))
        decode, prefill = attention_rows(json.loads((out / "c_attention.json").read_text()), ceil)
    except (subprocess.TimeoutExpired, OSError, json.JSONDecodeError) as exc:
        rec.section("Paged attention", shown, [], f"not measured: {type(exc).__name__}: {exc}"[:300])
    else:
        rec.section("Paged decode attention (KV GB/s vs phase a's copy)", shown, decode)
        rec.section("Paged prefill attention (TFLOP/s vs phase a's matmul)", shown, prefill)
    moe_cmd = [sys.executable, "benchmarks/bench_moe.py", "--out", str(out / "c_moe.json")]
    run_logged(moe_cmd, rec.left())
    rows = moe_rows(json.loads((out / "c_moe.json").read_text()), ceil)
    rec.section(
        "Fused MXFP4 MoE, gpt-oss-120b layer shapes", "python benchmarks/bench_moe.py --out DIR/c_moe.json", rows
    )
    return rec.finish()


def attention_rows(data: dict[str, Any], ceil: dict[str, float]) -> tuple[list[dict], list[dict]]:
    """bench_attention.py's JSON as report rows, held against phase a's ceilings."""
    copy, matmul = ceil.get("copy_gbps"), ceil.get("matmul_tflops")
    decode = [
        dict(
            batch=r["batch"],
            context=r["context"],
            window=r["window"] or "-",
            us=round(r["us"], 1),
            kv_gbps=round(r["kv_gbps"]),
            pct_of_copy=_pct(r["kv_gbps"], copy),
        )
        for r in data["decode"]
    ]
    prefill = [
        dict(
            context=r["context"],
            window=r["window"] or "-",
            us=round(r["us"], 1),
            tflops=round(r["tflops"], 1),
            pct_of_matmul=_pct(r["tflops"], matmul),
        )
        for r in data["prefill"]
    ]
    return decode, prefill


def moe_rows(data: dict[str, Any], ceil: dict[str, float]) -> list[dict]:
    """bench_moe.py's JSON as report rows, held against phase a's ceilings."""
    copy, matmul = ceil.get("copy_gbps"), ceil.get("matmul_tflops")
    return [
        dict(
            batch=r["batch"],
            kernel=r.get("kernel", "auto") + (" (gemv)" if r.get("gemv") else ""),
            vs_first=f"{r.get('speedup_vs_first', 1.0):.2f}x",
            experts=r["experts_touched"],
            us_per_layer=round(r["us_per_layer"], 1),
            weight_gbps=round(r["weight_gbps"]),
            pct_of_copy=_pct(r["weight_gbps"], copy),
            tflops=round(r["tflops"], 1),
            pct_of_matmul=_pct(r["tflops"], matmul),
            align_us=round(r["align_us"], 1),
        )
        for r in data["results"]
    ]


def _pct(value: float, ceiling: float | None) -> str:
    return f"{100 * value / ceiling:.0f}%" if ceiling else "n/a (no phase a)"


# ---- d: offline latency and throughput ---------------------------------------------------------------------
def phase_d(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    cuda = has_cuda()
    out = rec.path.parent
    bandwidth = ceilings(out).get("copy_gbps")
    common = ["--models-dir", str(out / "models")]
    if bandwidth:
        common += ["--bandwidth-gbps", f"{bandwidth:.1f}"]
    if smoke or not cuda:
        sizes = [
            "--batches",
            "1,4",
            "--input-len",
            "32",
            "--output-len",
            "16",
            "--throughput-len",
            "32",
            "--max-batch",
            "16",
        ]
        items = [("brisk", "tiny-gpt-oss", sizes + ["--profile", "always"], 0.6), ("hf", "tiny-gpt-oss", sizes, 0.4)]
        if not cuda:
            rec.data["notes"].append(f"dummy gpt-oss-20b and gpt-oss-120b: {NO_GPU} (the toy model stands in)")
    else:
        items = [
            ("brisk", "gpt-oss-20b", [], 0.4),
            ("hf", "gpt-oss-20b", [], 0.15),
            ("brisk", "gpt-oss-120b", [], 0.45),
        ]
    statuses = []
    for index, (engine, model, extra, share) in enumerate(items):
        path = out / f"d_{engine}_{model}.json"
        path.unlink(missing_ok=True)
        command = [sys.executable, "benchmarks/suite_offline.py", engine, "--model", model, "--out", str(path)]
        command += common + extra
        left = rec.left()
        try:
            done = run_logged(command, left if index == len(items) - 1 else min(left, budget * share))
            statuses.append(f"{engine} {model}: " + ("ok" if done.returncode == 0 else f"exit code {done.returncode}"))
        except subprocess.TimeoutExpired:
            statuses.append(f"{engine} {model}: stopped at its share of the budget")
        shown = shlex.join(command[1:]).replace(str(out), "DIR")
        if _offline_sections(rec, path, engine, model, "python " + shown):
            statuses.append(f"{engine} {model}: requests ended early (missing_tokens): its rates are not valid")
    rec.data["notes"].extend(statuses)
    bad = [s for s in statuses if not s.endswith(": ok")]
    return rec.finish("ok" if not bad else "failed: " + "; ".join(bad))


OFFLINE_TABLES = {  # suite_offline.py's tables, as the report titles them
    "startup": "cold start (seconds per stage)",
    "latency": "latency",
    "long_context": "decode at long context",
    "throughput": "throughput (largest batch that fits)",
    "profile": "per-kernel share of decode steps at batch 1 (torch profiler)",
}


def _offline_sections(rec: PhaseRecord, path: Path, engine: str, model: str, command: str) -> bool:
    """The run's tables; True when a request produced fewer tokens than asked (its figures are then wrong)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        rec.section(f"{engine} {model}", command, [], "no results (see the log)")
        return False
    rows = data.get("rows", {})
    meta = data.get("meta", {})
    note = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in meta.items())
    name = "transformers generate" if engine == "hf" else "brisk"
    rec.data["notes"].extend(f"{model}: {text}" for text in data.get("notes", []))
    for table, what in OFFLINE_TABLES.items():
        if table in rows:
            rec.section(f"{name}, {model}: {what}", command, [_rounded(r) for r in rows[table]], note)
    if engine == "brisk":
        device = meta.get("device", "")
        gpu = "H200" if "H200" in device else "H100" if "H100" in device else None
        checks = []
        for (target_model, what), by_gpu in TARGETS.items():
            if target_model != model or gpu not in by_gpu:
                continue
            if what.startswith("batch 1"):
                measured = next((r["tok_s_user"] for r in rows.get("latency", []) if r["batch"] == 1), None)
            else:
                measured = next((r["output_tok_s_gpu"] for r in rows.get("throughput", [])), None)
            verdict = "not measured" if measured is None else "met" if measured >= by_gpu[gpu] else "short"
            if verdict == "short" and "profile" in rows:
                verdict += " (per-kernel profile above)"
            checks.append(
                dict(
                    target=what,
                    gpu=gpu,
                    target_value=by_gpu[gpu],
                    measured=measured and round(measured),
                    verdict=verdict,
                )
            )
        if checks:
            rec.section(f"Targets, {model} (ANCHORS.md)", command, checks)
    return any(r.get("missing_tokens") for table in rows.values() for r in table)


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (round(v, 4) if isinstance(v, float) and abs(v) < 1 else round(v, 1) if isinstance(v, float) else v)
        for k, v in row.items()
    }


# ---- e: served -----------------------------------------------------------------------------------------------
def phase_e(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    cuda = has_cuda()
    if importlib.util.find_spec("matplotlib") is None:
        rec.section("Served", "brisk bench serve", [], "skipped: matplotlib missing (wheelhouse.sh --extras bench)")
        return rec.finish("skipped: matplotlib missing")
    out = rec.path.parent
    sys.path.insert(0, str(HERE))
    from suite_models import TINY_NAME, write_model_dir

    model = "gpt-oss-20b" if cuda and not smoke else TINY_NAME
    model_dir = write_model_dir(model, out / "models")
    # One `brisk bench serve` per entry. On a GPU, few requests at low concurrency (each is 256 decode steps long)
    # and enough at high concurrency for two waves: about 5,000 decode steps per preset.
    if smoke or not cuda:
        loads = [["--concurrency", "1,4", "--input-len", "32", "--output-len", "16", "--num-prompts", "8"]]
    else:
        lengths = ["--input-len", "1024", "--output-len", "256"]
        loads = [
            ["--concurrency", "1,4", "--num-prompts", "8", *lengths],
            ["--concurrency", "16,64", "--num-prompts", "128", *lengths],
        ]
    bad = []
    for i, preset in enumerate(PRESETS):
        share = rec.left() / (len(PRESETS) - i)
        status = serve_and_bench(rec, preset, model, model_dir, loads, share)
        if status != "ok":
            bad.append(f"{preset}: {status}")
    return rec.finish("ok" if not bad else "failed: " + "; ".join(bad))


def serve_and_bench(
    rec: PhaseRecord, preset: str, model: str, model_dir: str, loads: list[list[str]], budget: float
) -> str:
    out = rec.path.parent
    port = _free_port()
    serve = [sys.executable, "-m", "brisk.cli", "serve", model_dir, "--load_format", "dummy", "--port", str(port)]
    serve += ["--served-model-name", model, "--extra_llm_api_options", f"examples/{preset}.yaml"]
    bench_dir = out / f"e_{preset}"
    base = [sys.executable, "-m", "brisk.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}"]
    base += ["--model", model, "--num-gpus", "1", "--out-dir", str(bench_dir), "--label", preset]
    benches = [base + load for load in loads]
    shown = " && ".join(shlex.join(["brisk", *b[3:]]) for b in benches)
    shown = f"{shlex.join(['brisk', *serve[3:]])} & {shown}".replace(str(out), "DIR")
    started = time.monotonic()
    end = started + budget  # the bench's and the server's shutdown's deadline
    print("$ " + shlex.join(serve), flush=True)
    server = subprocess.Popen(serve, cwd=REPO)
    status, note = "ok", ""
    # SIGTERM at the step's budget: the points `brisk bench serve` wrote so far
    rec.on_stop = lambda: _served_section(rec, preset, model, bench_dir, shown, "stopped at the step's budget")
    try:
        if not _wait_healthy(server, port, budget * 0.75):
            rec.section(f"Served, {preset}", shown, [], "the server did not become ready (see the log)")
            return "server not ready"
        ready = dict(stage="`brisk serve` started to /health ready", s=round(time.monotonic() - started, 1))
        note = "cold start of the server process: imports, weights, KV sizing, Triton kernels (disk cache), graphs"
        rec.section(f"Start-up, {preset} ({model})", shown, [ready], note)
        note = ""
        for bench in benches:
            run_logged(bench, budget - (time.monotonic() - started) - 5)
    except subprocess.TimeoutExpired:
        status, note = "timeout", "brisk bench serve overran its share of the budget: the points it finished"
    finally:
        server.terminate()
        try:  # within the step's time: what is left of this preset's share, a few seconds at least
            server.wait(timeout=max(3.0, min(30.0, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        rec.on_stop = None
    points = _served_section(rec, preset, model, bench_dir, shown, note)
    if not points:
        return "no result" if status == "ok" else status
    failed = sum(p["failed"] for p in points)
    return status if failed == 0 else f"{failed} request(s) failed"


def _served_section(rec: PhaseRecord, preset: str, model: str, bench_dir: Path, shown: str, note: str) -> list[dict]:
    """The section of the points `brisk bench serve` wrote (each run's JSON at its end); the points."""
    points = []
    for run in glob.glob(str(bench_dir / "*.json")):
        try:
            points += json.loads(Path(run).read_text())["points"]
        except (OSError, json.JSONDecodeError, KeyError):
            continue  # a file cut short by a kill
    if not points:
        rec.section(f"Served, {preset}", shown, [], note or "brisk bench serve wrote no result")
        return points
    rows = []
    for point in sorted(points, key=lambda p: p["concurrency"] or 0):
        rows.append(
            dict(
                concurrency=point["concurrency"],
                completed=point["completed"],
                failed=point["failed"],
                ttft_ms_mean=_r(point["ttft_ms"]["mean"]),
                ttft_ms_p99=_r(point["ttft_ms"]["p99"]),
                tpot_ms_mean=_r(point["tpot_ms"]["mean"]),
                tok_s_user=_r(point["output_throughput_per_user"]),
                tok_s_gpu=_r(point["output_throughput_per_gpu"]),
            )
        )
    rec.section(f"Served, {preset} (examples/{preset}.yaml), {model}", shown, rows, note)
    return points


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)  # polling the server's readiness, not synchronisation
    return False


BODIES = {"a": phase_a, "b": phase_b, "c": phase_c, "d": phase_d, "e": phase_e}


def run_phase_body(
    name: str,
    body: Callable[[PhaseRecord, bool, float], int],
    out: Path,
    smoke: bool,
    budget: float,
    kill_at: float | None = None,
) -> int:
    """One phase's (or quick step's) body in this process, its record DIR/phase_NAME.json; a crash is recorded.
    `kill_at` (time.monotonic(), the suite's clock: the same on Linux) is when the suite stops this process; the
    body's deadline is RECORD_RESERVE_S before it, and a SIGTERM saves what the record has before exiting."""
    if kill_at is None:
        kill_at = time.monotonic() + budget
    rec = PhaseRecord(out, name, deadline=kill_at - min(RECORD_RESERVE_S, 0.15 * budget))
    signal.signal(signal.SIGTERM, lambda signum, frame: _salvage(rec, signum))
    try:
        return body(rec, smoke, budget)
    except Exception as exc:  # the report says what broke; the traceback is in the phase's log
        import traceback

        traceback.print_exc()
        rec.finish(f"failed: {type(exc).__name__}: {str(exc)[:300]}")
        return 1


def _salvage(rec: PhaseRecord, signum: int) -> None:
    """SIGTERM (the suite stops the step at its budget): the running command's partial results where the body
    said how (rec.on_stop), the record saved, and an exit at once (the suite ends the step's other processes)."""
    print(f"stopped by signal {signum}: saving {rec.path.name}", flush=True)
    stop, rec.on_stop = rec.on_stop, None
    if stop is not None:
        try:
            stop()
        except Exception:  # the record as it was is still saved below
            import traceback

            traceback.print_exc()
    rec.data["notes"].append("stopped at the step's budget (SIGTERM): the sections it finished are below")
    rec.data["status"] = "timeout: stopped at its budget"
    rec.save()
    os._exit(128 + signum)
