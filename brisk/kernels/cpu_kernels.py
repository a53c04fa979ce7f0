"""Build and bind brisk's CPU kernels (cpu_kernels.c): paged decode attention, RMSNorm, gpt-oss's and Llama's MLP
activations, gpt-oss's experts (unquantized or MXFP4), decode-sized matmuls (bf16 / fp32 / MXFP4 weights), MXFP4
dequantization, random sampling, the greedy argmax.

The source is compiled for one instruction set (`ISA_FLAGS`: "avx512", or "avx2" = AVX2 + FMA) with the system C
compiler (`cc`, or $CC) into the user's cache (~/.cache/brisk/kernels, $XDG_CACHE_HOME respected), once per
machine, keyed by the source, the flags, the compiler and the CPU's feature flags. The config field `cpu_kernels`
picks the instruction set (auto: the best this CPU runs; see brisk.host); where none fits, or there is no compiler,
or the build fails, `load_cpu_kernels` returns None and the callers keep their PyTorch paths. Its OpenMP runtime is
the one torch already loaded (same soname, libgomp.so.1), so the two share one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from brisk.host import check_cpu_kernels_choice, cpu_info, cpu_kernel_isas
from brisk.layers.kv_fp8 import FP8_KV_DTYPE

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC")
# -march=native tunes for this CPU; -mno-avx512f keeps every AVX-512 instruction out of the avx2 build (so that an
# AVX-512 machine runs and tests exactly what an AVX2-only CPU runs).
ISA_FLAGS = {"avx512": ("-march=native",), "avx2": ("-march=native", "-mno-avx512f")}
VECTOR_BITS = {"avx512": 512, "avx2": 256}  # what the build reports (brisk_vector_bits)
# Linked in a second step without -ffast-math: linked with it, the library would carry crtfastmath.o, which turns
# on flush-to-zero for the whole process when loaded (every torch op would then lose subnormals).
LINK_FLAGS = ["-shared", "-fopenmp"]
LIBS = ["-lmvec", "-lm"]  # -ffast-math vectorizes expf into glibc's vector math library

_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
ATTENTION_ARGTYPES = [
    _ptr,
    _i64,
    _ptr,
    _i64,
    _ptr,
    _ptr,
    _ptr,
    _ptr,
    _i32,
    _ptr,
    _ptr,
    _ptr,
    _i64,
    _ptr,
    _ptr,
    _i32,
    _i32,
    _i32,
    _i32,
    _i32,
    _f32,
    _i32,
    _i32,
]
# The KV cache dtypes the attention kernel reads (cpu_kernels.c: CACHE_*).
CACHE_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, FP8_KV_DTYPE: 2}
RMS_NORM_ARGTYPES = [_ptr, _i64, _ptr, _i64, _ptr, _i32, _i32, _i32, _i32, _f32]
SWIGLU_ARGTYPES = [_ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _f32, _f32]
SILU_AND_MUL_ARGTYPES = [_ptr, _i64, _ptr, _i64, _i32, _i32, _i32]
BITMASK_ARGTYPES = [_ptr, _i64, _ptr, _i64, _ptr, _i32, _i32, _i32]
# Rows up to which the layers take brisk_linear (decode batches; beyond, prompts: oneDNN / MKL). docs/performance.md
LINEAR_MAX_ROWS = 64
# Rows of a prompt step up to which an MXFP4 expert's matmul takes brisk_mxfp4_linear (the weight decoded in
# registers for every 4 rows); beyond, the expert is dequantized to bf16 once and multiplied by oneDNN (AMX where
# present). At gpt-oss's 5,760 x 2,880 gate_up, one thread: 16 rows 6.6 vs 10.8 ms, 64 rows 22.5 vs 12.9 ms.
MXFP4_DIRECT_MAX_ROWS = 32
LINEAR_ARGTYPES = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32, _i32]
SAMPLE_ARGTYPES = [_ptr, _i64, _i32, _i32, _ptr, _ptr, _i32]
ROW_MAX_ARGMAX_ARGTYPES = [_ptr, _i64, _i32, _i32, _ptr, _ptr, _i32]
MOE_ARGTYPES = [
    _ptr,
    _i64,
    _ptr,
    _i64,
    _ptr,
    _ptr,
    _i32,
    _i32,
    _i32,
    _i32,
    _i32,
    _ptr,
    _ptr,
    _ptr,
    _ptr,
    _i32,
    _i32,
    _f32,
    _f32,
    _i32,
]
MXFP4_LINEAR_ARGTYPES = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32, _i32]
MXFP4_DEQUANTIZE_ARGTYPES = [_ptr, _ptr, _ptr, _i64, _i32, _i32, _i32]
MOE_MXFP4_ARGTYPES = [*MOE_ARGTYPES[:11], _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, *MOE_ARGTYPES[15:]]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "brisk" / "kernels"


def build_cpu_kernels(isa: str, extra_flags: tuple[str, ...] = ()) -> Path | None:
    """Path of the library compiled for `isa` (a key of ISA_FLAGS), building it if this machine has none yet; None
    if it cannot be built (no compiler, or the build failed: logged). `extra_flags`: tests build variants too (the
    avx512 build as for an AVX-512 CPU without AVX512-BF16)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler found: brisk's CPU kernels are not built, the PyTorch paths run instead")
        return None
    compile_flags = (*COMPILE_FLAGS, *ISA_FLAGS[isa], *extra_flags)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    flags = " ".join(sorted(cpu_info().flags))
    key_parts = [SOURCE.read_text(), *compile_flags, *LINK_FLAGS, *LIBS, version, platform.machine(), flags]
    key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{isa}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: ranks building at once never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = os.path.join(tmp, "cpu_kernels.o"), os.path.join(tmp, "cpu_kernels.so")
        compile_step = [compiler, *compile_flags, "-c", str(SOURCE), "-o", obj]
        for step in (compile_step, [compiler, *LINK_FLAGS, obj, "-o", lib, *LIBS]):
            build = subprocess.run(step, capture_output=True, text=True)
            if build.returncode != 0:
                logger.warning("building the %s CPU kernels failed:\n%s", isa, build.stderr)
                return None
        os.replace(lib, target)
    return target


@dataclass(frozen=True)
class CpuKernels:
    """The bound kernels of one build (`isa`). Callers check what a kernel accepts (see each method) and keep torch
    for the rest."""

    isa: str
    attention_fn: Callable[..., None]
    rms_norm_fn: Callable[..., None]
    swiglu_fn: Callable[..., None]
    linear_fn: Callable[..., None]
    moe_fn: Callable[..., None]
    sample_fn: Callable[..., None]
    silu_and_mul_fn: Callable[..., None]
    apply_bitmask_fn: Callable[..., None]
    mxfp4_linear_fn: Callable[..., None]
    mxfp4_dequantize_fn: Callable[..., None]
    moe_mxfp4_fn: Callable[..., None]
    row_max_argmax_fn: Callable[..., None]

    def decode_attention(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        rows: torch.Tensor | None,
        seq_ids: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        sinks: torch.Tensor | None,
        scale: float,
        window: int | None,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        """`out[rows] = attention(q[rows])` for sequences with one new token each.

        q, out: [T, H, D] fp32 with each token's heads contiguous; rows / seq_ids: int32 [n] (None: 0..n-1);
        caches [num_blocks, block_size, KVH, D] fp32, bf16 or FP8 E4M3, contiguous; block_tables int32 [B,
        max_blocks], rows contiguous; seq_lens int32 [B]; sinks fp32 [H] contiguous or None; k_scales / v_scales:
        an FP8 cache's fp32 [KVH] scales (None: 1)."""
        num_seqs = rows.shape[0] if rows is not None else seq_lens.shape[0]
        _, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        self.attention_fn(
            q.data_ptr(),
            q.stride(0),
            out.data_ptr(),
            out.stride(0),
            None if rows is None else rows.data_ptr(),
            None if seq_ids is None else seq_ids.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            CACHE_DTYPE_CODES[k_cache.dtype],
            None if k_scales is None else k_scales.data_ptr(),
            None if v_scales is None else v_scales.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            None if sinks is None else sinks.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            window or 0,
            torch.get_num_threads(),
        )

    @staticmethod
    def rms_norm_accepts(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            x.dtype in (torch.float32, torch.bfloat16)
            and weight.dtype == x.dtype
            and x.dim() == 2
            and x.stride(1) == 1
            and weight.is_contiguous()
            and x.device.type == "cpu"
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
        """RMSNorm of x [T, hidden] (see `rms_norm_accepts`) into a new tensor of x's dtype."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self.rms_norm_fn(
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            weight.data_ptr(),
            int(x.dtype == torch.bfloat16),
            int(weight_in_fp32),
            x.shape[0],
            x.shape[1],
            eps,
        )
        return out

    @staticmethod
    def swiglu_accepts(gate_up: torch.Tensor) -> bool:
        return (
            gate_up.dtype in (torch.float32, torch.bfloat16)
            and gate_up.dim() == 2
            and gate_up.stride(1) == 1
            and gate_up.device.type == "cpu"
        )

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float, halves: bool) -> torch.Tensor:
        """gpt-oss's activation of gate_up [T, 2I] (see `swiglu_accepts`; layers/moe.py:clamped_swiglu) -> [T, I]."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype)
        self.swiglu_fn(
            gate_up.data_ptr(),
            gate_up.stride(0),
            out.data_ptr(),
            out.stride(0),
            int(gate_up.dtype == torch.bfloat16),
            int(halves),
            rows,
            inter,
            alpha,
            limit,
        )
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Llama's MLP activation silu(gate) * up of gate_up [T, 2I] = [gate | up] (see `swiglu_accepts`) -> [T, I]."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype)
        self.silu_and_mul_fn(
            gate_up.data_ptr(),
            gate_up.stride(0),
            out.data_ptr(),
            out.stride(0),
            int(gate_up.dtype == torch.bfloat16),
            rows,
            inter,
        )
        return out

    @staticmethod
    def bitmask_accepts(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
        """fp32 CPU logits with contiguous rows and an int32 bitmask of contiguous rows (xgrammar's layout)."""
        return (
            logits.dtype == torch.float32
            and logits.dim() == 2
            and logits.stride(1) == 1
            and logits.device.type == "cpu"
            and bitmask.dtype == torch.int32
            and bitmask.dim() == 2
            and bitmask.stride(1) == 1
        )

    def apply_token_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int, num_threads: int = 1
    ) -> None:
        """-inf in place where bitmask row r forbids token t < vocab, for each r in `rows` (both tensors indexed by
        r; see `bitmask_accepts`)."""
        if not rows:
            return
        vocab = min(vocab, logits.shape[1], bitmask.shape[1] * 32)
        index = torch.tensor(rows, dtype=torch.int64)
        self.apply_bitmask_fn(
            logits.data_ptr(),
            logits.stride(0),
            bitmask.data_ptr(),
            bitmask.stride(0),
            index.data_ptr(),
            len(rows),
            vocab,
            num_threads,
        )

    @staticmethod
    def _decode_rows(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """x: a decode step's rows (up to LINEAR_MAX_ROWS, fp32 or bf16, rows contiguous) on the CPU; the bias (or
        None) of x's dtype and contiguous."""
        return (
            x.dtype in (torch.float32, torch.bfloat16)
            and x.dim() == 2
            and x.stride(1) == 1
            and 0 < x.shape[0] <= LINEAR_MAX_ROWS
            and x.device.type == "cpu"
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        )

    @classmethod
    def linear_accepts(cls, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """A decode-sized matmul, which the kernel computes reading the weight once: up to LINEAR_MAX_ROWS rows,
        same dtype throughout (fp32 or bf16), rows contiguous."""
        return cls._decode_rows(x, bias) and weight.dtype == x.dtype and weight.is_contiguous()

    def _matmul(
        self, fn: Callable[..., None], x: torch.Tensor, weight: tuple[int, ...], n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The call the matmul kernels share: x, the weight's pointers, the bias, out [M, n] in x's dtype."""
        m, k = x.shape
        out = torch.empty(m, n, dtype=x.dtype)
        fn(
            x.data_ptr(),
            x.stride(0),
            *weight,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            m,
            n,
            k,
            int(x.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ weight [N, K].T + bias (see `linear_accepts`) -> [M, N] in x's dtype."""
        return self._matmul(self.linear_fn, x, (weight.data_ptr(),), weight.shape[0], bias)

    def moe_accepts(self, hidden: torch.Tensor, gate_up: torch.Tensor) -> bool:
        """A decode step's tokens through unquantized experts (the matmuls inside go through `linear`)."""
        return (
            self.linear_accepts(hidden, gate_up[0], None)
            and gate_up.is_contiguous()
            and hidden.shape[1] == gate_up.shape[2]
        )

    def moe_experts(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        gate_up: torch.Tensor,
        gate_up_bias: torch.Tensor,
        down: torch.Tensor,
        down_bias: torch.Tensor | None,
        halves: bool,
        alpha: float,
        limit: float,
    ) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) (see `moe_accepts`; ids outside the
        experts, -1 for another rank's, count nothing): hidden [T, H], gate_up [E, 2I, H], down [E, H, I] with
        biases [E, 2I] / [E, H] (or None), all of hidden's dtype -> [T, H]."""
        if down.dtype != hidden.dtype or not down.is_contiguous():
            raise ValueError("expert weights must be contiguous and of the hidden states' dtype")
        num_experts, two_i, _ = gate_up.shape
        pointers = (gate_up.data_ptr(), gate_up_bias.data_ptr(), down.data_ptr())
        biases, activation = (gate_up_bias, down_bias), (halves, alpha, limit)
        return self._moe(
            self.moe_fn, hidden, topk_ids, topk_weights, two_i // 2, num_experts, pointers, biases, activation
        )

    def moe_mxfp4_accepts(self, hidden: torch.Tensor, gate_up_blocks: torch.Tensor) -> bool:
        """A decode step's tokens (up to LINEAR_MAX_ROWS) through MXFP4 experts, read where they lie."""
        return (
            self._decode_rows(hidden, None)
            and gate_up_blocks.is_contiguous()
            and hidden.shape[1] == gate_up_blocks.shape[2] * 32
        )

    def moe_experts_mxfp4(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        gate_up: tuple[torch.Tensor, torch.Tensor],
        gate_up_bias: torch.Tensor,
        down: tuple[torch.Tensor, torch.Tensor],
        down_bias: torch.Tensor | None,
        halves: bool,
        alpha: float,
        limit: float,
    ) -> torch.Tensor:
        """`moe_experts` for MXFP4 experts (see `moe_mxfp4_accepts`): gate_up = (blocks [E, 2I, H/32, 16], scales
        [E, 2I, H/32]), down = (blocks [E, H, I/32, 16], scales [E, H, I/32]), uint8 and contiguous; biases of
        hidden's dtype. Every product is exact in fp32: the result is that of the dequantized experts up to the
        order of the fp32 sums."""
        for tensor in (*gate_up, *down):
            if tensor.dtype != torch.uint8 or not tensor.is_contiguous():
                raise ValueError("MXFP4 expert blocks and scales must be contiguous uint8 tensors")
        num_experts, two_i = gate_up[0].shape[:2]
        pointers = tuple(t.data_ptr() for t in (gate_up[0], gate_up[1], gate_up_bias, down[0], down[1]))
        biases, activation = (gate_up_bias, down_bias), (halves, alpha, limit)
        return self._moe(
            self.moe_mxfp4_fn, hidden, topk_ids, topk_weights, two_i // 2, num_experts, pointers, biases, activation
        )

    @staticmethod
    def _moe(
        fn: Callable[..., None],
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        inter: int,
        num_experts: int,
        weight_pointers: tuple[int, ...],
        biases: tuple[torch.Tensor, torch.Tensor | None],
        activation: tuple[bool, float, float],
    ) -> torch.Tensor:
        """The call both expert formats share: the expert pointers, then down's bias (or NULL); biases = (gate_up's,
        down's or None); activation = (halves, alpha, limit)."""
        for bias in biases:
            if bias is not None and (bias.dtype != hidden.dtype or not bias.is_contiguous()):
                raise ValueError("expert biases must be contiguous and of the hidden states' dtype")
        down_bias, (halves, alpha, limit) = biases[1], activation
        t, h = hidden.shape
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty(t, h, dtype=hidden.dtype)
        fn(
            hidden.data_ptr(),
            hidden.stride(0),
            out.data_ptr(),
            out.stride(0),
            ids.data_ptr(),
            weights.data_ptr(),
            t,
            ids.shape[1],
            num_experts,
            h,
            inter,
            *weight_pointers,
            None if down_bias is None else down_bias.data_ptr(),
            int(hidden.dtype == torch.bfloat16),
            int(halves),
            alpha,
            limit,
            torch.get_num_threads(),
        )
        return out

    @classmethod
    def mxfp4_linear_accepts(cls, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """A decode-sized x (up to LINEAR_MAX_ROWS rows, fp32 or bf16, rows contiguous) times an MXFP4 weight whose
        blocks are contiguous, the bias (or None) of x's dtype."""
        return (
            cls._decode_rows(x, bias)
            and blocks.dtype == torch.uint8
            and blocks.is_contiguous()
            and x.shape[1] == blocks.shape[-2] * 32
        )

    def mxfp4_linear(
        self, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] @ dequantize_mxfp4(blocks [N, K/32, 16], scales [N, K/32]).T + bias (see `mxfp4_linear_accepts`)
        -> [M, N] in x's dtype, the weight decoded in registers."""
        if scales.dtype != torch.uint8 or not scales.is_contiguous():
            raise ValueError("MXFP4 scales must be a contiguous uint8 tensor")
        return self._matmul(self.mxfp4_linear_fn, x, (blocks.data_ptr(), scales.data_ptr()), blocks.shape[0], bias)

    def dequantize_mxfp4(
        self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """What layers/mxfp4.py:dequantize_mxfp4 computes (the same values: fp32, or rounded once to bf16), in one
        pass over the blocks: blocks [..., G, 16] and scales [..., G] uint8, contiguous -> [..., G * 32]. Other
        dtypes: dequantized to fp32, then cast. `buffer`: a contiguous fp32 / bf16 tensor of `dtype` with room for
        the result, which is then a view of it (a prompt's experts, one after the other, in one piece of memory)."""
        if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
            raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
        blocks, scales = blocks.contiguous(), scales.contiguous()
        direct = dtype in (torch.float32, torch.bfloat16)
        shape = (*scales.shape[:-1], scales.shape[-1] * 32)
        if buffer is not None:
            if not direct or buffer.dtype != dtype or not buffer.is_contiguous() or buffer.numel() < blocks.numel() * 2:
                raise ValueError(f"a {dtype} result does not fit a {buffer.dtype} buffer of {buffer.numel()} values")
            out = buffer.view(-1)[: blocks.numel() * 2].view(shape)
        else:
            out = torch.empty(shape, dtype=dtype if direct else torch.float32)
        groups = scales.shape[-1]
        self.mxfp4_dequantize_fn(
            blocks.data_ptr(),
            scales.data_ptr(),
            out.data_ptr(),
            scales.numel() // max(groups, 1),
            groups,
            int(out.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        return out if direct else out.to(dtype)

    @staticmethod
    def sample_accepts(logits: torch.Tensor) -> bool:
        return (
            logits.dtype == torch.float32
            and logits.dim() == 2
            and logits.stride(1) == 1
            and logits.device.type == "cpu"
        )

    def sample_rows(self, logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """One token per row of logits [B, V] (see `sample_accepts`) drawn from softmax(row), by inverse transform
        with uniforms [B] fp64 in [0, 1) -> int64 [B]. -inf logits are never drawn; a row needs one finite one."""
        uniforms = uniforms.to(torch.float64).contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.sample_fn(
            logits.data_ptr(),
            logits.stride(0),
            logits.shape[0],
            logits.shape[1],
            uniforms.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def row_max_argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(max [B] fp32, index of the first max [B] int64) of each row of logits [B, V], V > 0 (see
        `sample_accepts`): torch.max(dim=-1)'s pair, a NaN counting as the max."""
        num_rows, width = logits.shape
        values = torch.empty(num_rows, dtype=torch.float32)
        indices = torch.empty(num_rows, dtype=torch.int64)
        self.row_max_argmax_fn(
            logits.data_ptr(),
            logits.stride(0),
            num_rows,
            width,
            values.data_ptr(),
            indices.data_ptr(),
            torch.get_num_threads(),
        )
        return values, indices


def load_cpu_kernels(choice: str = "auto", extra_flags: tuple[str, ...] = ()) -> CpuKernels | None:
    """The kernels for the config field `cpu_kernels` (auto, avx512, avx2 or torch), or None where the PyTorch ops
    run; the choice is logged. A forced instruction set this CPU lacks, or whose build fails, raises ValueError."""
    isas = cpu_kernel_isas()
    check_cpu_kernels_choice(choice, isas)
    isa = (isas[0] if isas else None) if choice == "auto" else None if choice == "torch" else choice
    if isa is None:
        why = "asked for (cpu_kernels: torch)" if choice == "torch" else "this CPU has neither AVX-512 nor AVX2 + FMA"
        logger.info("CPU kernels: PyTorch ops (%s)", why)
        return None
    path = build_cpu_kernels(isa, extra_flags)
    kernels = None if path is None else _bind(isa, path)
    if kernels is None:
        if choice != "auto":
            raise ValueError(f"cpu_kernels: the {isa} kernels asked for could not be built or loaded (see the log)")
        logger.warning("CPU kernels: PyTorch ops (the %s kernels could not be built or loaded)", isa)
        return None
    logger.info("CPU kernels: %s build (%s)", isa, path)
    return kernels


def _bind(isa: str, path: Path) -> CpuKernels | None:
    try:
        library = ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("loading the CPU kernels failed: %s", e)
        return None
    bits = library.brisk_vector_bits
    bits.argtypes, bits.restype = [], _i32
    if bits() != VECTOR_BITS[isa]:
        raise RuntimeError(f"{path} was built for {bits()}-bit vectors, not {isa}'s {VECTOR_BITS[isa]}")
    bound = []
    for name, argtypes in (
        ("brisk_decode_attention", ATTENTION_ARGTYPES),
        ("brisk_rms_norm", RMS_NORM_ARGTYPES),
        ("brisk_clamped_swiglu", SWIGLU_ARGTYPES),
        ("brisk_linear", LINEAR_ARGTYPES),
        ("brisk_moe_experts", MOE_ARGTYPES),
        ("brisk_sample_rows", SAMPLE_ARGTYPES),
        ("brisk_silu_and_mul", SILU_AND_MUL_ARGTYPES),
        ("brisk_apply_token_bitmask", BITMASK_ARGTYPES),
        ("brisk_mxfp4_linear", MXFP4_LINEAR_ARGTYPES),
        ("brisk_mxfp4_dequantize", MXFP4_DEQUANTIZE_ARGTYPES),
        ("brisk_moe_experts_mxfp4", MOE_MXFP4_ARGTYPES),
        ("brisk_row_max_argmax", ROW_MAX_ARGMAX_ARGTYPES),
    ):
        fn = getattr(library, name)
        fn.argtypes, fn.restype = argtypes, None
        bound.append(fn)
    return CpuKernels(isa, *bound)
