"""benchmarks/gpu_suite.py: the --smoke pipeline on the CPU (every phase leaves its section; GPU-only checks say
"skipped: no GPU"), a phase that overruns its budget is stopped and marked, --phases keeps earlier results, and the
roofline's bytes per decode step match ANCHORS.md.

Cost: the smoke run is about 100 s on 2 busy cores (budgets sum to 180 s; the test allows 1.5x for a slow CI box).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = os.path.join(REPO, "benchmarks", "gpu_suite.py")
NO_GPU = "skipped: no GPU"


def run_suite(*args: str, timeout: float = 400) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=REPO)
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
    moe = {"results": [dict(batch=1, experts_touched=4, us_per_layer=40.0, weight_gbps=1500.0, tflops=1.2, block_m=16)]}
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
