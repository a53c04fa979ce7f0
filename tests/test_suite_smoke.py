"""benchmarks/gpu_suite.py: the --smoke pipeline on the CPU (every phase leaves its section; GPU-only checks say
"skipped: no GPU"), a phase that overruns its budget is stopped and marked, --phases keeps earlier results, and the
roofline's bytes per decode step match ANCHORS.md.

Cost: the smoke run is about 100 s on 2 busy cores (budgets sum to 180 s; the test allows 1.5x for a slow CI box).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = os.path.join(REPO, "benchmarks", "gpu_suite.py")
NO_GPU = "skipped: no GPU"
TINY = "tiny-gpt-oss"
COLD = "cold start (seconds per stage)"


def run_suite(*args: str, timeout: float = 400, path: str | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=REPO, PATH=path or os.environ["PATH"])
    done = subprocess.run([sys.executable, SUITE, *args], capture_output=True, text=True, env=env, timeout=timeout)
    out = args[args.index("--out") + 1]
    with open(os.path.join(out, "report.json")) as f:
        return done, json.load(f)


def sections(phase: dict) -> dict[str, dict]:
    return {s["title"]: s for s in phase["sections"]}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("suite"))
    done, report = run_suite("--smoke", "--out", out, "--budget-scale", "1.5")
    assert done.returncode == 0, done.stdout + done.stderr + open(os.path.join(out, "report.md")).read()
    return out, report


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU run's 'skipped: no GPU' marks")
def test_smoke_run_fills_every_phase(smoke):
    out, report = smoke
    phases = report["phases"]
    assert sorted(phases) == ["a", "b", "c", "d", "e"]
    for letter, phase in phases.items():
        assert phase["status"] in ("ok", NO_GPU), (letter, phase["status"], phase.get("log_tail"))
        assert phase["sections"], letter
        for section in phase["sections"]:
            assert section["command"], (letter, section["title"])

    a = phases["a"]
    assert a["ceilings"]["copy_gbps"] > 0 and a["ceilings"]["matmul_tflops"] > 0
    assert {"item": "gpu", "value": NO_GPU} in sections(a)["Environment"]["rows"]

    tests = sections(phases["b"])["Per test"]["rows"]
    assert any(t["result"] == "passed" for t in tests)
    gpu_only = [t for t in tests if "on_gpu" in t["test"] or "test_real_" in t["test"] or "gpu_e2e" in t["test"]]
    assert gpu_only and all(t["result"] == "skipped" and t["detail"].startswith(NO_GPU) for t in gpu_only)

    assert phases["c"]["status"] == NO_GPU

    d = sections(phases["d"])
    latency = d["brisk, tiny-gpt-oss: latency"]["rows"]
    assert [r["batch"] for r in latency] == [1, 4]
    assert all(r["tok_s_user"] > 0 and 0 < r["roofline_fraction"] < 1 for r in latency)
    assert d["brisk, tiny-gpt-oss: throughput (largest batch that fits)"]["rows"][0]["output_tok_s_gpu"] > 0
    assert d["brisk, tiny-gpt-oss: per-kernel share of decode steps at batch 1 (torch profiler)"]["rows"]
    assert d["transformers generate, tiny-gpt-oss: latency"]["rows"][0]["tok_s_user"] > 0
    assert any("gpt-oss-120b" in note and NO_GPU in note for note in phases["d"]["notes"])

    served = sections(phases["e"])
    for preset in ("low_latency", "max_throughput"):
        rows = served[f"Served, {preset} (examples/{preset}.yaml), tiny-gpt-oss"]["rows"]
        assert [r["concurrency"] for r in rows] == [1, 4]
        assert all(r["completed"] == 8 and r["failed"] == 0 and r["tok_s_gpu"] > 0 for r in rows)

    md = open(os.path.join(out, "report.md")).read()
    for letter in "abcde":
        assert f"\n## {letter}. " in md


def test_overrun_phase_is_stopped_marked_and_reported_then_a_subset_keeps_it(tmp_path):
    out = str(tmp_path)
    # Phase a cannot finish in 0.1 s (importing torch alone takes longer): it is killed and marked.
    done, report = run_suite("--smoke", "--out", out, "--phases", "a", "--budget-scale", "0.007")
    assert done.returncode == 1
    assert report["phases"]["a"]["status"].startswith("timeout: stopped after its budget")
    done, report = run_suite("--smoke", "--out", out, "--phases", "c")
    assert report["phases"]["a"]["status"].startswith("timeout")  # kept from the earlier command
    assert report["phases"]["c"]["status"] in (NO_GPU, "ok")
    assert "| a | environment and ceilings | timeout" in open(os.path.join(out, "report.md")).read()


def test_step_bytes_match_anchors():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        from suite_models import model_config
        from suite_offline import step_bytes
    finally:
        sys.path.pop(0)
    parts = step_bytes(model_config("gpt-oss-120b"), batch=1, context=1024)
    # ANCHORS.md: active experts 1.90 GB, attention 1.91 GB, lm_head 1.16 GB, ~5.00 GB a step before the KV
    assert parts["experts"] == pytest.approx(1.90e9, rel=0.02)
    assert parts["attention"] == pytest.approx(1.91e9, rel=0.02)
    assert parts["lm_head"] == pytest.approx(1.16e9, rel=0.01)
    assert parts["total"] - parts["kv"] == pytest.approx(5.0e9, rel=0.02)
    fp8 = step_bytes(model_config("gpt-oss-120b"), batch=1, context=1024, kv_bytes=1)  # FP8 KV: half the KV bytes
    assert fp8["kv"] == parts["kv"] / 2 and fp8["total"] - fp8["kv"] == parts["total"] - parts["kv"]
    # KV: 18 full layers read 1024 tokens, 18 sliding layers 128, 2 KiB per token per layer
    assert parts["kv"] == (18 * 1024 + 18 * 128) * 2048
    # experts touched per layer at batch 8 and 64 (ANCHORS: ~29 and ~111 of 128)
    per_expert = parts["experts"] / 36 / 4
    assert step_bytes(model_config("gpt-oss-120b"), 8, 1024)["experts"] / 36 / per_expert == pytest.approx(29, abs=1)
    assert step_bytes(model_config("gpt-oss-120b"), 64, 1024)["experts"] / 36 / per_expert == pytest.approx(111, abs=1)


def _suite_module(name: str):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def test_gpu_tables_read_the_benchmarks_json_and_hold_the_targets(tmp_path):
    """The GPU-only parts of phases c and d, fed the JSON shapes bench_attention.py, bench_moe.py and
    suite_offline.py write on a GPU (they cannot run here)."""
    phases = _suite_module("suite_phases")
    ceil = {"copy_gbps": 3000.0, "matmul_tflops": 800.0}
    attention = {
        "decode": [
            dict(batch=8, context=8192, window=None, us=120.0, kv_gbps=2400.0, partition_size=512, partitions=16),
            dict(batch=8, context=8192, window=128, us=30.0, kv_gbps=600.0, partition_size=64, partitions=3),
        ],
        "prefill": [dict(context=8192, window=None, us=5000.0, tflops=400.0)],
    }
    decode, prefill = phases.attention_rows(attention, ceil)
    assert decode[0]["pct_of_copy"] == "80%" and decode[1]["window"] == 128
    assert prefill[0]["pct_of_matmul"] == "50%"
    moe = {
        "results": [
            dict(
                batch=1, experts_touched=4, us_per_layer=40.0, weight_gbps=1500.0, tflops=1.2, block_m=16, align_us=3.0
            )
        ]
    }
    assert phases.moe_rows(moe, {})[0]["pct_of_copy"] == "n/a (no phase a)"
    assert phases.moe_rows(moe, ceil)[0]["pct_of_copy"] == "50%"

    rec = phases.PhaseRecord(tmp_path, "d")
    result = tmp_path / "d.json"
    result.write_text(
        json.dumps(
            {
                "meta": {"model": "gpt-oss-120b", "engine": "brisk", "device": "NVIDIA H100 80GB HBM3"},
                "rows": {
                    "latency": [dict(batch=1, tok_s_user=300.0, roofline_fraction=0.5)],
                    "throughput": [dict(batch=93, output_tok_s_gpu=5000.0, missing_tokens=17)],
                    "profile": [dict(kernel="fused_moe_down", calls=16, us_per_step=900.0, share=0.4)],
                },
            }
        )
    )
    ended_early = phases._offline_sections(
        rec, result, "brisk", "gpt-oss-120b", "python benchmarks/suite_offline.py ..."
    )
    assert ended_early  # a request that stopped short makes the run's rates invalid
    by_title = {s["title"]: s for s in rec.data["sections"]}
    targets = by_title["Targets, gpt-oss-120b (ANCHORS.md)"]["rows"]
    assert targets == [
        dict(
            target="batch 1 tok/s/user",
            gpu="H100",
            target_value=420,
            measured=300,
            verdict="short (per-kernel profile above)",
        )
    ]  # the H200-only throughput target is not held against an H100


# ---------------------------------------------------------------- the quick plan (--quick: the GPU window)


def test_quick_plan_fits_the_gpu_window_and_the_cpu_rehearsal_fits_two_minutes():
    """The quick plan's budgets: at most 8 minutes on one GPU in all, the open-ended step (speed_20b) only taking
    what the window has left; the CPU rehearsal's window under 2 minutes; gpu_window.sh's limit inside the device
    tool's 10-minute command with room for the install."""
    quick = _suite_module("suite_quick")
    assert quick.WINDOW_S <= 480 and quick.SMOKE_WINDOW_S < 120
    assert sum(step.gpu_s for step in quick.PLAN_STEPS) <= quick.WINDOW_S
    assert sum(step.smoke_s for step in quick.PLAN_STEPS) <= quick.SMOKE_WINDOW_S
    assert [step.name for step in quick.PLAN_STEPS][:5] == ["env", "kernels", "e2e", "speed_120b", "served_120b"]
    assert [step.name for step in quick.PLAN_STEPS if not step.gpu_s] == ["speed_20b"]
    # the steps run by name only fit a window of their own, after env (whose bandwidth their rooflines use)
    by_name = {step.name: step for step in quick.STEPS}
    for step in quick.STEPS:
        if not step.in_plan:
            assert by_name["env"].gpu_s + step.gpu_s <= quick.WINDOW_S, step.name
    script = open(os.path.join(REPO, "benchmarks", "gpu_window.sh")).read()
    limit = int(re.search(r"^limit=(\d+)", script, re.M).group(1))
    assert quick.WINDOW_S + 30 <= limit <= 600 - 45  # the suite's window and cleanup; the install and nvidia-smi


def _listed_tests(quick) -> set[str]:
    phases = _suite_module("suite_phases")
    return {phases.short_test_id(t) for t in (*quick.KERNEL_TESTS, *quick.E2E_TESTS)}


@pytest.fixture(scope="module")
def quick_smoke(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("quick_out"), tmp_path_factory.mktemp("quick_work")
    # A slow or busy CI box gets twice the rehearsal's window (the plan's own window is checked above).
    done, report = run_suite("--quick", "--smoke", "--out", str(out), "--work", str(work), "--budget-scale", "2")
    assert done.returncode == 0, done.stdout + done.stderr + (out / "report.md").read_text()
    return out, work, done, report


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU run's 'skipped: no GPU' marks")
def test_quick_smoke_runs_every_step_and_each_writes_its_rows(quick_smoke):
    out, work, done, report = quick_smoke
    quick = _suite_module("suite_quick")
    names = [step.name for step in quick.PLAN_STEPS]
    assert report["suite"]["plan"] == "quick" and report["suite"]["order"] == names
    for step in quick.PLAN_STEPS:  # the budgets, printed before the first step runs
        assert re.search(rf"^\s+{step.name}\s+(\d+ s|the rest of the window)\s", done.stdout, re.M), step.name
    assert done.stdout.index("speed_20b ") < done.stdout.index("env: budget")
    phases = report["phases"]
    for name in names:
        assert phases[name]["status"] in ("ok", NO_GPU), (name, phases[name]["status"], phases[name].get("log_tail"))
        assert phases[name]["sections"] and all(s["rows"] and s["command"] for s in phases[name]["sections"]), name

    for step in ("kernels", "e2e"):  # every listed test ran (an id that no longer exists would be an error)
        assert sections(phases[step])["Per test"]["rows"]
    tests = {t["test"]: t for step in ("kernels", "e2e") for t in sections(phases[step])["Per test"]["rows"]}
    listed = _listed_tests(quick)
    covers = _suite_module("suite_phases").covers
    assert all(any(covers(x, t) for t in tests) for x in listed) and all(
        any(covers(x, t) for x in listed) for t in tests
    )
    assert tests["test_triton_moe::test_mxfp4_nibble_order_low_first"]["result"] == "passed"
    mask = [t for name, t in tests.items() if name.startswith("test_structured_gpu_kernel::")]
    assert len(mask) == 2 and all(t["result"] == "passed" for t in mask)
    gpu_only = [t for name, t in tests.items() if "_gpu_e2e::" in name or "::test_real_" in name]
    assert gpu_only and all(t["result"] == "skipped" and t["detail"].startswith(NO_GPU) for t in gpu_only)

    for step in ("speed_120b", "speed_20b"):
        by_title = sections(phases[step])
        cold = {r["stage"].split(" (")[0].split(":")[0]: r["s"] for r in by_title[f"brisk, {TINY}: {COLD}"]["rows"]}
        assert {"python imports", "weights", "KV cache allocation", "LLM() in all"} <= set(cold)
        assert all(s >= 0 for s in cold.values())
        assert by_title[f"brisk, {TINY}: throughput (largest batch that fits)"]["rows"][0]["output_tok_s_gpu"] > 0
    latency = sections(phases["speed_120b"])[f"brisk, {TINY}: latency"]["rows"]
    assert latency and all(r["tok_s_user"] > 0 and 0 < r["roofline_fraction"] < 1 for r in latency)
    assert any(NO_GPU in note for note in phases["speed_120b"]["notes"])

    served = sections(phases["served_120b"])
    rows = served[f"Served, low_latency (examples/low_latency.yaml), {TINY}"]["rows"]
    assert [r["concurrency"] for r in rows] == [1, 16]
    assert all(r["failed"] == 0 and r["tok_s_gpu"] > 0 for r in rows)
    assert served[f"Start-up, low_latency ({TINY})"]["rows"][0]["s"] > 0

    # --work kept the models, logs and raw results out of --out: the device tool brings back a few files only
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "report.json", "report.md"]
    with tarfile.open(out / "logs.tar.gz") as archive:
        archived = set(archive.getnames())
    assert {f"phase_{name}.log" for name in names} <= archived and not any("models" in n for n in archived)
    md = (out / "report.md").read_text()
    assert [md.index(f"\n## {name}. ") for name in names] == sorted(md.index(f"\n## {name}. ") for name in names)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU run's toy sizes")
def test_kv_fp8_step_runs_both_kv_dtypes_and_sets_them_side_by_side(tmp_path):
    """`--steps kv_fp8` (by name only): the toy gpt-oss with its model-dtype KV and with FP8 KV, each with its
    long-context row and throughput point, then the side-by-side table: FP8 stored as float8_e4m3fn, the pool's
    tokens in the same bytes grown by the dtypes' size ratio (the toy is fp32 on a CPU: 4x; bf16 on a GPU: 2x)."""
    out, work = tmp_path / "out", tmp_path / "work"
    done, report = run_suite("--smoke", "--steps", "kv_fp8", "--out", str(out), "--work", str(work))
    assert done.returncode == 0, done.stdout + done.stderr + (out / "report.md").read_text()
    phase = report["phases"]["kv_fp8"]
    assert phase["status"] == "ok", phase.get("log_tail")
    by_title = sections(phase)
    for dtype in ("auto", "fp8"):
        long = by_title[f"brisk, {TINY}, KV {dtype}: decode at long context"]["rows"]
        assert long[0]["tok_s_user"] > 0 and long[0]["input_len"] == 64
        assert by_title[f"brisk, {TINY}, KV {dtype}: throughput (largest batch that fits)"]["rows"][0]["batch"] > 0
    auto, fp8, ratio = by_title[f"KV dtype side by side, {TINY}"]["rows"]
    assert auto["stored_as"] in ("float32", "bfloat16") and fp8["stored_as"] == "float8_e4m3fn"
    size_ratio = {"float32": 4.0, "bfloat16": 2.0}[auto["stored_as"]]
    assert ratio["kv_cache_dtype"] == "ratio" and ratio["kv_tokens"] == pytest.approx(size_ratio, rel=0.02)
    assert ratio["throughput_tok_s"] > 0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU run's toy sizes")
def test_host_tier_step_compares_the_tier_with_the_device_pool_alone(tmp_path):
    """`--steps host_tier` (by name only): bench_host_tier.py's two engines on the toy gpt-oss, the same outputs,
    fewer prompt tokens recomputed with the tier, the tier's hits and copies counted."""
    out, work = tmp_path / "out", tmp_path / "work"
    done, report = run_suite("--smoke", "--steps", "host_tier", "--out", str(out), "--work", str(work))
    assert done.returncode == 0, done.stdout + done.stderr + (out / "report.md").read_text()
    phase = report["phases"]["host_tier"]
    assert phase["status"] == "ok", phase.get("log_tail")
    section = sections(phase)[f"Host KV tier, {TINY}"]
    assert "requests whose outputs agree: 100%" in section["note"]
    alone, tier = section["rows"]
    assert alone["host_hit_tokens"] == 0 and tier["host_hit_tokens"] > 0
    assert tier["recomputed_tokens"] < alone["recomputed_tokens"]
    assert tier["bytes_to_host"] > 0 and tier["bytes_to_device"] > 0
    copies = sections(phase)["Host KV tier block copies"]  # the GPU's staged way, at the toy's KV layout
    assert {(r["way"], r["direction"]) for r in copies["rows"]} == {
        (way, direction) for way in ("brisk", "per_tensor") for direction in ("to_host", "to_device")
    }
    assert all(r["done_us_per_block"] > 0 for r in copies["rows"]) and "per_tensor / brisk" in copies["note"]


def test_quick_steps_past_the_window_are_marked_not_run_and_the_plan_goes_on(tmp_path):
    """A window too short for the steps: the first is stopped at what is left, the next is not started, both
    recorded; and with nvidia-smi on the PATH and no phases named, the quick plan is the default."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env_path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    out = tmp_path / "out"
    # a window of 118 x 0.1 = 11.8 s less the 10 s kept for stopping a step: env gets its 1 s (too little to
    # import torch) and is stopped; then under a second is left, less than kernels' least (0.8 s)
    done, report = run_suite(
        "--smoke", "--out", str(out), "--steps", "env,kernels", "--budget-scale", "0.1", path=env_path
    )
    assert report["suite"]["plan"] == "quick" and report["suite"]["phases_run"] == ["env", "kernels"]
    assert report["phases"]["env"]["status"].startswith("timeout: stopped after its budget")
    assert report["phases"]["kernels"]["status"].startswith("not run: ")
    assert done.returncode == 1  # the stopped step; a step not run is no failure of its own
    done, report = run_suite("--smoke", "--out", str(tmp_path / "plain"), "--budget-scale", "0.001", path=env_path)
    assert report["suite"]["plan"] == "quick" and all(
        p["status"].startswith("not run") for p in report["phases"].values()
    )


def test_throughput_point_is_cut_to_fit_the_time_left():
    offline = _suite_module("suite_offline")
    config = _suite_module("suite_models").model_config("gpt-oss-120b")
    # batch 64 x 1024 in: prefill 4 s (16k tokens/s), 127 decode steps in 2.54 s (20 ms a step)
    latency = [dict(batch=64, input_len=1024, output_len=128, total_s=6.54, prefill_s=4.0)]
    assert offline.fit_throughput_point(config, latency, 256, 1024, 1000.0) == (256, 1024, "")
    # 256 x 1k/1k: 16 s of prefill and 1024 steps of ~27 ms (the KV of 256 sequences on top of the weights): ~44 s
    assert offline.fit_throughput_point(config, latency, 256, 1024, 60.0) == (256, 1024, "")
    batch, out, note = offline.fit_throughput_point(config, latency, 256, 1024, 25.0)  # 512 out: ~29.5 s; 256: ~23
    assert (batch, out) == (256, 256) and "cut from 256 x 1024/1024" in note and "to 256 sequences" in note
    batch, out, note = offline.fit_throughput_point(config, latency, 256, 1024, 12.0)
    assert out == 128 and 8 <= batch < 256 and "to fit the 12 s" in note
    # nothing to estimate from: a quarter of the sequences and output tokens, not the whole point
    batch, out, note = offline.fit_throughput_point(config, [], 256, 1024, 1.0)
    assert (batch, out) == (64, 256) and "no latency row" in note
    assert offline.fit_throughput_point(config, [], 16, 32, 1.0)[:2] == (8, 32)  # not below 8 x 128 (or the point)
    assert offline.fit_throughput_point(config, [], 256, 1024, float("inf")) == (256, 1024, "")  # no limit


SALVAGED_STEP = """
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import suite_phases

def body(rec, smoke, budget):
    rec.section("first", "cmd", [dict(row=1)])
    rec.on_stop = lambda: rec.section("partial", "cmd", [dict(row=2)], "what the running command wrote so far")
    assert 0 < rec.left() <= budget
    os.kill(os.getpid(), signal.SIGTERM)  # as the suite's kill at the step's budget
    time.sleep(60)  # interrupted: the handler exits
    return rec.finish()

sys.exit(suite_phases.run_phase_body("tiny", body, Path(sys.argv[2]), True, 30.0))
"""


def test_a_step_stopped_at_its_budget_saves_its_sections(tmp_path):
    """The suite stops a step at its budget with SIGTERM: the step's handler saves the sections it finished and
    what the running command wrote so far (rec.on_stop), marks the record, and exits at once."""
    done = subprocess.run(
        [sys.executable, "-c", SALVAGED_STEP, REPO, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    record = json.loads((tmp_path / "phase_tiny.json").read_text())
    assert [s["title"] for s in record["sections"]] == ["first", "partial"]
    assert record["status"].startswith("timeout") and any("SIGTERM" in n for n in record["notes"])


def test_a_pytest_step_with_a_tiny_budget_still_reports_its_tests(tmp_path):
    """e2e with 4 s (--budget-scale 0.25): pytest cannot finish (torch alone takes most of it); the step's record
    still has its Summary, with the listed tests that never ran, whether pytest's timeout or the suite's kill
    stopped it."""
    out = tmp_path / "out"
    done, report = run_suite("--smoke", "--steps", "e2e", "--out", str(out), "--budget-scale", "0.25")
    e2e = report["phases"]["e2e"]
    assert e2e["status"].startswith("timeout"), (e2e["status"], e2e.get("log_tail"))
    summary = sections(e2e)["Summary"]["rows"][0]  # each listed test: its result, or "not run"
    assert sum(summary.values()) == len(_suite_module("suite_quick").E2E_TESTS) and summary.get("not run"), summary
    assert done.returncode == 1


def test_a_log_too_large_for_the_archive_keeps_its_end(tmp_path, monkeypatch):
    suite = _suite_module("gpu_suite")
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir(), work.mkdir()
    (work / "small.log").write_text("small\n")
    (work / "big.log").write_bytes(b"a" * 3000 + b"the end\n")
    monkeypatch.setattr(suite, "LOG_FILE_LIMIT", 2048)
    monkeypatch.setattr(suite, "LOG_TAIL_BYTES", 1024)
    report = {"suite": {}, "phases": {}}
    suite._save(out, work, report)
    with tarfile.open(out / "logs.tar.gz") as archive:
        small = archive.extractfile("small.log").read()
        big = archive.extractfile("big.log").read().decode()
    assert small == b"small\n"
    assert big.startswith("[gpu_suite.py: big.log is 3008 bytes; only its last 1024 bytes") and big.endswith(
        "the end\n"
    )
    assert len(big.split("\n", 1)[1]) == 1024
    assert json.loads((out / "report.json").read_text())["suite"]["logs_cut"][0].startswith("big.log (3008 bytes)")


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue  # the process ended meanwhile
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_stopped_suite_ends_the_running_step_and_keeps_its_report(tmp_path):
    """gpu_window.sh stops the suite with SIGTERM at its limit: the step running then (in its own session, which
    the device tool would let outlive the command and hold the GPU) is ended, and the report says so."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=REPO)
    suite = subprocess.Popen(
        [sys.executable, SUITE, "--smoke", "--steps", "env,kernels", "--out", str(out), "--budget-scale", "5"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not _processes_naming(f"--run-phase\0env\0--out\0{out}") and time.monotonic() < deadline:
        time.sleep(0.1)  # polling for the step's start, not synchronisation
    assert _processes_naming(f"--run-phase\0env\0--out\0{out}"), "the env step never started"
    suite.send_signal(signal.SIGTERM)
    assert suite.wait(timeout=60) == 128 + signal.SIGTERM
    assert not _processes_naming(str(out))  # the step (and all it started) ended with the suite
    report = json.loads((out / "report.json").read_text())
    assert report["phases"]["env"]["status"] == "stopped: the suite itself was stopped (SIGTERM)"
    assert report["phases"]["kernels"]["status"] == "pending"


def test_a_listed_test_this_machine_cannot_collect_leaves_the_others_to_run(tmp_path):
    """A node id whose module is skipped at import (here jsonschema made unimportable, as on a GPU image without
    it) makes pytest refuse the whole command line; the step then runs the other listed tests and names the one
    left out."""
    hidden = tmp_path / "hidden" / "jsonschema"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('jsonschema is hidden by this test')\n")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=f"{hidden.parent}{os.pathsep}{REPO}")
    args = ["--smoke", "--steps", "kernels", "--out", str(out), "--budget-scale", "6"]
    done = subprocess.run([sys.executable, SUITE, *args], capture_output=True, text=True, env=env, timeout=400)
    report = json.loads((out / "report.json").read_text())
    kernels = report["phases"]["kernels"]
    assert kernels["status"] == "ok", (kernels["status"], kernels.get("log_tail"), done.stderr)
    assert any("left out" in n and "test_structured_engine.py" in n for n in kernels["notes"]), kernels["notes"]
    summary = sections(kernels)["Summary"]["rows"][0]
    assert "not run" not in summary and summary.get("passed"), summary
    ran = [row["test"] for row in sections(kernels)["Per test"]["rows"]]
    listed = [t for t in _suite_module("suite_quick").KERNEL_TESTS if "test_structured_engine.py" not in t]
    assert all(any(t.split("::")[1].split("[")[0] in r for r in ran) for t in listed), ran
    assert not any("test_structured_engine" in r for r in ran), ran


def test_the_callers_commit_names_the_copy_where_its_git_says_another(monkeypatch):
    # the first H100 run: the lent machine's copy carried a .git of an earlier commit, and the report named that one
    phases = _suite_module("suite_phases")
    here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if not here.stdout.strip():
        pytest.skip("not a git checkout: the copy's git cannot disagree")
    monkeypatch.setenv("BRISK_COMMIT", "0000000")
    assert phases._git_commit() == f"0000000 (BRISK_COMMIT; the copy's git says {here.stdout.strip()})"
    monkeypatch.setenv("BRISK_COMMIT", here.stdout.strip())
    assert phases._git_commit() == here.stdout.strip()
