"""FP8 KV cache (layers/kv_fp8.py): E4M3 storage with static per-KV-head scales, written and read by every
attention path.

The reference for an FP8 cache is exact: the torch reference backend over an fp32 cache that holds the dequantized
values (E4M3 code times scale), with the step's new K/V quantized and dequantized the same way. Every path (the torch
reference itself reading FP8, each build of the C decode kernel, the Triton kernels under the interpreter) must
match it to fp32 rounding: the only loss of FP8 is the quantization, which the reference shares. NaN-filled caches
(tests/paged_cases.py) make any read of a slot outside the context fail.

The Triton kernels run where Triton does: on the GPU when there is one (compiled, the native fp8e4nv path included),
else in the interpreter on the CPU (tests/conftest.py). Cases are built on the CPU and moved to that device for the
Triton paths; references are computed on the CPU and outputs brought back to compare.

The loss itself is measured at the model level (test_kv_fp8_models.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from brisk.kernels.cpu_kernels import load_cpu_kernels
from brisk.kernels.triton_attention import (
    TRITON_FP8_MIN_CAPABILITY,
    _e4m3_decode,
    _e4m3_encode,
    _round_to_e4m3,
    store_kv_cache,
)
from brisk.layers.attention import TorchAttentionBackend, store_kv
from brisk.layers.attention_cpu import CpuAttentionBackend
from brisk.layers.attention_triton import TritonAttentionBackend
from brisk.layers.kv_fp8 import (
    FP8_E4M3_MAX,
    FP8_KV_DTYPE,
    dequantize_kv,
    kv_scale_target,
    quantize_kv,
)
from tests import paged_cases
from tests.conftest import skip_unless_isa_under_test
from tests.paged_cases import REAL, TINY, Case

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")  # where the Triton kernels run
CPU = torch.device("cpu")
NATIVE_FP8 = CUDA and torch.cuda.get_device_capability() >= TRITON_FP8_MIN_CAPABILITY
needs_cuda = pytest.mark.skipif(not NATIVE_FP8, reason="compiled native-FP8 Triton kernels need a CUDA GPU, sm_89+")

K_SCALE = torch.tensor([0.5, 2.0])  # per KV head (TINY has two): scales that are not 1 in both directions
V_SCALE = torch.tensor([1.5, 0.25])
# triton-codes: the Triton kernels on an FP8 cache read and written as E4M3 codes in uint8 (GPUs before sm_89)
PATHS = ["torch", "cpu-avx512", "cpu-avx2", "triton", "triton-codes"]
# (new tokens, context after the step) per sequence: decodes, a prefill, chunks on a cached prefix, a short query
SPECS = [(1, 9), (5, 13), (1, 20), (3, 3), (7, 30), (2, 17)]


def fake_quantized(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize_kv(quantize_kv(x, scale.to(x.device)), scale.to(x.device))


def path_device(path: str) -> torch.device:
    return DEVICE if path.startswith("triton") else CPU


def moved(case: Case, device: torch.device) -> Case:
    """The same case with every tensor on `device` (itself where it is there already)."""
    meta = replace(
        case.meta,
        block_tables=[t.to(device) for t in case.meta.block_tables],
        slot_mappings=[t.to(device) for t in case.meta.slot_mappings],
    )
    to = {name: getattr(case, name).to(device) for name in ("q", "k", "v", "sinks", "k_cache", "v_cache")}
    return replace(case, meta=meta, **to)


def test_round_trip_is_e4m3_rounding_with_the_scale():
    x = torch.randn(4096, 2, 16, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 16)
    back = fake_quantized(x, K_SCALE)
    scaled = (x / K_SCALE[:, None]).abs()
    normal = scaled >= 2.0**-6  # E4M3's normal range: 3 mantissa bits, relative error at most 2^-4
    assert ((back - x).abs() <= x.abs() * 2.0**-4 + 1e-12)[normal & (scaled <= FP8_E4M3_MAX)].all()
    assert ((back - x).abs() <= 2.0**-10 * K_SCALE[:, None].expand_as(x))[~normal].all()  # half a subnormal step
    # Saturation, not NaN: E4M3 has no infinity.
    big = torch.full((1, 2, 16), 1e6)
    assert torch.equal(fake_quantized(big, K_SCALE), (FP8_E4M3_MAX * K_SCALE)[None, :, None].expand(1, 2, 16))


def test_store_kernels_write_the_same_codes():
    """The torch store and the Triton store kernel write the same E4M3 values (the Triton one rounds on E4M3's grid
    itself: round to nearest even, carries across powers of two included)."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(64, 2, 16, generator=g) * 3
    v = torch.randn(64, 2, 16, generator=g) * 300  # past 448 * 0.25: saturates
    slots = torch.randperm(80, generator=g)[:64]
    caches = [torch.zeros(20, 4, 2, 16, dtype=FP8_KV_DTYPE, device=DEVICE if i >= 2 else CPU) for i in range(4)]
    layer = paged_cases.make_case(TINY, [(1, 4)]).layer(None)
    layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale = caches[0], caches[1], K_SCALE, V_SCALE
    store_kv(layer, k, v, slots)
    on_device = [t.to(DEVICE) for t in (k, v)]  # the Triton store runs where Triton does
    scales, d_slots = [s.to(DEVICE) for s in (K_SCALE, V_SCALE)], slots.to(DEVICE)
    store_kv_cache(*on_device, caches[2], caches[3], d_slots, *scales)
    codes = [torch.zeros(20, 4, 2, 16, dtype=FP8_KV_DTYPE, device=DEVICE) for _ in range(2)]
    store_kv_cache(*on_device, codes[0], codes[1], d_slots, *scales, fp8_codes=True)
    caches[2:], codes = [c.cpu() for c in caches[2:]], [c.cpu() for c in codes]
    for ours, triton_, as_codes in ((caches[0], caches[2], codes[0]), (caches[1], caches[3], codes[1])):
        assert torch.equal(ours.float(), triton_.float())
        assert torch.equal(as_codes.view(torch.uint8), triton_.view(torch.uint8))
    assert torch.equal(caches[0].view(-1, 2, 16)[slots].float(), quantize_kv(k, K_SCALE).float())


@triton.jit
def _codes_round_trip_kernel(x_ptr, codes_ptr, decoded_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(codes_ptr + i, _e4m3_encode(_round_to_e4m3(tl.load(x_ptr + i))))
    tl.store(decoded_ptr + i, _e4m3_decode(tl.load(codes_ptr + i)))


# NaN inputs: the rounding's magic number overflows to inf and the subnormal branch casts NaN, both discarded by the
# kernel's selects (IEEE on a GPU); numpy, running the interpreter, warns about them.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_e4m3_codes_by_integer_ops_are_torchs_for_every_value():
    """The conversions the Triton kernels use where the GPU has no E4M3 type: every finite code decodes to torch's
    value and encodes back to itself, and any fp32 encodes to the code torch's saturating cast gives. Except -0: the
    store's rounding makes it +0, on the native path too (the same value to the attention)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(FP8_KV_DTYPE).float()
    finite = ~values.isnan()  # 0x7F and 0xFF: E4M3's NaNs, never stored
    g = torch.Generator().manual_seed(3)
    x = torch.cat([values[finite], torch.randn(4096 - 254, generator=g) * torch.logspace(-4, 3, 4096 - 254)])
    x[-5:] = torch.tensor([1e6, -1e6, 448.5, 2.0**-10, -(2.0**-12)])  # saturation, below the smallest subnormal
    out_codes = torch.empty(4096, dtype=torch.uint8, device=DEVICE)
    decoded = torch.empty(4096, device=DEVICE)
    _codes_round_trip_kernel[(1,)](x.to(DEVICE), out_codes, decoded, N=4096)
    out_codes, decoded = out_codes.cpu(), decoded.cpu()
    expected = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)
    zero = expected.float() == 0
    assert torch.equal(out_codes[~zero], expected.view(torch.uint8)[~zero]) and (out_codes[zero] == 0).all()
    assert torch.equal(out_codes[:254][~zero[:254]], codes[finite][~zero[:254]])  # every nonzero code to itself
    assert torch.equal(decoded, expected.float())
    assert zero.sum() >= 3 and (~zero).sum() > 3000  # both kinds well represented
    # NaN: stored as torch's cast stores it (sign | 0x7F, not saturated), read back as NaN
    nans = torch.tensor([float("nan"), -float("nan"), float("nan"), 1.0])
    out_codes, decoded = torch.empty(4, dtype=torch.uint8, device=DEVICE), torch.empty(4, device=DEVICE)
    _codes_round_trip_kernel[(1,)](nans.to(DEVICE), out_codes, decoded, N=4)
    assert out_codes.cpu().tolist() == nans.to(FP8_KV_DTYPE).view(torch.uint8).tolist() == [0x7F, 0xFF, 0x7F, 0x38]
    assert decoded.cpu()[:3].isnan().all() and decoded.cpu()[3] == 1.0


@pytest.mark.skipif(not CUDA, reason="the interpreter's own fp32 -> fp8 cast turns NaN into a number (0x7C)")
def test_the_native_fp8_store_keeps_nan():
    """A NaN key or value is stored as NaN, as the torch store does (a GPU's min / max would saturate it at
    +-448 unless told to propagate it), so what attends to it is NaN too and the non-finite guard fails it."""
    if not NATIVE_FP8:
        pytest.skip("Triton has no E4M3 type before sm_89: this GPU stores codes (tested above)")
    k = torch.tensor([[[float("nan"), -float("nan"), 1.0, 500.0]]], device=DEVICE)
    caches = [torch.zeros(1, 4, 1, 4, dtype=FP8_KV_DTYPE, device=DEVICE) for _ in range(2)]
    scale = torch.ones(1, device=DEVICE)
    store_kv_cache(k, k, caches[0], caches[1], torch.zeros(1, dtype=torch.int64, device=DEVICE), scale, scale)
    stored = caches[0].view(-1, 4)[0].cpu()
    assert stored.float()[:2].isnan().all() and stored.float()[2:].tolist() == [1.0, 448.0]


def _backend(path: str, request) -> object:
    if path == "torch":
        return TorchAttentionBackend()
    if path in ("triton", "triton-codes"):
        codes = path == "triton-codes"
        if not codes and CUDA and not NATIVE_FP8:
            pytest.skip("Triton has no E4M3 type before sm_89: this GPU runs the codes path only")
        return TritonAttentionBackend(prefill_block_n=TINY.block_n, decode_block_n=TINY.block_n, fp8_codes=codes)
    isa = path.removeprefix("cpu-")
    skip_unless_isa_under_test(request.config, isa)
    kernels = load_cpu_kernels(isa)
    assert kernels is not None
    return CpuAttentionBackend(kernels)


def run_fp8(case: Case, backend, use_sinks: bool) -> torch.Tensor:
    """The step through `backend` over the case's cache held in FP8 (the prefix quantized as an earlier step would
    have stored it)."""
    layer = case.layer(backend)
    shape = layer.k_cache.shape
    k_scale, v_scale = K_SCALE.to(case.k.device), V_SCALE.to(case.k.device)
    layer.k_cache = quantize_kv(case.k_cache.view(-1, *shape[2:]), k_scale).view(shape)
    layer.v_cache = quantize_kv(case.v_cache.view(-1, *shape[2:]), v_scale).view(shape)
    layer.k_scale, layer.v_scale = k_scale.clone(), v_scale.clone()
    return backend.forward(layer, case.q, case.k, case.v, case.meta, case.sinks if use_sinks else None)


def reference_fp8(case: Case, use_sinks: bool) -> torch.Tensor:
    """The torch reference over fp32 caches holding the dequantized FP8 values: what an FP8 path must compute."""
    layer = case.layer(TorchAttentionBackend())
    shape = layer.k_cache.shape
    layer.k_cache = fake_quantized(case.k_cache.view(-1, *shape[2:]), K_SCALE).view(shape)
    layer.v_cache = fake_quantized(case.v_cache.view(-1, *shape[2:]), V_SCALE).view(shape)
    k, v = fake_quantized(case.k, K_SCALE), fake_quantized(case.v, V_SCALE)
    return layer.backend.forward(layer, case.q, k, v, case.meta, case.sinks if use_sinks else None)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_every_attention_path_reads_fp8_as_the_dequantized_reference(request, path, window, use_sinks):
    """On CUDA the `triton` path is the compiled kernels on the native fp8e4nv type (store, prefill and decode),
    `triton-codes` the uint8-codes build; both within fp32 rounding (2e-5) of the dequantized reference."""
    backend = _backend(path, request)
    for seed, specs in enumerate([SPECS, [(1, n) for n in (1, 5, 12, 33)]]):  # mixed steps, then a decode batch
        case = paged_cases.make_case(TINY, specs, window=window, seed=seed)
        out = run_fp8(moved(case, path_device(path)), backend, use_sinks).cpu()
        ref = reference_fp8(case, use_sinks)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        # ... and FP8 is not a no-op: the model-dtype cache gives something measurably different.
        assert (case.reference(use_sinks) - out).abs().max() > 1e-4


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("head_dim", [64, 8])
def test_the_c_kernel_decodes_every_e4m3_code_as_torch_does(request, isa, head_dim):
    """The C decode kernel converts E4M3 by integer ops (no table): every one of the 256 codes, subnormals, both
    zeros and the two NaNs included, must come out as torch's decoding, in the kernel's code for a constant head size
    (64) and its generic code (8), and with the CPU flushing subnormals (torch.set_flush_denormal, which a user may
    turn on) as without. One-token sequences of one head: each output is its one value row (softmax over one key is
    1) times the V scale, a power of two (exact)."""
    skip_unless_isa_under_test(request.config, isa)
    kernels = load_cpu_kernels(isa)
    assert kernels is not None
    seqs = 256 // head_dim
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_KV_DTYPE).view(seqs, 1, 1, head_dim)
    v_cache = torch.cat([codes, codes[:1]])  # the last block: never read
    k_cache = torch.zeros_like(v_cache)
    q = torch.randn(seqs, 1, head_dim)
    block_tables = torch.arange(seqs, dtype=torch.int32).view(seqs, 1)
    seq_lens = torch.ones(seqs, dtype=torch.int32)
    expected = codes.float().view(seqs, 1, head_dim) * 0.5
    assert expected.isnan().sum() == 2 and (expected == 0).sum() == 2 and (expected.abs() < 2.0**-7).sum() > 2
    threads = torch.get_num_threads()
    try:
        for flush in (False, True):
            # The flag is per thread: with it on, the kernel runs on this thread alone.
            torch.set_num_threads(1 if flush else threads)
            assert torch.set_flush_denormal(flush)
            out = torch.full((seqs, 1, head_dim), -1.0)
            scales = (torch.tensor([2.0]), torch.tensor([0.5]))
            args = (k_cache, v_cache, block_tables, seq_lens, None, 0.125, None, *scales)
            kernels.decode_attention(q, out, None, None, *args)
            torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [None, 6])
def test_the_triton_kernels_compute_the_same_from_codes_as_from_e4m3(request, window):
    """GPUs before sm_89 read the same cache bytes as codes: prefill, decode and split-K give the very same output."""
    case = moved(paged_cases.make_case(TINY, SPECS, window=window, seed=5), DEVICE)
    native, codes = (_backend(path, request) for path in ("triton", "triton-codes"))
    assert torch.equal(run_fp8(case, native, True), run_fp8(case, codes, True))
    split = [
        TritonAttentionBackend(decode_block_n=TINY.block_n, decode_partition_size=TINY.block_n, fp8_codes=codes)
        for codes in (False, True)
    ]
    decodes = moved(paged_cases.make_case(TINY, [(1, n) for n in (5, 40, 70)], window=window, seed=6), DEVICE)
    assert torch.equal(run_fp8(decodes, split[0], True), run_fp8(decodes, split[1], True))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 128])
def test_compiled_fp8_kernels_at_real_shapes_match_the_dequantized_reference(window, dtype):
    """The compiled Triton FP8 path on the GPU at gpt-oss's attention shape: the store kernel writes the step's new
    K/V into an E4M3 cache natively (fp8e4nv, the path sm_89+ GPUs serve with; the codes build is held to it bit
    for bit by the test above), then prefill, plain decode and split-K decode (8k context, partitions of 256) read
    it. The reference is the torch backend in fp32 over the
    dequantized cache the Triton store left (new tokens included), so it checks the attention arithmetic alone:
    fp32 within 2e-5 (fp32 rounding over 8k keys), bf16 within 3e-2 (the tolerance of the bf16 kernel tests: bf16
    q, logits and probabilities). The store is checked separately against torch's quantization: the same codes
    except at most 1e-4 of the elements (the GPU's fp32 division by a non-power-of-two scale need not be correctly
    rounded, so a value within an ulp of a rounding midpoint may take the neighbouring code)."""
    s = REAL
    specs = [(1, 8192), (1, 1000), (300, 300), (77, 4173), (1, 129)]  # decodes, a prefill, a chunk on a prefix
    case = paged_cases.make_case(s, specs, window=window, dtype=dtype, seed=3, device=DEVICE)
    k_scale = torch.linspace(0.5, 2.0, s.kv_heads, device=DEVICE)  # not powers of two: real rounding in x / scale
    v_scale = torch.linspace(1.5, 0.25, s.kv_heads, device=DEVICE)
    backend = TritonAttentionBackend(
        prefill_block_n=s.block_n, decode_block_n=s.block_n, decode_partition_size=256, fp8_codes=False
    )
    layer = case.layer(backend)
    shape = layer.k_cache.shape
    layer.k_cache = quantize_kv(case.k_cache.view(-1, *shape[2:]), k_scale).view(shape)
    layer.v_cache = quantize_kv(case.v_cache.view(-1, *shape[2:]), v_scale).view(shape)
    layer.k_scale, layer.v_scale = k_scale, v_scale
    out = backend.forward(layer, case.q, case.k, case.v, case.meta, case.sinks)
    assert out.dtype == dtype and not out.isnan().any()

    slots = case.meta.slot_mappings[0]
    stored_k = layer.k_cache.view(-1, *shape[2:])[slots]
    stored_v = layer.v_cache.view(-1, *shape[2:])[slots]
    for stored, x, scale in ((stored_k, case.k, k_scale), (stored_v, case.v, v_scale)):
        differ = stored.float() != quantize_kv(x, scale).float()  # as values: the store writes -0 as +0
        assert differ.float().mean().item() <= 1e-4, differ.sum().item()
        assert torch.allclose(dequantize_kv(stored, scale), x.float(), rtol=2.0**-4, atol=2.0**-9 * scale.max().item())

    ref_layer = case.layer(TorchAttentionBackend())
    ref_layer.k_cache = dequantize_kv(layer.k_cache.view(-1, *shape[2:]), k_scale).view(shape)
    ref_layer.v_cache = dequantize_kv(layer.v_cache.view(-1, *shape[2:]), v_scale).view(shape)
    k, v = dequantize_kv(stored_k, k_scale), dequantize_kv(stored_v, v_scale)
    ref = ref_layer.backend.forward(ref_layer, case.q.float(), k, v, case.meta, case.sinks.float())
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def needle_step(context: int, needle_pos: int, seed: int = 0) -> tuple[Case, torch.Tensor]:
    """One decode at the end of a long context whose key at `needle_pos` matches the query (a planted fact the
    attention must find among `context` distractors); returns the case and the needle's value."""
    g = torch.Generator().manual_seed(seed)
    case = paged_cases.make_case(TINY, [(1, context)], seed=seed)
    heads, kvh, d = TINY.heads, TINY.kv_heads, TINY.head_dim
    flat_k = case.k_cache.view(-1, kvh, d)
    flat_v = case.v_cache.view(-1, kvh, d)
    table = case.meta.block_tables[0][0]
    slot = int(table[needle_pos // TINY.page]) * TINY.page + needle_pos % TINY.page
    key = torch.randn(kvh, d, generator=g)
    key = key / key.norm(dim=-1, keepdim=True) * 4.0
    flat_k[slot] = key
    needle = torch.randn(kvh, d, generator=g) * 2
    flat_v[slot] = needle
    # Every query head asks for its KV head's needle key: a logit of 16 * 4 / sqrt(d) = 16 above the distractors'
    # typical ones.
    group = heads // kvh
    case.q[0] = (key * 4.0).repeat_interleave(group, dim=0)
    return case, needle


@pytest.mark.parametrize("path", PATHS)
def test_a_needle_early_in_a_long_context_is_recalled_through_fp8(request, path):
    """Long-context retrieval, as a mechanism: a key planted at position 3 of a 2,000-token context (1,000 under the
    Triton interpreter; 2,000 compiled on CUDA), looked up by the last token. With FP8 KV the attention output is still the needle's value
    (cosine > 0.98, as with fp32 KV) and within 6% (norm of the difference) of the fp32-KV output: the output is
    the needle's value, whose E4M3 rounding (at most 2^-4 of each element, about 3.6% RMS) it inherits."""
    backend = _backend(path, request)
    context = 1000 if path.startswith("triton") and not CUDA else 2000
    case, needle = needle_step(context, needle_pos=3)
    group = TINY.heads // TINY.kv_heads
    expected = needle.repeat_interleave(group, dim=0)  # [H, D]
    full = case.reference(use_sinks=True)[0]
    fp8 = run_fp8(moved(case, path_device(path)), backend, use_sinks=True)[0].cpu()
    for out in (full, fp8):
        cos = torch.nn.functional.cosine_similarity(out, expected, dim=-1)
        assert (cos > 0.98).all(), cos
    assert (fp8 - full).norm() <= 0.06 * full.norm()


def test_checkpoint_scale_names():
    assert kv_scale_target("model.layers.3.self_attn.k_proj.k_scale") == (3, "k_scale")  # ModelOpt
    assert kv_scale_target("model.layers.0.self_attn.v_proj.v_scale") == (0, "v_scale")
    assert kv_scale_target("model.layers.12.self_attn.attn.k_scale") == (12, "k_scale")  # vLLM's own
    assert kv_scale_target("model.layers.1.self_attn.k_scale") == (1, "k_scale")  # compressed-tensors
    assert kv_scale_target("model.layers.1.self_attn.kv_scale") == (1, "kv_scale")  # deprecated: both
    assert kv_scale_target("model.layers.1.self_attn.k_proj.weight_scale") is None
    assert kv_scale_target("model.layers.1.mlp.experts.gate_up_proj_scales") is None
