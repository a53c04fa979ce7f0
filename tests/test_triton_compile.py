"""brisk's Triton kernels compile for Hopper (sm_90) at gpt-oss's shapes, through the real backend compiler.

Everywhere else the CPU tests run the kernels in Triton's interpreter, which never compiles them: a kernel that
passes there may still fail to compile for the GPU, need more shared memory than an H100 gives a block, or fall
back from tensor cores to FMA dots. tools/compile_kernels.py compiles every launch of the real wrappers for
sm_90 without a GPU (Triton's own compiler and ptxas, from its wheel) and reads the resources from the cubins.
"""

import json
import os
import subprocess
import sys

import pytest

from brisk.kernels import triton_attention, triton_moe

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launched_kernels() -> set[str]:
    """Every kernel the two modules launch (by convention, the @triton.jit functions named *_kernel)."""
    return {name for mod in (triton_attention, triton_moe) for name in dir(mod) if name.endswith("_kernel")}


def compile_report(out, *args: str) -> dict:
    """tools/compile_kernels.py's JSON report for `args`, compiled for real (a fresh Triton cache)."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton build has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out.parent / "cache")  # not from an earlier run's cache
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "compile_kernels.py"), *args, "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return compile_report(tmp_path_factory.mktemp("compile") / "report.json", "--quick")


def test_every_kernel_compiles_for_sm90_within_its_limits(report) -> None:
    assert report["arch"] == 90 and report["failures"] == [] and report["case_errors"] == {}
    compiled = {v["kernel"] for v in report["variants"]}
    assert _launched_kernels() <= compiled, f"kernels with no compile case: {_launched_kernels() - compiled}"
    assert "apply_token_bitmask_inplace_kernel" in compiled  # xgrammar's, for structured outputs on CUDA logits


def test_half_precision_dots_run_on_tensor_cores(report) -> None:
    # bf16 / FP8-KV attention and the MoE GEMMs on Hopper's MMA units (an FMA fallback would be many times slower);
    # the prefill's 128-row tiles on its warpgroup MMA.
    dotted = [v for v in report["variants"] if v["kernel"] in ("_prefill_kernel", "_decode_kernel", "_moe_gemm_kernel")]
    half = [v for v in dotted if not any("float32" in case for case in v["cases"])]
    assert half and all(v["mma"] in ("mma", "wgmma") for v in half), [(v["kernel"], v["cases"][0]) for v in half]
    assert all(v["mma"] == "wgmma" for v in half if v["kernel"] == "_prefill_kernel")


def test_no_kernel_spills_more_than_a_few_registers(report) -> None:
    # A few spilled registers vary with the Triton release; kilobytes a thread (fp32 attention on the half-precision
    # tiles spilled 14 KB before FP32_TILES) make a kernel many times slower.
    heavy = [(v["kernel"], v["cases"][0], v["local_bytes"]) for v in report["variants"] if v["local_bytes"] > 256]
    assert heavy == []


def test_fp8_kv_compiles_for_an_a100_as_codes(tmp_path) -> None:
    # sm_80 has no E4M3 type in Triton: the FP8 cache goes to the kernels as uint8 codes (fp8_as_codes).
    report = compile_report(tmp_path / "sm80.json", "--quick", "--arch", "80", "--only", "float8_e4m3fn")
    assert report["failures"] == [] and report["case_errors"] == {}
    assert {v["kernel"] for v in report["variants"]} >= {"_store_kv_kernel", "_decode_kernel", "_prefill_kernel"}


def test_batch_shapes_do_not_compile_variants_of_their_own(report) -> None:
    # Token counts, partition counts and block-table widths change with every batch: a kernel specialized on them
    # (a value of 1, a multiple of 16) would compile anew in the middle of serving. One split-K decode variant and
    # one reduce variant per attention case, whatever its batches; the MoE GEMV at 1 and 16 tokens shares one, the
    # 16-row GEMM (and its alignment) at 48 and 64.
    by_case: dict[tuple[str, str], int] = {}
    for v in report["variants"]:
        for case in v["cases"]:
            by_case[v["kernel"], case] = by_case.get((v["kernel"], case), 0) + 1
    attention = [case for kernel, case in by_case if kernel == "_decode_reduce_kernel"]
    assert attention and all(by_case["_decode_reduce_kernel", case] == 1 for case in attention)
    assert all(by_case["_decode_kernel", case] == 2 for case in attention)  # split-K and one partition
    shared = {"_moe_gemv_kernel": ("1", "16"), "_moe_align_kernel": ("48", "64"), "_moe_gemm_kernel": ("48", "64")}
    for kernel, (fewer, more) in shared.items():
        variants = [v for v in report["variants"] if v["kernel"] == kernel]
        assert variants, kernel
        for v in variants:
            tokens = {case.rsplit("tokens=", 1)[1] for case in v["cases"]}
            assert (fewer in tokens) == (more in tokens), (kernel, v["cases"])
