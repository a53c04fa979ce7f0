"""brisk's CPU kernels (C, built at first use) vs the PyTorch paths: decode attention vs the reference
`TorchAttentionBackend`, RMSNorm, gpt-oss's activation, the decode-sized matmul and MoE vs their torch ops.

Every test of a kernel runs on every build this CPU runs (`kernels` is parametrized by instruction set: on an
AVX-512 machine both the avx512 and the avx2 build, the one AVX2-only CPUs run; `--cpu-kernels X` narrows it to
X). Tolerances are each path's own: where a kernel sums in another order than torch (the RMSNorm's sum of squares,
the matmul's dot products), bf16 results may differ by one rounding; where it rounds at the same places on the same
values (the activation, the MoE against its torch path with the same matmul kernel), they are identical.

Every cache starts as NaN (tests/paged_cases.py), so a read of the null block, of a released block, of an
unwritten slot or past a sequence's end poisons the output and fails the comparison. The build itself is
tested too: this machine must build it (CI runs the kernel, not the fallback), and a failed build falls back.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from brisk.config import ConfigError, EngineConfig
from brisk.kernels import cpu_kernels
from brisk.layers.attention import TorchAttentionBackend
from brisk.layers.attention_cpu import CpuAttentionBackend
from brisk.layers.backends import make_attention_backend
from brisk.layers.embedding import ParallelLMHead
from brisk.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    linear,
)
from brisk.layers.moe import FusedMoE, clamped_swiglu, select_experts
from brisk.layers.mxfp4 import dequantize_mxfp4
from brisk.layers.norm import RMSNorm
from brisk.model_config import ParallelConfig
from tests.conftest import skip_unless_isa_under_test
from tests.paged_cases import TINY, Shape, assert_close, make_case

CPU = torch.device("cpu")
# Mixed steps: decodes (1 new token) at contexts shorter than, equal to and longer than the windows and pages,
# prefill chunks over cached prefixes, a one-token prompt, a sequence with nothing scheduled.
# 5, 7, 9, 3 new tokens: the decode kernel token by token (a short query: speculative decoding); 20: per sequence
MIXED_SPECS = [(1, 9), (5, 19), (7, 7), (1, 1), (0, 5), (9, 30), (1, 6), (1, 41), (3, 8), (20, 45)]
DECODE_SPECS = [(1, 1), (1, 7), (1, 8), (1, 9), (1, 16), (1, 17), (1, 50), (1, 93)]


@contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(cpu_kernels.ISA_FLAGS))
def kernels(request) -> cpu_kernels.CpuKernels:
    """Each build this run tests (skipped, with the reason, where this CPU does not run it or has no compiler:
    brisk then runs its PyTorch paths, tested everywhere else)."""
    skip_unless_isa_under_test(request.config, request.param)
    loaded = cpu_kernels.load_cpu_kernels(request.param)
    assert loaded is not None and loaded.isa == request.param, "this CPU runs the build: it must build and load"
    return loaded


@pytest.fixture(scope="module")
def backend(kernels) -> CpuAttentionBackend:
    return CpuAttentionBackend(kernels)


@pytest.mark.parametrize("specs", [DECODE_SPECS, MIXED_SPECS], ids=["decode", "mixed"])
@pytest.mark.parametrize("window", [None, 6, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_matches_reference(backend, specs, window, group, use_sinks):
    shape = Shape(TINY.heads * 2, TINY.heads * 2 // group, TINY.head_dim, TINY.page, TINY.block_n)
    case = make_case(shape, specs, window, seed=group)
    out, layer = case.run(backend, use_sinks)
    assert_close(out, case.reference(use_sinks))
    ref_layer = case.run(TorchAttentionBackend(), use_sinks)[1]
    assert torch.equal(layer.k_cache.nan_to_num(), ref_layer.k_cache.nan_to_num())  # the step's K/V stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [32, 40, 64, 128])
def test_cache_dtypes_threads_and_head_sizes(backend, dtype, threads, head_dim):
    # 32 / 64 / 128 take the kernel's constant-size code, 40 (no vector multiple) the generic one; page 5: not a
    # power of two
    shape = Shape(heads=6, kv_heads=2, head_dim=head_dim, page=5, block_n=16)
    case = make_case(shape, DECODE_SPECS + [(4, 23)], window=11, dtype=dtype, seed=3)
    with torch_threads(threads):
        out = case.run(backend, True)[0]
    assert out.dtype == dtype
    assert_close(out, case.reference(True))


def test_step_plan_is_built_once_per_step_and_shared_by_layers(backend):
    a = make_case(TINY, MIXED_SPECS, window=6, seed=4)
    plan = a.meta.attn_plan = backend.prepare(a.meta)  # what the runner does once per step
    a.meta.attn_plan_backend = backend
    assert plan.rows is not None and plan.has_multi_token
    assert_close(a.run(backend, False)[0], a.reference(False))
    assert_close(a.run(backend, True)[0], a.reference(True))  # next layer, same step
    assert a.meta.attn_plan is plan
    b = make_case(TINY, DECODE_SPECS, seed=5)
    out = b.run(backend, True)[0]  # metadata no runner prepared: planned on first use
    assert b.meta.attn_plan is not plan and b.meta.attn_plan.rows is None  # a pure decode step: rows 0..B-1
    assert_close(out, b.reference(True))


def test_loading_the_kernels_leaves_the_process_floating_point_state_alone(kernels):
    # A library linked with -ffast-math would switch on flush-to-zero for the whole process when loaded.
    assert sys.float_info.min / 4 > 0.0
    assert torch.tensor(1e-40) * 1.0 > 0.0  # torch ops keep subnormals too


def test_auto_picks_the_kernel_on_cpu_when_built(kernels):
    assert isinstance(make_attention_backend("auto", CPU, kernels), CpuAttentionBackend)
    assert type(make_attention_backend("auto", CPU, None)) is TorchAttentionBackend
    assert type(make_attention_backend("torch", CPU, kernels)) is TorchAttentionBackend
    with pytest.raises(ValueError, match="'cpu' needs"):
        make_attention_backend("cpu", CPU, None)


def test_a_failed_build_leaves_the_torch_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(cpu_kernels, "cpu_kernel_isas", lambda: ("avx2",))  # whatever this CPU runs
    assert cpu_kernels.load_cpu_kernels("auto") is None
    assert not list(tmp_path.rglob("*.so"))  # no half-built library left behind
    with pytest.raises(ValueError, match="cpu_kernels: the avx2 kernels asked for could not be built"):
        cpu_kernels.load_cpu_kernels("avx2")  # asked for by name: an error, not a silent fallback


def test_the_build_is_cached_per_source_and_machine(kernels, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cpu_kernels.build_cpu_kernels(kernels.isa)
    assert first is not None and first.parent == tmp_path / "brisk" / "kernels"
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build_cpu_kernels(kernels.isa) == first and first.stat().st_mtime_ns == mtime  # not rebuilt


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils) to read the machine code")
def test_each_build_uses_its_instruction_set_only(kernels):
    # The avx2 build must run on CPUs without AVX-512: no zmm register, no opmask, anywhere in the library; the
    # avx512 build is the one that has them.
    code = subprocess.run(
        ["objdump", "-d", str(cpu_kernels.build_cpu_kernels(kernels.isa))], capture_output=True, text=True, check=True
    ).stdout
    uses_avx512 = "%zmm" in code or "%k1" in code
    assert uses_avx512 == (kernels.isa == "avx512")
    assert "vfmadd" in code and "%ymm" in code  # vectorized with FMA in both


def test_the_path_is_chosen_from_the_cpu_and_the_config(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "cpu_kernel_isas", lambda: ())  # e.g. an Arm CPU, or an x86 without AVX2
    with caplog.at_level("INFO", logger=cpu_kernels.__name__):
        assert cpu_kernels.load_cpu_kernels("auto") is None
    assert "CPU kernels: PyTorch ops (this CPU has neither AVX-512 nor AVX2 + FMA)" in caplog.text
    assert cpu_kernels.load_cpu_kernels("torch") is None
    with pytest.raises(ValueError, match="'avx2' needs a CPU with avx2, fma; this one runs: none"):
        cpu_kernels.load_cpu_kernels("avx2")


def test_the_config_field_names_the_paths_and_refuses_what_the_cpu_lacks(monkeypatch):
    assert EngineConfig.build("m", cpu_kernels=True).cpu_kernels == "auto"  # the field's first form, still valid
    assert EngineConfig.build("m", cpu_kernels=False).cpu_kernels == "torch"
    monkeypatch.setattr("brisk.host.cpu_kernel_isas", lambda: ("avx2",))  # an AVX2-only CPU
    assert EngineConfig.build("m", cpu_kernels="avx2").cpu_kernels == "avx2"
    with pytest.raises(ConfigError, match="option 'cpu_kernels': .*'avx512' needs a CPU with avx2, avx512bw"):
        EngineConfig.build("m", cpu_kernels="avx512")
    with pytest.raises(ConfigError, match="option 'cpu_kernels'"):
        EngineConfig.build("m", cpu_kernels="sse")


@pytest.mark.parametrize("weight_in_fp32", [True, False])
@pytest.mark.parametrize("rows", [1, 33])
def test_rms_norm_matches_the_torch_path(kernels, weight_in_fp32, rows):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 3000, generator=g) * 3
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(2880, 1e-5, weight_in_fp32).to(dtype)
        norm.weight.data = torch.randn(2880, generator=g).to(dtype)
        x = wide.to(dtype)[:, :2880]  # rows 3000 apart: a strided view, as a fused projection's slice is
        reference = norm(x)
        norm.cpu_kernels = kernels
        out = norm(x)
        assert out.dtype == dtype and out.shape == (rows, 2880)
        if dtype == torch.bfloat16:
            # The fp32 sum of squares runs in another order than torch's (the vector width and the compiler's
            # unrolling decide it; on some builds it happens to be torch's): the scale can differ in its last bit,
            # and a value next to a bf16 rounding boundary then rounds to the neighbour. At most one bf16 ulp.
            ulp = 2.0 ** (torch.floor(torch.log2(reference.float().abs().clamp(min=1e-30))) - 7)
            assert ((out.float() - reference.float()).abs() <= ulp).all()
            assert (out == reference).float().mean() >= 0.99
        else:  # the sum of squares in another order
            torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)


def test_rms_norm_leaves_what_the_kernel_does_not_take_to_torch(kernels):
    norm = RMSNorm(16, 1e-6)
    norm.cpu_kernels = kernels
    heads = torch.randn(3, 4, 16)  # per-head q/k norms (Qwen3) are 3-d
    torch.testing.assert_close(norm(heads), heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert not kernels.rms_norm_accepts(torch.randn(2, 16, dtype=torch.float16), torch.ones(16, dtype=torch.float16))
    assert not kernels.rms_norm_accepts(torch.randn(2, 16), torch.ones(16, dtype=torch.bfloat16))


@pytest.mark.parametrize("halves", [True, False])
@pytest.mark.parametrize("rows", [1, 37])
def test_clamped_swiglu_matches_the_torch_ops(kernels, halves, rows):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 200, generator=g) * 6  # beyond the +-7 clamp often enough
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = wide.to(dtype)[:, :192]  # rows 200 apart
        reference = clamped_swiglu(gate_up, 1.702, 7.0, halves=halves)
        out = kernels.clamped_swiglu(gate_up, 1.702, 7.0, halves)
        assert out.dtype == dtype and out.shape == (rows, 96)
        if dtype == torch.bfloat16:  # every op rounded as torch rounds it: identical
            assert torch.equal(out, reference)
        else:
            torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_is_finite_where_the_sigmoid_underflows(kernels, dtype):
    # Gates below -88.7 / alpha put exp(-alpha * gate) beyond fp32's range: sigmoid = 0, the activation -0 (torch).
    # Random MXFP4 experts (dummy weights) reach such gates at every layer. 48 columns: whole vectors of 8 and 16
    # lanes (where the compiled division is a reciprocal estimate) and a scalar tail on both builds.
    g = torch.Generator().manual_seed(7)
    gate = -torch.logspace(1, 30, 48 * 3).reshape(3, 48)[:, torch.randperm(48, generator=g)]
    gate[1, ::3] = torch.randn(16, generator=g) * 6  # ordinary gates among them
    up = torch.randn(3, 48, generator=g) * 4
    gate_up = torch.stack([gate, up], -1).flatten(1).to(dtype)  # interleaved, as checkpoints store them
    reference = clamped_swiglu(gate_up, 1.702, 7.0)
    out = kernels.clamped_swiglu(gate_up, 1.702, 7.0, False)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-30)


@pytest.mark.parametrize("threads", [1, 2])
def test_apply_token_bitmask_matches_xgrammar(kernels, threads):
    # Structured outputs' mask: a vocabulary that is not a multiple of 32 (a partial last word), logits wider than it
    # (a padded LM head: columns past the vocabulary untouched), words all allowed / all forbidden / mixed, a subset
    # of the rows, rows of both tensors strided.
    import xgrammar as xgr

    g = torch.Generator().manual_seed(threads)
    vocab, words = 1000, 32
    logits = torch.randn(7, 1100, generator=g)[:, :1050]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (7, words + 3), dtype=torch.int32, generator=g)[:, :words]
    bitmask[:, 0], bitmask[:, 1] = -1, 0
    rows = [0, 3, 6]
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask.contiguous(), vocab_size=vocab, indices=rows)
    ours = logits.clone()
    assert kernels.bitmask_accepts(ours, bitmask)
    kernels.apply_token_bitmask(ours, bitmask, rows, vocab, threads)
    assert torch.equal(ours, expected)
    assert torch.isinf(ours[rows, 32:64]).all() and torch.equal(ours[:, :32], logits[:, :32])
    assert torch.equal(ours[[1, 2, 4, 5]], logits[[1, 2, 4, 5]]) and torch.equal(ours[:, vocab:], logits[:, vocab:])


@pytest.mark.parametrize("rows", [1, 5])
def test_silu_and_mul_matches_the_torch_ops(kernels, rows):
    # 100 columns a half: whole vectors of 8 and 16 lanes and a scalar tail; gates from -200 (exp(-g) beyond fp32's
    # range: silu = -0, see sigmoid in cpu_kernels.c) to large positive ones.
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 210, generator=g) * 8
    wide[0, :10] = torch.tensor([-200.0, -100.0, -90.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 200.0])
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = wide.to(dtype)[:, :200]  # rows 210 apart
        gate, up = gate_up.chunk(2, dim=-1)
        reference = torch.nn.functional.silu(gate) * up
        out = kernels.silu_and_mul(gate_up)
        assert out.dtype == dtype and out.shape == (rows, 100) and torch.isfinite(out).all()
        if dtype == torch.bfloat16:  # the silu and the product rounded as torch rounds them
            assert (out == reference).float().mean() >= 0.99
            torch.testing.assert_close(out, reference, rtol=2**-7, atol=1e-6)
        else:
            torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)


def test_llama_mlp_uses_the_kernel_only_where_bound(kernels, monkeypatch):
    from brisk.models.llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(16, 24, "silu", False, ParallelConfig())
    for p in mlp.parameters():
        p.data.normal_()
    x = torch.randn(3, 16)
    unbound = mlp(x)
    calls = []
    silu_and_mul = cpu_kernels.CpuKernels.silu_and_mul
    monkeypatch.setattr(type(kernels), "silu_and_mul", lambda self, t: calls.append(t.shape) or silu_and_mul(self, t))
    mlp.cpu_kernels = kernels
    torch.testing.assert_close(mlp(x), unbound, rtol=1e-5, atol=1e-5)
    assert calls == [(3, 48)]


def test_moe_layer_uses_the_kernel_only_where_bound(kernels):
    moe = FusedMoE(4, 2, 16, 8)
    gate_up = torch.randn(3, 16)
    assert torch.equal(moe.activation(gate_up, False), clamped_swiglu(gate_up, moe.swiglu_alpha, moe.swiglu_limit))
    moe.cpu_kernels = kernels
    torch.testing.assert_close(
        moe.activation(gate_up, False),
        clamped_swiglu(gate_up, moe.swiglu_alpha, moe.swiglu_limit),
        rtol=1e-6,
        atol=1e-6,
    )
    assert not kernels.swiglu_accepts(gate_up.half()) and not kernels.swiglu_accepts(gate_up.t())


# 40: a masked last chunk for AVX-512's 16 lanes; 36: a scalar tail after AVX2's 8 lanes; 1100: AVX2's columns in
# two chunks, the second ending in 16s, an 8 and a scalar tail
@pytest.mark.parametrize("k, n", [(512, 1024), (40, 24), (36, 20), (1100, 40), (2880, 333), (64, 4160)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_kernel_matches_torch(kernels, k, n, with_bias):
    g = torch.Generator().manual_seed(k + n)
    wide = torch.randn(65, k + 8, generator=g)[:, :k]  # rows k + 8 apart
    weight = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    for dtype in (torch.float32, torch.bfloat16):
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        for rows in (*range(1, 10), 16, 17, 63, 64, 65):  # 8 rows a pass, then the rest; the bound
            x = wide[:rows].to(dtype)
            assert kernels.linear_accepts(x, w, b) == (rows <= cpu_kernels.LINEAR_MAX_ROWS)
            if rows > cpu_kernels.LINEAR_MAX_ROWS:
                continue
            reference = torch.nn.functional.linear(x, w, b)
            with torch_threads(2 if rows in (17, 64) else 1):  # weight rows split among threads
                out = kernels.linear(x, w, b)
            assert out.dtype == dtype and out.shape == (rows, n)
            if dtype == torch.float32:
                torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6 * k)  # fp32 sums of k products
            else:  # the same exact fp32 products (bf16 x bf16 fits in fp32) summed in another order, one rounding
                assert (out == reference).float().mean() >= 0.99
                torch.testing.assert_close(out, reference, rtol=2**-7, atol=1e-3)


def test_avx512_fp32_linear_row_does_not_depend_on_its_batch(request):
    # The AVX-512 build's fp32 matmul sums each (row, weight row) in one fixed order, at 1-2 rows (one weight row a
    # pass) as in the 6 x 4 blocks from 3 rows on: a request's logits are the same bits whatever else runs in the
    # step (padding rows, other requests, how many rows gpt-oss routes to an expert) and however the weight rows
    # are split among threads.
    skip_unless_isa_under_test(request.config, "avx512")
    kernels = cpu_kernels.load_cpu_kernels("avx512")
    assert kernels is not None
    g = torch.Generator().manual_seed(5)
    for k, n in ((40, 333), (512, 70)):  # a masked tail of k; weight rows not a multiple of 4 (a group repeats one)
        x, weight, bias = torch.randn(20, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        alone = kernels.linear(x[:1], weight, bias)
        for rows, threads in ((2, 1), (3, 2), (7, 1), (16, 1), (20, 2)):
            with torch_threads(threads):
                out = kernels.linear(x[:rows], weight, bias)
            assert torch.equal(out[:1], alone), (k, n, rows, threads)
            torch.testing.assert_close(out, torch.nn.functional.linear(x[:rows], weight, bias), rtol=1e-5, atol=1e-4)


def test_avx512_build_without_avx512_bf16_matches_torch(request):
    # AVX-512 CPUs without AVX512-BF16 (Skylake-SP, Ice Lake) take the AVX2 bf16 kernels inside the avx512 build.
    skip_unless_isa_under_test(request.config, "avx512")
    kernels = cpu_kernels.load_cpu_kernels("avx512", ("-mno-avx512bf16",))
    assert kernels is not None
    g = torch.Generator().manual_seed(11)
    for k, n in ((1100, 40), (64, 300)):
        weight, bias = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
        for rows in (1, 3, 8, 17):
            x = torch.randn(rows, k, generator=g).bfloat16()
            reference = torch.nn.functional.linear(x, weight, bias)
            out = kernels.linear(x, weight, bias)
            assert (out == reference).float().mean() >= 0.99  # as in test_linear_kernel_matches_torch
            torch.testing.assert_close(out, reference, rtol=2**-7, atol=1e-3)


def test_linear_takes_the_kernel_for_decode_sized_inputs_only(kernels, monkeypatch):
    calls = []
    monkeypatch.setattr(type(kernels), "linear", lambda self, x, *a: calls.append(x) or torch.zeros(x.shape[0], 8))
    weight = torch.randn(8, 32).bfloat16()
    linear(torch.randn(1, 32).bfloat16(), weight, None, None, kernels)
    linear(torch.randn(1, 32), weight.float(), None, None, kernels)
    assert len(calls) == 2
    linear(torch.randn(cpu_kernels.LINEAR_MAX_ROWS + 1, 32).bfloat16(), weight, None, None, kernels)  # a matmul
    linear(torch.randn(1, 32).bfloat16(), weight, None, None, None)  # not bound
    assert not kernels.linear_accepts(torch.randn(1, 32), weight, None)  # mixed dtypes
    assert len(calls) == 2


def test_every_dense_layer_takes_the_bound_kernel(kernels, monkeypatch):
    # Column, merged, QKV, row-parallel linears and the LM head all reach `linear` with their bound kernels.
    calls = []
    monkeypatch.setattr(type(kernels), "linear", lambda self, x, w, b: calls.append(w.shape) or x @ w.T)
    with torch.device("cpu"):
        layers = {
            "column": ColumnParallelLinear(32, 16),
            "merged": MergedColumnParallelLinear(32, [8, 8]),
            "qkv": QKVParallelLinear(32, 8, 2, 1),
            "row": RowParallelLinear(32, 16),
            "head": ParallelLMHead(40, 32),
        }
    for name, layer in layers.items():
        layer.cpu_kernels = kernels
        calls.clear()
        layer(torch.randn(1, 32))
        assert calls == [layer.weight.shape], name
        # no oneDNN copy of a weight the kernels serve (bf16 on CPU is what is otherwise prepacked)
        assert layer.to(torch.bfloat16).prepack() == 0 and layer.packed_weight is None, name


def test_prepacked_bf16_experts_with_the_kernels_compute_what_plain_ones_do(kernels):
    # Prepacking regroups gate_up (packed and plain copies alike); experts with a few rows then take the kernel on
    # the plain copy, more rows the oneDNN matmul on the packed one: both must agree with unpacked experts.
    g = torch.Generator().manual_seed(7)
    moe = FusedMoE(4, 2, 64, 32).to(torch.bfloat16)
    for param in moe.parameters():
        param.data.copy_(torch.randn(param.shape, generator=g))
    plain = FusedMoE(4, 2, 64, 32).to(torch.bfloat16)
    plain.load_state_dict(moe.state_dict())
    if moe.prepack() == 0:
        pytest.skip("this CPU's torch has no oneDNN bf16 matmul")
    assert moe.gate_up_halves and not plain.gate_up_halves
    moe.cpu_kernels = kernels
    for rows in (1, 5, 40):  # one token: the one-token path; 5 and 40: sorted slots, few and many rows an expert
        x = torch.randn(rows, 64, generator=g).bfloat16()
        router = torch.randn(rows, 4, generator=g).bfloat16()
        torch.testing.assert_close(moe(x, router), plain(x, router), rtol=2**-6, atol=2e-2)


@pytest.mark.parametrize("dtype, halves", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_moe_kernel_computes_what_the_torch_path_does(kernels, monkeypatch, dtype, halves, tokens):
    # The one-call MoE against the same layer's torch path (sort, per-expert matmuls through the same matmul
    # kernel, activation, scatter, weighting): bf16 identical, since both round at the same places. Some slots
    # go to "another rank's" experts (-1) and count nothing.
    g = torch.Generator().manual_seed(tokens)
    moe = FusedMoE(6, 3, 64, 48).to(dtype)
    for param in moe.parameters():
        param.data.copy_(torch.randn(param.shape, generator=g))
    if halves:
        moe.prepack()
        if not moe.gate_up_halves:
            pytest.skip("this CPU's torch has no oneDNN bf16 matmul (prepacking regroups the gates and ups)")
    moe.cpu_kernels = kernels
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(tokens)])
    ids[1::3, 0] = -1
    weights = torch.rand(tokens, 3, generator=g).to(dtype)
    one_call = kernels.moe_experts(
        x,
        ids,
        weights,
        moe.gate_up_proj,
        moe.gate_up_proj_bias,
        moe.down_proj,
        moe.down_proj_bias,
        moe.gate_up_halves,
        moe.swiglu_alpha,
        moe.swiglu_limit,
    )
    # The layer takes the one call for decode-sized batches.
    assert kernels.moe_accepts(x, moe.gate_up_proj)
    assert torch.equal(moe.backend.forward(moe, x, ids, weights), one_call)
    monkeypatch.setattr(type(kernels), "moe_accepts", lambda *args: False)
    torch_path = moe.backend.forward(moe, x, ids, weights)
    if dtype == torch.bfloat16:  # the torch path's matmuls went through the same kernel
        assert torch.equal(one_call, torch_path)
    else:
        torch.testing.assert_close(one_call, torch_path, rtol=1e-5, atol=1e-6 * one_call.abs().max().item())
    moe.cpu_kernels = None  # pure torch: the reference matmuls
    torch.testing.assert_close(
        one_call,
        moe.backend.forward(moe, x, ids, weights),
        rtol=2**-6,
        atol=2**-7 * one_call.float().abs().max().item(),
    )
    # Without down_proj's bias (MoE tensor-parallel ranks but the first) the output lacks just the weighted biases.
    no_down_bias = kernels.moe_experts(
        x,
        ids,
        weights,
        moe.gate_up_proj,
        moe.gate_up_proj_bias,
        moe.down_proj,
        None,
        moe.gate_up_halves,
        moe.swiglu_alpha,
        moe.swiglu_limit,
    )
    picked = (weights.float() * (ids >= 0))[..., None] * moe.down_proj_bias.float()[ids.clamp(min=0)]
    scale = one_call.float().abs().max().item()  # bf16 rounds both outputs at their magnitude
    torch.testing.assert_close(one_call.float() - no_down_bias.float(), picked.sum(1), rtol=0, atol=2**-7 * scale)


def test_moe_kernel_refuses_quantized_or_prefill_sized_inputs(kernels):
    moe = FusedMoE(4, 2, 64, 32)
    assert kernels.moe_accepts(torch.randn(4, 64), moe.gate_up_proj)
    assert not kernels.moe_accepts(torch.randn(cpu_kernels.LINEAR_MAX_ROWS + 1, 64), moe.gate_up_proj)
    assert not kernels.moe_accepts(torch.randn(4, 64).bfloat16(), moe.gate_up_proj)  # mixed dtypes


# ---------------------------------------------------------------- MXFP4 experts


def random_mxfp4(shape: tuple[int, ...], gen: torch.Generator, scales=(118, 130)) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks [..., G, 16] (every E2M1 code, both zeros included) and scale bytes in [low, high)."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    return blocks, torch.randint(*scales, shape, generator=gen, dtype=torch.uint8)


def assert_fp32_exact_up_to_sum_order(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """out = x @ weight.T + bias where every product is exact in fp32: against the fp64 sum, out may differ by the
    rounding of K fp32 additions (bounded by K ulps of the sum of |products|), then by its own dtype's rounding."""
    x64, w64 = x.double(), weight.double()
    reference = x64 @ w64.T + (0 if bias is None else bias.double())
    magnitude = x64.abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
    bound = magnitude * x.shape[1] * 2.0**-24
    if out.dtype == torch.bfloat16:
        bound = bound + reference.abs() * 2.0**-8  # one bf16 rounding (half an ulp: 2^-9 relative) and its tie
    assert ((out.double() - reference).abs() <= bound + 1e-30).all()


def test_mxfp4_dequantize_is_dequantize_mxfp4(kernels):
    # Every scale byte, 0 (the subnormal 2^-127) and 255 (+inf, so the zeros' values are NaN) included.
    gen = torch.Generator().manual_seed(1)
    blocks, _ = random_mxfp4((2, 256, 3), gen)
    scales = torch.arange(256, dtype=torch.uint8).repeat(2, 3, 1).permute(0, 2, 1).contiguous()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        expected = dequantize_mxfp4(blocks, scales, dtype)
        for threads in (1, 2):
            with torch_threads(threads):
                out = kernels.dequantize_mxfp4(blocks, scales, dtype)
            assert out.dtype == dtype and out.shape == (2, 256, 96)
            torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    strided = blocks[:, ::2]  # not contiguous: copied first
    expected = dequantize_mxfp4(blocks, scales, torch.float32)[:, ::2]
    out = kernels.dequantize_mxfp4(strided, scales[:, ::2], torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError):
        kernels.dequantize_mxfp4(blocks, scales[..., :2], torch.float32)


# K: one block, 3 blocks, gpt-oss's 90; N: fewer rows than a group of weight rows, groups with a remainder,
# several tiles split among threads
@pytest.mark.parametrize("k, n", [(32, 1), (96, 7), (64, 333), (2880, 70)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_mxfp4_linear_is_the_dequantized_matmul_to_fp32_rounding(kernels, k, n, with_bias):
    gen = torch.Generator().manual_seed(k + n)
    blocks, scales = random_mxfp4((n, k // 32), gen)
    weight = dequantize_mxfp4(blocks, scales, torch.float32)
    wide = torch.randn(65, k + 8, generator=gen)[:, :k]  # rows k + 8 apart
    bias = torch.randn(n, generator=gen) if with_bias else None
    for dtype in (torch.float32, torch.bfloat16):
        b = None if bias is None else bias.to(dtype)
        for rows in (1, 2, 3, 4, 5, 8, 9, 17, 64, 65):  # 4 rows a pass, then the rest; the bound
            x = wide[:rows].to(dtype)
            accepted = kernels.mxfp4_linear_accepts(x, blocks, b)
            assert accepted == (rows <= cpu_kernels.LINEAR_MAX_ROWS)
            if not accepted:
                continue
            with torch_threads(2 if rows in (3, 17) else 1):
                out = kernels.mxfp4_linear(x, blocks, scales, b)
            assert out.dtype == dtype and out.shape == (rows, n)
            assert_fp32_exact_up_to_sum_order(out, x, weight, b)
            if dtype == torch.bfloat16:  # rounded once, as torch's bf16 matmul of the dequantized weight rounds
                reference = torch.nn.functional.linear(x, weight.bfloat16(), b)
                assert (out == reference).float().mean() >= 0.99


def test_mxfp4_linear_rows_do_not_depend_on_their_batch_and_edge_scales_are_exact(kernels):
    # A row's sums run in one fixed order whatever else is in the call (so a request's logits do not depend on
    # what it is batched with); scale bytes 0 and 1 (subnormal and smallest normal) and 252 (6 x 2^125, near fp32's largest) stay exact.
    gen = torch.Generator().manual_seed(4)
    blocks, scales = random_mxfp4((37, 6), gen)
    scales[0], scales[1], scales[2, :3] = 0, 1, 252
    x = torch.randn(11, 192, generator=gen) * 2.0**-10
    alone = kernels.mxfp4_linear(x[:1], blocks, scales, None)
    for rows, threads in ((2, 1), (5, 2), (11, 1)):
        with torch_threads(threads):
            out = kernels.mxfp4_linear(x[:rows], blocks, scales, None)
        assert torch.equal(out[:1], alone)
    assert_fp32_exact_up_to_sum_order(alone, x[:1], dequantize_mxfp4(blocks, scales, torch.float32), None)
    assert not kernels.mxfp4_linear_accepts(x[:, :160], blocks, None)  # K does not match the blocks
    assert not kernels.mxfp4_linear_accepts(x, blocks, torch.zeros(37).bfloat16())  # mixed dtypes


def mxfp4_moe(e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int, parallel=None) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    moe = FusedMoE(e, k, h, i, quantization="mxfp4", parallel=parallel or ParallelConfig())
    full = FusedMoE(e, k, h, i, quantization="mxfp4")  # the checkpoint's tensors, loaded through the layer's loaders
    for name, param in full.named_parameters():
        if param.dtype == torch.uint8:
            value = (
                random_mxfp4(param.shape[:-1], gen)[0] if name.endswith("blocks") else random_mxfp4(param.shape, gen)[1]
            )
        else:
            value = torch.randn(param.shape, generator=gen)
        param = getattr(moe, name)
        param.weight_loader(param, value.to(param.dtype) if param.dtype == torch.uint8 else value.to(dtype), None)
    return moe.to(dtype) if dtype != torch.float32 else moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_mxfp4_moe_kernel_computes_what_the_torch_path_does(kernels, monkeypatch, dtype, tokens):
    # The one-call MXFP4 MoE against the same layer's torch path (per-expert matmuls through brisk_mxfp4_linear,
    # activation, scatter, weighting; bf16: identical) and against the reference: dequantize_mxfp4 and torch's
    # matmuls (to fp32 rounding). Odd shapes: I = 96 (3 blocks), H = 64; some slots go to another rank (-1).
    moe = mxfp4_moe(6, 3, 64, 96, dtype, seed=tokens)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(tokens)])
    ids[1::3, 0] = -1
    weights = torch.rand(tokens, 3, generator=g).to(dtype)
    moe.cpu_kernels = kernels
    assert kernels.moe_mxfp4_accepts(x, moe.gate_up_proj_blocks)
    calls = []
    one_call = kernels.moe_experts_mxfp4
    monkeypatch.setattr(type(kernels), "moe_experts_mxfp4", lambda self, *a: calls.append(1) or one_call(*a))
    fused = moe.backend.forward(moe, x, ids, weights)
    assert calls == [1]
    monkeypatch.setattr(type(kernels), "moe_mxfp4_accepts", lambda *args: False)
    torch_path = moe.backend.forward(moe, x, ids, weights)
    if dtype == torch.bfloat16:
        assert torch.equal(fused, torch_path)
    else:
        torch.testing.assert_close(fused, torch_path, rtol=1e-5, atol=1e-6 * fused.abs().max().item())
    moe.cpu_kernels = None  # dequantize_mxfp4 and torch's matmuls
    reference = moe.backend.forward(moe, x, ids, weights)
    scale = reference.float().abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6 * scale)
    else:  # bf16 rounds each op's output: one rounding apart wherever the fp32 sums differ
        torch.testing.assert_close(fused, reference, rtol=2**-6, atol=2**-7 * scale)


def test_mxfp4_prompt_sized_experts_are_exact_both_ways(kernels, monkeypatch):
    # Prompt steps (more tokens than a decode step) go through the torch path: experts with up to
    # MXFP4_DIRECT_MAX_ROWS rows through brisk_mxfp4_linear, busier ones dequantized in one C pass and multiplied by
    # torch. With 2 experts and top-1 routing over 80 tokens both kinds occur.
    moe = mxfp4_moe(2, 1, 64, 64, torch.float32, seed=3)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(80, 64, generator=g)
    ids = (torch.arange(80) < 20).long()[:, None]  # 60 rows for expert 0, 20 for expert 1
    weights = torch.rand(80, 1, generator=g)
    reference = moe.backend.forward(moe, x, ids, weights)
    moe.cpu_kernels = kernels
    direct, dequantized = [], []
    mxfp4_linear, dequantize = kernels.mxfp4_linear, kernels.dequantize_mxfp4
    monkeypatch.setattr(type(kernels), "mxfp4_linear", lambda self, x, *a: direct.append(len(x)) or mxfp4_linear(x, *a))
    monkeypatch.setattr(type(kernels), "dequantize_mxfp4", lambda self, *a: dequantized.append(1) or dequantize(*a))
    assert not kernels.moe_mxfp4_accepts(x, moe.gate_up_proj_blocks)
    out = moe.backend.forward(moe, x, ids, weights)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6 * reference.abs().max().item())
    assert direct == [20, 20] and len(dequantized) == 2  # expert 1 both matrices; expert 0 both dequantized


def test_mxfp4_moe_kernel_on_expert_and_tensor_parallel_slices(kernels):
    # Each rank's layer holds a slice (ep: whole experts, ids local or -1; moe tp: whole 32-value blocks of I, I
    # zero-padded from 80 to 128); the partial outputs of the fused kernel sum to the full layer's (what the
    # all-reduce computes).
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=g)
    ids, weights = select_experts(torch.randn(7, 4, generator=g), 2)
    full = mxfp4_moe(4, 2, 64, 80, torch.float32, seed=9)
    full.cpu_kernels = kernels
    expected = full.backend.forward(full, x, ids, weights)
    for world, ep in ((2, 2), (2, 1), (4, 2)):
        total = torch.zeros_like(expected)
        for rank in range(world):
            p = ParallelConfig.for_rank(rank, world, ep_size=ep)
            part = mxfp4_moe(4, 2, 64, 80, torch.float32, seed=9, parallel=p)
            part.cpu_kernels = kernels
            local = ids - part.first_expert
            here = (local >= 0) & (local < part.num_local_experts)
            assert kernels.moe_mxfp4_accepts(x, part.gate_up_proj_blocks)
            total += part.backend.forward(part, x, torch.where(here, local, -1), weights * here)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
