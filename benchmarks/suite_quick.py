"""The quick plan of benchmarks/gpu_suite.py (`--quick`, the default on a GPU): the whole verdict, correctness first
and then the headline figures, in one command of at most 8 minutes on one H100.

    step        budget  what
    env           25 s  GPU, driver, packages against brisk's ranges; measured copy GB/s and bf16 TFLOP/s
    kernels       70 s  compiled Triton kernels vs torch at gpt-oss shapes: decode and prefill attention with sinks
                        and the 128 window, the MXFP4 MoE at batch 1, 64 and 640, the structured-output mask on CUDA;
                        the host KV tier's staged copies on a copy stream
    e2e           80 s  greedy identity Triton vs torch on a tiny model of the real architecture; CUDA-graph replay
                        identity for decode steps, verify steps and overlap; structured outputs on CUDA logits; no
                        synchronising CUDA call while a step is launched (torch's sync debug mode)
    speed_120b   200 s  dummy gpt-oss-120b in one process: cold start stage by stage, decode at batch 1, 8 and 64
                        (tok/s, fraction of the bandwidth roofline), one max-throughput point (~1k in / 1k out)
    served_120b  100 s  `brisk serve` dummy 120b with examples/low_latency.yaml, `brisk bench serve` at 1 and 16
    speed_20b   the rest  dummy gpt-oss-20b as speed_120b, only where the window has time left (90 s at least)

By name only (`--steps kv_fp8`, e.g. a window's second command after `env`, whose bandwidth gives the roofline):
    kv_fp8       420 s  dummy gpt-oss-120b with bf16 KV, then with FP8 KV (a process each, half the time each):
                        decode at 16 x 8,192 tokens of context, the largest throughput point each pool holds
                        (~1k in / 1k out), and the two side by side (pool tokens, tok/s, ratios)
    host_tier    150 s  benchmarks/bench_host_tier.py on dummy gpt-oss-20b: 16 conversations x 4 turns resending
                        their history (2k tokens first) over a device pool of ~25% of it, without and with the host
                        KV tier (copies on a CUDA stream): prompt tokens recomputed, TTFT, bytes moved; then
                        benchmarks/bench_kv_block_copies.py at its KV layout (a step's copies of 16 and 64
                        scattered blocks: brisk's staged batches vs one copy per block and KV tensor), seconds

Each step is a process of its own under a hard timeout (gpu_suite.py); inside it, the speed steps fit their sizes
to their time (batches skipped, the throughput point cut, each with a note) rather than running into the timeout.
A step that fails or times out is recorded and the plan goes on; no step starts past the window.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from suite_models import TINY_NAME, write_model_dir
from suite_phases import (
    NO_GPU,
    PhaseRecord,
    _offline_sections,
    _rounded,
    ceilings,
    has_cuda,
    moe_rows,
    phase_a,
    run_logged,
    run_tests,
    serve_and_bench,
    test_status,
)

WINDOW_S = 480  # the quick plan on one H100: 8 minutes
SMOKE_WINDOW_S = 118  # --smoke on 2 CPU cores: under 2 minutes

# Correctness, in the order they run (a step cut by its budget loses the last ones): each kernel family's first case
# early, since its first compile costs most. The attention cases are gpt-oss's: 64 q / 8 KV heads, head_dim 64, sinks,
# window 128 or none; the MoE at 640 tokens runs the prefill-sized tiles.
KERNEL_TESTS = (
    "tests/test_triton_moe.py::test_mxfp4_nibble_order_low_first",
    "tests/test_triton_attention.py::test_real_decode[128-None-8]",
    "tests/test_triton_moe.py::test_gpt_oss_120b_shapes_on_gpu[True-1]",
    "tests/test_triton_moe.py::test_gpt_oss_120b_shapes_on_gpu[True-8]",
    "tests/test_triton_attention.py::test_real_chunked_prefill[128-8]",
    "tests/test_triton_moe.py::test_gpt_oss_120b_shapes_on_gpu[True-640]",
    "tests/test_structured_gpu_kernel.py::test_gpu_mask_kernel_matches_reference_and_cpu_kernel",
    "tests/test_triton_attention.py::test_real_decode[None-None-8]",
    "tests/test_triton_moe.py::test_gpt_oss_120b_shapes_on_gpu[True-64]",
    "tests/test_triton_attention.py::test_real_backend_mixed_batch[True-128-dtype0]",
    "tests/test_triton_attention.py::test_real_chunked_prefill[None-8]",
    "tests/test_triton_attention.py::test_real_decode[128-256-8]",
    "tests/test_triton_attention.py::test_real_backend_mixed_batch[True-None-dtype0]",
    "tests/test_triton_moe.py::test_alignment_at_prefill_size_on_gpu",
    "tests/test_spec_decode_rejection.py::test_a_request_fails_when_any_of_its_verify_rows_is_non_finite[cuda]",
    "tests/test_kv_host_tier.py::test_staged_copies_on_a_gpu_move_every_tensors_bytes_as_one_at_a_time_would",
    "tests/test_structured_engine.py::test_bitmask_rows_follow_the_sampled_order[cuda]",
)
E2E_TESTS = (
    "tests/test_gpu_e2e.py::test_triton_path_matches_torch_path[mxfp4]",
    "tests/test_gpu_e2e.py::test_triton_path_matches_torch_path[bf16-experts]",
    "tests/test_gpu_e2e.py::test_cuda_graphs_generate_what_eager_steps_do[8]",
    "tests/test_gpu_e2e.py::test_cuda_graphs_generate_what_eager_steps_do[64]",
    "tests/test_gpu_e2e.py::test_cuda_graphs_replay_speculative_verify_steps[5]",
    "tests/test_gpu_e2e.py::test_overlap_and_graphs_generate_what_plain_eager_steps_do",
    "tests/test_gpu_e2e.py::test_structured_outputs_on_cuda_logits_hold_the_constraints",
    "tests/test_gpu_e2e.py::test_cuda_graphs_with_eagle3_generate_what_eager_steps_do",
    "tests/test_gpu_e2e.py::test_an_overlapped_step_never_waits_for_the_device",
)
# The speed steps' shapes on a GPU and, in --smoke or without CUDA, on the toy gpt-oss.
GPU_SPEED = dict(batches="1,8,64", input_len=1024, output_len=128, throughput_len=1024, max_batch=512)
SMOKE_SPEED = dict(batches="1,4", input_len=32, output_len=16, throughput_len=32, max_batch=16)
# Captured decode batch sizes: the latency batches exactly, and a throughput batch (set by the KV pool) padded by
# at most a quarter; fewer graphs than brisk's default ladder of 8s (start-up time is part of the window).
GRAPH_SIZES = "1,2,4,8,16,32,48,64,96,128,160,192,256,320,384,448,512"
# The kv_fp8 step (by name only: `--steps kv_fp8`, a window's second command): no short-context latency rows; one
# decode row at long context, and a throughput point that FP8 KV may make twice as large as bf16 (graphs up to it).
KV_DTYPES = ("auto", "fp8")
# The long row's decode: 512 steps, so it is most of the run beside the 16 x 8k prefill (KV is ~15% of such a step's
# bytes at bf16: FP8 can speed it up by ~8% at most, a figure that two short runs' difference would drown).
KV_FP8_SPEED = dict(batches="", output_len=512, long_context=8192, long_batch=16, throughput_len=1024, max_batch=1024)
# Before the speed runs: the compiled FP8 attention path against the dequantized reference (fp32: to 2e-5) at gpt-oss's
# shape, a needle early in a long context recalled through it, and FP8 full attention beside fp32 sliding windows
# (kv_cache_dtype_skip_layers) end to end against the torch backends.
KV_FP8_TESTS = (
    "tests/test_kv_fp8.py::test_compiled_fp8_kernels_at_real_shapes_match_the_dequantized_reference[128-fp32]",
    "tests/test_kv_fp8.py::test_compiled_fp8_kernels_at_real_shapes_match_the_dequantized_reference[None-fp32]",
    "tests/test_kv_fp8.py::test_a_needle_early_in_a_long_context_is_recalled_through_fp8[triton]",
    "tests/test_gpu_e2e.py::test_triton_path_matches_torch_path[fp8-skip-sliding]",
)
KV_FP8_TESTS_S = 45.0  # at most, of the step
# The tests' share of the step's time left: on a CPU (--smoke) the GPU tests skip, but pytest's start-up with these
# modules' imports is most of ten seconds, more on a busy two-core machine; the toy runs after it need little.
KV_FP8_TESTS_SHARE = {False: 0.15, True: 0.5}
# On a CPU the pool would be as large as the batch could use in either dtype: the same bytes for both show the gain.
# 32 output tokens: the long row's decode is most of its run, so its rate is measured on a busy two-core machine too
# (8 left it under the quarter below which suite_offline reports no rate).
KV_FP8_SMOKE = dict(
    batches="", output_len=32, long_context=64, long_batch=4, throughput_len=32, max_batch=64, kv_cache_bytes=2**22
)
KV_FP8_GRAPH_SIZES = "1,16,64,128,256,384,512,640,768,1024"
# The host_tier step (by name only): benchmarks/bench_host_tier.py, multi-turn conversations over a device pool that
# holds a quarter of their history, without and with the host tier (its copies on a CUDA stream on a GPU).
HOST_TIER_GPU = dict(
    conversations=16, turns=4, first_len=2048, user_len=256, output_len=32, max_batch_size=4, host_cache_mib=4096
)
HOST_TIER_SMOKE = dict(
    conversations=4, turns=3, first_len=64, user_len=16, output_len=4, max_batch_size=2, host_cache_mib=16
)
SERVED_PRESET = "low_latency"
GPU_LOADS = [
    ["--concurrency", "1", "--num-prompts", "4", "--input-len", "1024", "--output-len", "128"],
    ["--concurrency", "16", "--num-prompts", "32", "--input-len", "1024", "--output-len", "128"],
]
SMOKE_LOADS = [
    ["--concurrency", "1", "--num-prompts", "4", "--input-len", "32", "--output-len", "16"],
    ["--concurrency", "16", "--num-prompts", "16", "--input-len", "32", "--output-len", "16"],
]
SPEED_MARGIN_S = 10  # a speed run's own time limit ends this long before its step's deadline (its exit)


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    gpu_s: float  # the step's budget on a GPU; 0: whatever the window has left
    smoke_s: float  # the same in --smoke on a CPU
    min_s: tuple[float, float]  # (GPU, --smoke): with less time than this left in the window the step is not started
    body: Callable[[PhaseRecord, bool, float], int]
    in_plan: bool = True  # False: run only when named (--steps)

    def budget(self, smoke: bool) -> float:
        return self.smoke_s if smoke else self.gpu_s


def step_env(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    return phase_a(rec, smoke, budget)


def step_kernels(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    """The kernel tests, then (on a GPU) the MoE kernels side by side in the time kept for them."""
    bench = has_cuda() and not smoke
    status, counts = test_status(rec, list(KERNEL_TESTS), rec.left() - (MOE_BENCH_S if bench else 0))
    if bench:
        moe_kernels_side_by_side(rec)
    return rec.finish(status, **({"counts": counts} if counts else {}))


# The decode GEMV against the grouped GEMM at gpt-oss-120b's layer, one run (the first H100 run had the GEMM's
# batch 1 at ~15% of the bandwidth); 32 tokens is the GEMV's last default batch, 64 the GEMM's first.
MOE_BENCH = ("--batch", "1", "8", "32", "64", "--kernels", "gemm", "gemv", "--layers", "4", "--iters", "20")
MOE_BENCH_S = 25  # kept for it after the kernel tests


def moe_kernels_side_by_side(rec: PhaseRecord) -> None:
    out = rec.path.parent / "moe_kernels.json"
    out.unlink(missing_ok=True)
    title = "MoE kernels side by side: grouped GEMM vs decode GEMV, gpt-oss-120b layer (vs_first: GEMV / GEMM speed)"
    shown = shlex.join(["python", "benchmarks/bench_moe.py", *MOE_BENCH, "--out", "DIR/moe_kernels.json"])
    try:
        run_logged([sys.executable, "benchmarks/bench_moe.py", *MOE_BENCH, "--out", str(out)], rec.left() - 2)
        rows = moe_rows(json.loads(out.read_text()), ceilings(rec.path.parent))
    except (subprocess.TimeoutExpired, OSError, json.JSONDecodeError) as exc:
        rec.section(title, shown, [], f"not measured: {type(exc).__name__}: {exc}"[:300])
    else:
        rec.section(title, shown, rows)


def step_e2e(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    return run_tests(rec, list(E2E_TESTS), budget)


def step_speed_120b(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    return offline_speed(rec, smoke, budget, "gpt-oss-120b")


def step_speed_20b(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    return offline_speed(rec, smoke, budget, "gpt-oss-20b")


def offline_speed(rec: PhaseRecord, smoke: bool, budget: float, model: str) -> int:
    """benchmarks/suite_offline.py on one dummy model in one process (one load for every figure), its own time
    limit a little inside the step's deadline."""
    gpu = _on_gpu(rec, smoke, model)  # first: it imports torch
    name = model if gpu else TINY_NAME
    sizes = GPU_SPEED if gpu else SMOKE_SPEED
    path = rec.path.parent / f"{rec.path.stem.removeprefix('phase_')}.json"
    options = ["--graph-sizes", GRAPH_SIZES, "--profile", "short" if gpu else "always"]
    return rec.finish(run_offline(rec, name, name, path, sizes, options, rec.left()))


def flags(options: dict) -> list[str]:
    """A benchmark's command-line flags from a dict of its options (max_batch=64 -> --max-batch=64)."""
    return [f"--{key.replace('_', '-')}={value}" for key, value in options.items()]


def run_offline(
    rec: PhaseRecord, model: str, label: str, path: Path, sizes: dict, options: list[str], budget: float
) -> str:
    """One suite_offline.py run within `budget` seconds (at most the time to the step's deadline), its tables added
    to the step's record under `label` (on a SIGTERM at the step's budget too: the rows it wrote so far); the status
    ("ok" or why not)."""
    work = rec.path.parent
    path.unlink(missing_ok=True)
    command = [sys.executable, "benchmarks/suite_offline.py", "brisk", "--model", model, "--out", str(path)]
    command += ["--models-dir", str(work / "models"), "--time-budget", f"{max(5.0, budget - SPEED_MARGIN_S):.0f}"]
    command += flags(sizes) + options
    bandwidth = ceilings(work).get("copy_gbps")
    if bandwidth:
        command += ["--bandwidth-gbps", f"{bandwidth:.1f}"]
    status = "ok"
    shown = "python " + shlex.join(command[1:]).replace(str(work), "DIR")
    rec.on_stop = lambda: _offline_sections(rec, path, "brisk", label, shown)
    try:
        done = run_logged(command, min(budget, rec.left()))
        if done.returncode != 0:
            status = f"failed: exit code {done.returncode}"
    except subprocess.TimeoutExpired:
        status = "timeout: stopped at the step's budget (the rows it finished are below)"
    rec.on_stop = None
    if _offline_sections(rec, path, "brisk", label, shown):
        status = "failed: requests ended early (missing_tokens): the rates are not valid"
    return status


def step_kv_fp8(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    """The compiled FP8 attention path checked (KV_FP8_TESTS), then dummy gpt-oss-120b with the model's KV (bf16)
    and with FP8 KV, one process each at the same shapes and half the time left each: decode at long context and the
    throughput point (the largest batch the pool holds), then the two side by side."""
    gpu = _on_gpu(rec, smoke, "gpt-oss-120b")
    name = "gpt-oss-120b" if gpu else TINY_NAME
    sizes = KV_FP8_SPEED if gpu else KV_FP8_SMOKE
    options = ["--graph-sizes", KV_FP8_GRAPH_SIZES, "--profile", "never"]
    results, statuses = {}, []
    tests, _ = test_status(rec, list(KV_FP8_TESTS), min(KV_FP8_TESTS_S, KV_FP8_TESTS_SHARE[smoke] * rec.left()))
    statuses.append(f"FP8 kernels: {tests}")
    for i, dtype in enumerate(KV_DTYPES):
        share = rec.left() / (len(KV_DTYPES) - i)
        path = rec.path.parent / f"kv_fp8_{dtype}.json"
        status = run_offline(
            rec, name, f"{name}, KV {dtype}", path, sizes, [*options, "--kv-cache-dtype", dtype], share
        )
        statuses.append(f"KV {dtype}: {status}")
        try:
            results[dtype] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            results[dtype] = {}
    rec.section(f"KV dtype side by side, {name}", "the two runs above", [_rounded(r) for r in kv_dtype_rows(results)])
    failed = [s for s in statuses if not s.endswith(": ok")]
    return rec.finish("ok" if not failed else "failed: " + "; ".join(failed))


def step_host_tier(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    """benchmarks/bench_host_tier.py on dummy gpt-oss-20b (the toy on a CPU): two engines in one process, the same
    multi-turn workload interleaved turn by turn, one without and one with the host KV tier."""
    gpu = _on_gpu(rec, smoke, "gpt-oss-20b")
    name = "gpt-oss-20b" if gpu else TINY_NAME
    work = rec.path.parent
    model_dir = write_model_dir(name, work / "models")
    path = work / "host_tier.json"
    path.unlink(missing_ok=True)
    sizes = HOST_TIER_GPU if gpu else HOST_TIER_SMOKE
    command = [sys.executable, "benchmarks/bench_host_tier.py", "--model", model_dir, "--load-format", "dummy"]
    command += flags(sizes) + ["--out", str(path)]
    shown = "python " + shlex.join(command[1:]).replace(str(work), "DIR")
    title = f"Host KV tier, {name}"
    rec.on_stop = lambda: rec.section(title, shown, [], "stopped at the step's budget")
    try:
        done = run_logged(command, rec.left())
    except subprocess.TimeoutExpired:
        rec.on_stop = None
        rec.section(title, shown, [], "stopped at the step's budget")
        return rec.finish("timeout: stopped at the step's budget")
    rec.on_stop = None
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        rec.section(title, shown, [], "no results (see the log)")
        return rec.finish(f"failed: exit code {done.returncode}")
    note = (
        f"device pool {report['device_pool_blocks']} blocks ({report['device_pool_blocks'] / report['history_blocks']:.0%}"
        f" of the last turn's history); requests whose outputs agree: {report['outputs_agreeing']:.0%}"
    )
    rec.section(title, shown, [_rounded(r) for r in report["rows"]], note)
    # fp32 on a CPU: copied-back KV is the recomputed KV, bit for bit. bf16 on a GPU: near-ties may go either way.
    if not gpu and not report["outputs_identical"]:
        return rec.finish("failed: the host tier changed the outputs")
    copies = block_copy_section(rec, model_dir, work, gpu)
    if done.returncode != 0:
        return rec.finish(f"failed: exit code {done.returncode}")
    return rec.finish("ok" if copies == "ok" else f"failed: block copies: {copies}")


def block_copy_section(rec: PhaseRecord, model_dir: str, work: Path, gpu: bool) -> str:
    """benchmarks/bench_kv_block_copies.py at the model's KV layout: a step's copies of scattered blocks, brisk's
    way (staged batches on a GPU) against one copy per block and KV tensor; a few seconds."""
    path = work / "kv_block_copies.json"
    path.unlink(missing_ok=True)
    command = [sys.executable, "benchmarks/bench_kv_block_copies.py", "--config", model_dir, "--out", str(path)]
    command += ["--blocks", "16", "64"] if gpu else ["--blocks", "4", "--repeats", "2", "--staged"]
    shown = "python " + shlex.join(command[1:]).replace(str(work), "DIR")
    title = "Host KV tier block copies"
    try:
        done = run_logged(command, rec.left())
        report = json.loads(path.read_text())
    except subprocess.TimeoutExpired:
        rec.section(title, shown, [], "stopped at the step's budget")
        return "timeout"
    except (OSError, json.JSONDecodeError):
        rec.section(title, shown, [], "no results (see the log)")
        return f"exit code {done.returncode}"
    note = (
        f"{report['kv_tensors']} KV tensors, {report['bytes_per_block']:,} bytes a block; per_tensor / brisk: "
        + json.dumps(report["per_tensor_over_brisk"])
    )
    rec.section(title, shown, report["rows"], note)
    return "ok"


def kv_dtype_rows(results: dict[str, dict]) -> list[dict]:
    """One row per KV dtype (what it stored, the pool's tokens, decode at long context, the throughput point) and
    the FP8 / model-dtype ratios where both ran."""
    rows = []
    for dtype, data in results.items():
        meta, tables = data.get("meta", {}), data.get("rows", {})
        long = (tables.get("long_context") or [{}])[0]
        point = (tables.get("throughput") or [{}])[0]
        rows.append(
            dict(
                kv_cache_dtype=dtype,
                stored_as=meta.get("kv_stored_as"),
                kv_tokens=meta.get("kv_tokens"),
                long_context=long.get("input_len"),
                long_output_len=long.get("output_len"),
                long_tok_s_user=long.get("tok_s_user"),
                throughput_batch=point.get("batch"),
                throughput_len=point.get("input_len")
                and f"{point.get('input_len')} in / {point.get('output_len')} out",
                throughput_tok_s=point.get("output_tok_s_gpu"),
            )
        )
    if len(rows) == 2:
        base, fp8 = rows

        def ratio(key: str) -> float | None:
            return fp8[key] / base[key] if fp8.get(key) and base.get(key) else None

        rows.append(
            dict(
                kv_cache_dtype="ratio",
                stored_as=f"{fp8['stored_as']} / {base['stored_as']}",
                kv_tokens=ratio("kv_tokens"),
                long_context=None,
                long_output_len=None,
                long_tok_s_user=ratio("long_tok_s_user"),
                throughput_batch=ratio("throughput_batch"),
                # a ratio of points of different lengths (one run's cut to its time) is not the KV dtype's effect
                throughput_len="same" if base["throughput_len"] == fp8["throughput_len"] else "differ: see above",
                throughput_tok_s=ratio("throughput_tok_s") if base["throughput_len"] == fp8["throughput_len"] else None,
            )
        )
    return rows


def _on_gpu(rec: PhaseRecord, smoke: bool, model: str) -> bool:
    """Whether the step runs its real model; else a note says the toy gpt-oss stands in, and why."""
    gpu = has_cuda() and not smoke
    if not gpu:
        rec.data["notes"].append(f"dummy {model}: {NO_GPU if not has_cuda() else '--smoke'} (the toy model stands in)")
    return gpu


def step_served(rec: PhaseRecord, smoke: bool, budget: float) -> int:
    gpu = _on_gpu(rec, smoke, "gpt-oss-120b")
    model = "gpt-oss-120b" if gpu else TINY_NAME
    model_dir = write_model_dir(model, rec.path.parent / "models")
    loads = GPU_LOADS if gpu else SMOKE_LOADS
    status = serve_and_bench(rec, SERVED_PRESET, model, model_dir, loads, rec.left())
    return rec.finish("ok" if status == "ok" else f"failed: {status}")


STEPS = (
    Step("env", "environment and ceilings", 25, 10, (10, 5), step_env),
    Step("kernels", "correctness: Triton kernels vs torch at gpt-oss shapes", 95, 22, (30, 8), step_kernels),
    Step("e2e", "correctness: Triton vs torch end to end, CUDA graphs, overlap", 75, 16, (30, 8), step_e2e),
    Step("speed_120b", "speed: dummy gpt-oss-120b offline", 180, 25, (60, 15), step_speed_120b),
    Step("served_120b", "served: brisk serve + brisk bench serve, dummy gpt-oss-120b", 100, 32, (45, 15), step_served),
    Step("speed_20b", "speed: dummy gpt-oss-20b offline (where time remains)", 0, 0, (90, 8), step_speed_20b),
    Step("kv_fp8", "KV dtype: dummy gpt-oss-120b, bf16 vs FP8 KV (by name)", 420, 95, (120, 20), step_kv_fp8, False),
    Step(
        "host_tier", "host KV tier: dummy gpt-oss-20b, multi-turn (by name)", 150, 40, (60, 15), step_host_tier, False
    ),
)
STEP_NAMES = tuple(step.name for step in STEPS)  # what --steps may name
PLAN_STEPS = tuple(step for step in STEPS if step.in_plan)  # the quick plan when no step is named
PLAN_STEP_NAMES = tuple(step.name for step in PLAN_STEPS)


def plan(names: list[str], smoke: bool, scale: float) -> list[tuple[Step, float]]:
    """The steps to run, in the plan's order, each with its budget (0: what the window has left)."""
    chosen = [step for step in STEPS if step.name in names]
    return [(step, step.budget(smoke) * scale) for step in chosen]


def window_s(smoke: bool, scale: float) -> float:
    return (SMOKE_WINDOW_S if smoke else WINDOW_S) * scale


def step_budget(step: Step, nominal: float, deadline: float, smoke: bool, scale: float, grace: float) -> float:
    """What the step may take now: its own budget (or the rest of the window), never past the window's end less
    the time a stopped step takes to be cleaned up; 0 when that leaves less than the step's minimum."""
    left = deadline - time.monotonic() - 2 * grace
    budget = min(nominal, left) if nominal else left
    least = step.min_s[1 if smoke else 0] * scale
    return budget if budget >= least else 0.0
