"""Compile brisk's Triton kernels for an NVIDIA GPU on a machine that has none (default sm_90: H100, H200).

The CPU tests run the kernels in Triton's interpreter, which executes their Python but never the backend
compiler. A kernel can pass every interpreter test and still, on the GPU, fail to compile (a layout or dtype
the backend rejects), fail to launch (more shared memory than the device gives a block) or run slowly
(registers spilled to local memory). GPU time is short, so this finds those here: it calls the real wrappers of
`brisk.kernels.triton_attention`, `.triton_moe` and `.triton_norm`, and xgrammar's mask kernel (structured outputs
on CUDA logits), at the shapes a GPU run launches (gpt-oss-20b and -120b at TP 1-8, bf16 and FP8 KV, fp32 as the
GPU tests use it, Llama/Qwen3-like heads, decode to prefill batch sizes), with every launch turned into a compile
for the target, and reads each variant's registers and local memory from its cubin (Triton's own `cuobjdump`).

    python tools/compile_kernels.py [--arch 90] [--json out.json] [--only SUBSTRING]

Prints one row per distinct compiled variant; exits 1 when one fails to compile or needs more shared memory
than the target has. Spills are reported, not failed: they cost speed, not correctness. Needs Triton's NVIDIA
backend (in every Linux wheel of triton) and must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from brisk.kernels import interpreting

# Opt-in shared memory a block may use, by compute capability (CUDA programming guide, "Compute Capabilities").
MAX_SHARED_BYTES = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
REGISTERS_PER_SM = 65536
# How a kernel's dots reach the tensor cores, by the PTX they compile to (none of these: FMA units).
MMA_OPS = (("tcgen05", "tcgen05.mma"), ("wgmma", "wgmma.mma_async"), ("mma", "mma.sync"))


@dataclass
class Variant:
    """One compiled kernel: a distinct (kernel, constexprs, launch options) the cases asked for."""

    kernel: str
    cases: list[str]
    num_warps: int = 0
    num_stages: int = 0
    shared_bytes: int = 0
    registers: int = 0
    local_bytes: int = 0  # > 0: registers spilled (or a stack), slow but correct
    mma: str = ""  # its dots: tcgen05 (Blackwell), wgmma (Hopper's warpgroup MMA), mma (warp MMA), "" (FMA units)
    compile_s: float = 0.0
    error: str = ""

    def problems(self, arch: int) -> list[str]:
        out = [self.error] if self.error else []
        limit = MAX_SHARED_BYTES.get(arch)
        if limit is not None and self.shared_bytes > limit:
            out.append(f"needs {self.shared_bytes} B of shared memory, sm_{arch} gives a block {limit}")
        if self.registers * self.num_warps * 32 > REGISTERS_PER_SM:
            out.append(f"{self.registers} registers x {self.num_warps * 32} threads exceed an SM's {REGISTERS_PER_SM}")
        return out


@dataclass
class Report:
    arch: int
    triton_version: str
    variants: list[Variant] = field(default_factory=list)
    case_errors: dict[str, str] = field(default_factory=dict)  # a case whose wrapper raised before any compile

    def failures(self) -> list[str]:
        out = [f"{v.kernel} ({', '.join(v.cases[:2])}): {p}" for v in self.variants for p in v.problems(self.arch)]
        return out + [f"{case}: {err}" for case, err in self.case_errors.items()]


class _CompileOnlyDriver:
    """What Triton's launch path asks of its driver, for a device that is not here: every launch compiles for
    `target` and returns before loading the binary (Triton's own warm-up path)."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _resources(cubin: bytes, cuobjdump: str) -> tuple[int, int]:
    """(registers, local memory bytes) of the cubin's one function."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(kv.split(":", 1) for line in text.splitlines() if "REG:" in line for kv in line.split())
    return int(fields.get("REG", 0)), int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0))


# ------------------------------------------------------------------------------------------ the shapes


@dataclass(frozen=True)
class Heads:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None  # the model's sliding window (gpt-oss: every other layer), None for full attention only
    sinks: bool


def _gpt_oss_heads(tp: int) -> Heads:
    return Heads(f"gpt-oss tp{tp}", 64 // tp, 8 // tp, 64, 128, True)


HEADS = [
    *(_gpt_oss_heads(tp) for tp in (1, 2, 4, 8)),
    Heads("llama-8b", 32, 8, 128, None, False),
    Heads("qwen3-0.6b", 16, 8, 128, None, False),
    Heads("tiny-gpt-oss", 4, 2, 64, 128, True),  # the GPU tests' small model of the real architecture
]

# (model dtype, KV cache dtype): bf16 models with their own dtype's KV or FP8 KV; fp32 (the GPU tests, small models).
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float32)]


def _attention_cases(full: bool, arch: int) -> list[tuple[str, Callable[[], None]]]:
    from brisk.kernels import triton_attention as ta

    # Before sm_89 Triton has no E4M3 type: an FP8 cache goes to the kernels as its codes (fp8_as_codes).
    fp8_codes = (arch // 10, arch % 10) < ta.TRITON_FP8_MIN_CAPABILITY
    cases: list[tuple[str, Callable[[], None]]] = []
    for hd in HEADS if full else HEADS[:1]:
        for q_dtype, kv_dtype in DTYPES:
            for page in (32, 16) if full else (32,):
                for window in {None, hd.window}:
                    label = f"attn {hd.name} {str(q_dtype)[6:]} kv={str(kv_dtype)[6:]} page={page} window={window}"
                    cases.append((label, _attention_case(ta, hd, q_dtype, kv_dtype, page, window, fp8_codes)))
    # Pools of 2^31 elements and more take 64-bit cache offsets (a big H200 pool at TP1).
    big_pool = _attention_case(ta, HEADS[0], torch.bfloat16, torch.bfloat16, 32, None, False, 2**31)
    cases.append(("attn gpt-oss tp1 bfloat16 pool>=2^31", big_pool))
    return cases


def _attention_case(
    ta, hd: Heads, q_dtype, kv_dtype, page: int, window: int | None, fp8_codes: bool, pool_elems: int = 0
):
    from brisk.layers.attention_triton import TritonAttentionBackend

    tiles = TritonAttentionBackend().tiles_for(q_dtype)  # what the backend launches for this dtype

    def run() -> None:
        blocks = max(256, -(-pool_elems // (page * hd.kv_heads * hd.head_dim)))
        cache_shape = (blocks, page, hd.kv_heads, hd.head_dim)
        k_cache = torch.empty(cache_shape, dtype=kv_dtype)
        v_cache = torch.empty(cache_shape, dtype=kv_dtype)
        fp8 = kv_dtype == torch.float8_e4m3fn
        k_scale, v_scale = (torch.ones(hd.kv_heads), torch.ones(hd.kv_heads)) if fp8 else (None, None)
        sinks = torch.zeros(hd.heads, dtype=torch.float32) if hd.sinks else None
        # Decode: 64 sequences; split-K (long contexts over few sequences) and one partition (many short ones);
        # then split-K again at another batch (its partition count and block-table width are not specialized on).
        for b, ctx, partition in ((64, 8192, 512), (64, 64, None), (48, 4000, 512)):
            q = torch.empty((b, hd.heads, hd.head_dim), dtype=q_dtype)
            table = torch.zeros((b, -(-ctx // page)), dtype=torch.int32)
            lens = torch.full((b,), ctx, dtype=torch.int32)
            kv = q[:, : hd.kv_heads]
            ta.store_kv_cache(kv, kv, k_cache, v_cache, torch.zeros(b, dtype=torch.int64), k_scale, v_scale, fp8_codes)
            ta.paged_decode_attention(
                q, k_cache, v_cache, table, lens, 0.125, sliding_window=window, sinks=sinks, max_seq_len=ctx,
                block_n=tiles.decode_block_n, partition_size=partition, num_warps=tiles.decode_warps,
                k_scale=k_scale, v_scale=v_scale, fp8_codes=fp8_codes,
            )  # fmt: skip
        # Prefill: two 1k prompts after 1k of cached context each.
        q = torch.empty((2048, hd.heads, hd.head_dim), dtype=q_dtype)
        table = torch.zeros((2, 2048 // page), dtype=torch.int32)
        cu = torch.tensor([0, 1024, 2048], dtype=torch.int32)
        lens = torch.tensor([2048, 2048], dtype=torch.int32)
        ta.paged_prefill_attention(
            q, k_cache, v_cache, table, cu, lens, 0.125, sliding_window=window, sinks=sinks,
            block_q=ta.default_prefill_block_q(hd.heads, hd.kv_heads, tiles.prefill_block_m),
            block_n=tiles.prefill_block_n, num_warps=tiles.prefill_warps, k_scale=k_scale, v_scale=v_scale,
            fp8_codes=fp8_codes,
        )  # fmt: skip

    return run


@dataclass(frozen=True)
class Experts:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int  # per rank (MoE-TP splits it; brisk pads MXFP4 to whole 32-groups per rank)


def _gpt_oss_experts(name: str, num_experts: int, tp: int) -> Experts:
    per_rank = -(-2880 // (32 * tp)) * 32
    return Experts(f"{name} moe-tp{tp}", num_experts, 4, 2880, per_rank)


EXPERTS = [
    _gpt_oss_experts("gpt-oss-120b", 128, 1),
    _gpt_oss_experts("gpt-oss-20b", 32, 1),
    *(_gpt_oss_experts("gpt-oss-120b", 128, tp) for tp in (2, 4, 8)),
]
BATCHES = (1, 16, 64, 256, 640, 2048, 8192)  # decode to a prefill chunk: every tile tier of default_config


def _moe_cases(full: bool) -> list[tuple[str, Callable[[], None]]]:
    from brisk.kernels import triton_moe as tm

    cases: list[tuple[str, Callable[[], None]]] = []
    for ex in EXPERTS if full else EXPERTS[:1]:
        for mxfp4 in (True, False):
            for t in BATCHES if full else (1, 16, 48, 64, 640):  # the GEMV (1, 16), the 16-row (48, 64), the 64-row
                label = f"moe {ex.name} {'mxfp4' if mxfp4 else 'bf16'} tokens={t}"
                cases.append((label, _moe_case(tm, ex, mxfp4, t)))
    for e in (128, 32):  # the routing kernel: 120b's and 20b's experts
        cases.append(
            (f"moe route experts={e}", lambda e=e: tm.route_topk(torch.empty((8, e), dtype=torch.bfloat16), 4))
        )
    cases.append(("mxfp4 dequantize gpt-oss", lambda: tm.mxfp4_dequantize(
        torch.empty((5760, 90, 16), dtype=torch.uint8), torch.empty((5760, 90), dtype=torch.uint8), torch.bfloat16
    )))  # fmt: skip
    return cases


def _moe_case(tm, ex: Experts, mxfp4: bool, tokens: int):
    def weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mxfp4:
            g = k // tm.MXFP4_GROUP
            blocks = torch.empty((ex.num_experts, n, g, tm.MXFP4_GROUP // 2), dtype=torch.uint8)
            return blocks, torch.empty((ex.num_experts, n, g), dtype=torch.uint8)
        return torch.empty((ex.num_experts, n, k), dtype=torch.bfloat16), None

    def run() -> None:
        i2 = 2 * ex.intermediate
        gate_up, gate_up_scales = weights(i2, ex.hidden)
        down, down_scales = weights(ex.hidden, ex.intermediate)
        # Valid expert ids: the alignment kernel's output sizes the GEMM grid, and it does not run here.
        topk_ids = (torch.arange(tokens * ex.top_k, dtype=torch.int32) % ex.num_experts).view(tokens, ex.top_k)
        tm.fused_experts(
            torch.empty((tokens, ex.hidden), dtype=torch.bfloat16), topk_ids,
            torch.empty((tokens, ex.top_k), dtype=torch.bfloat16),
            gate_up=gate_up, gate_up_scales=gate_up_scales,
            gate_up_bias=torch.empty((ex.num_experts, i2), dtype=torch.bfloat16),
            down=down, down_scales=down_scales, down_bias=torch.empty((ex.num_experts, ex.hidden), dtype=torch.bfloat16),
            swiglu_alpha=1.702, swiglu_limit=7.0,
        )  # fmt: skip

    return run


def _norm_cases() -> list[tuple[str, Callable[[], None]]]:
    """The one-launch RMSNorm at gpt-oss's width (weight in fp32) and a Llama/Qwen3-like one (rounded first)."""
    from brisk.kernels.triton_norm import rms_norm

    def case(d: int, dtype: torch.dtype, weight_in_fp32: bool) -> Callable[[], None]:
        return lambda: rms_norm(torch.empty((8, d), dtype=dtype), torch.empty(d, dtype=dtype), 1e-5, weight_in_fp32)

    return [
        ("norm gpt-oss bfloat16", case(2880, torch.bfloat16, True)),
        ("norm llama bfloat16", case(4096, torch.bfloat16, False)),
        ("norm gpt-oss float32", case(2880, torch.float32, True)),
    ]


def _mask_cases() -> list[tuple[str, Callable[[], None]]]:
    """Structured outputs' mask on CUDA logits: xgrammar's Triton kernel, which brisk's apply_token_bitmask reaches
    through xgrammar on a GPU; launched as xgrammar launches it, with an H100's 132 SMs."""
    try:
        from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_kernel
    except ImportError:
        return []
    vocab = 201_088  # o200k_harmony

    def case(dtype: torch.dtype) -> Callable[[], None]:
        def run() -> None:
            logits = torch.empty((64, vocab), dtype=dtype)
            bitmask = torch.empty((64, -(-vocab // 32)), dtype=torch.int32)
            rows = torch.arange(8, dtype=torch.int32)
            apply_token_bitmask_inplace_kernel[(132,)](
                logits, bitmask, rows, 8, vocab, logits.stride(0), bitmask.stride(0), NUM_SMS=132, BLOCK_SIZE=4096
            )

        return run

    return [(f"mask xgrammar {str(dtype)[6:]} logits", case(dtype)) for dtype in (torch.float32, torch.bfloat16)]


# ------------------------------------------------------------------------------------------ compiling


def compile_all(arch: int = 90, full: bool = True, only: str = "") -> Report:
    if interpreting():
        raise SystemExit("unset TRITON_INTERPRET: the interpreter never runs the backend compiler")
    import triton
    import triton.backends.nvidia
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    cuobjdump = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    report = Report(arch, triton.__version__)
    variants: dict[str, Variant] = {}
    current: list[str] = [""]
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        started = time.perf_counter()
        try:
            kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
            compile_s = round(time.perf_counter() - started, 2)  # reading its resources below is not compiling
        except Exception as exc:  # a backend compile error: record it against this kernel and case, go on
            key = f"{self.__name__}/{current[0]}"
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            variants[key] = Variant(self.__name__, [current[0]], error=f"{type(exc).__name__}: {first}"[:300])
            raise _CaseStopped from exc
        seen = variants.get(kernel.hash)
        if seen is not None:
            if current[0] not in seen.cases:
                seen.cases.append(current[0])
            return kernel
        regs, local = _resources(kernel.asm["cubin"], cuobjdump)
        md = kernel.metadata
        ptx = kernel.asm["ptx"]
        mma = next((kind for kind, op in MMA_OPS if op in ptx), "")
        variants[kernel.hash] = Variant(
            self.__name__, [current[0]], md.num_warps, md.num_stages, md.shared, regs, local, mma, compile_s
        )  # fmt: skip
        return kernel

    try:
        own_driver = driver.default
    except RuntimeError:  # no GPU here: nothing to go back to
        own_driver = None
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    JITFunction.run = compile_only  # type: ignore[method-assign]
    try:
        for label, case in _attention_cases(full, arch) + _moe_cases(full) + _norm_cases() + _mask_cases():
            if only and only not in label:
                continue
            current[0] = label
            try:
                case()
            except _CaseStopped:
                pass
            except Exception as exc:
                report.case_errors[label] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        JITFunction.run = original_run  # type: ignore[method-assign]
        if own_driver is not None:
            driver.set_active(own_driver)
    report.variants = sorted(variants.values(), key=lambda v: (v.kernel, v.cases[0]))
    return report


class _CaseStopped(Exception):
    """A kernel of the case failed to compile; its later kernels would only repeat the failure's cause."""


def print_table(report: Report) -> None:
    print(f"Triton {report.triton_version}, sm_{report.arch}: {len(report.variants)} kernel variants\n")
    print("| kernel | warps | stages | shared KiB | regs | local B | mma | compile s | first case | problems |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v in report.variants:
        problems = "; ".join(v.problems(report.arch)) or ("spills" if v.local_bytes else "")
        print(
            f"| {v.kernel} | {v.num_warps} | {v.num_stages} | {v.shared_bytes / 1024:.1f} | {v.registers} | "
            f"{v.local_bytes} | {v.mma} | {v.compile_s} | {v.cases[0]} (+{len(v.cases) - 1}) | {problems} |"
        )
    for case, err in report.case_errors.items():
        print(f"| (case) | | | | | | | | {case} | {err} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--quick", action="store_true", help="gpt-oss-120b at TP1 only: one model's variants")
    parser.add_argument("--only", default="", help="cases whose label contains this")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    report = compile_all(args.arch, full=not args.quick, only=args.only)
    print_table(report)
    failures = report.failures()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report) | {"failures": failures}, f, indent=1)
    for line in failures:
        print(f"FAIL {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
