"""Facts about the machine brisk runs on, each read in one place: the CPU's name and feature flags, the instruction
sets brisk's C kernels are built for that this CPU runs, the torch device a rank computes on (and `to_device`, the one
way host arrays reach it), the threads a CPU rank gets, the C heap's settings a CPU rank runs with, and the garbage
collector's view of a long-lived engine process."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from brisk.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch

T = TypeVar("T")

# brisk's CPU kernels (brisk/kernels/cpu_kernels.c) are built for one of these instruction sets, best first, and
# need these /proc/cpuinfo flags for it; on any other CPU (or with no C compiler) the PyTorch ops run.
CPU_KERNEL_ISAS: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx2", "fma"}),
    "avx2": frozenset({"avx2", "fma"}),
}
CPU_KERNEL_CHOICES = ("auto", *CPU_KERNEL_ISAS, "torch")


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """The first processor's model name and flags (Linux); elsewhere platform's name and no flags."""
    name, flags = "", frozenset[str]()
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:  # x86 / Arm
                    flags = frozenset(value.split())
                elif not key and (name or flags):  # the blank line after the first processor
                    break
    except OSError:
        pass
    return CpuInfo(name or platform.processor() or platform.machine(), flags)


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """AVX512-BF16 or AMX: the CPU multiplies bf16 natively."""
    flags = cpu_info().flags if flags is None else flags
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_kernel_isas(flags: frozenset[str] | None = None, machine: str | None = None) -> tuple[str, ...]:
    """The instruction sets of brisk's CPU kernels this CPU runs, best first (empty: not x86-64, or too old)."""
    if (machine or platform.machine()).lower() not in ("x86_64", "amd64"):
        return ()
    flags = cpu_info().flags if flags is None else flags
    return tuple(isa for isa, needs in CPU_KERNEL_ISAS.items() if needs <= flags)


def check_cpu_kernels_choice(choice: str, isas: tuple[str, ...] | None = None) -> None:
    """A forced instruction set this CPU lacks is an error (ValueError, for the config field `cpu_kernels`)."""
    isas = cpu_kernel_isas() if isas is None else isas
    if choice in CPU_KERNEL_ISAS and choice not in isas:
        needs = ", ".join(sorted(CPU_KERNEL_ISAS[choice]))
        runs = ", ".join(isas) or "none: PyTorch ops only"
        raise ValueError(f"'{choice}' needs a CPU with {needs}; this one runs: {runs} (use auto, or torch)")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The torch device a rank computes on: `device` 'auto' is CUDA where torch sees a GPU, else the CPU; on CUDA
    the rank's GPU (the one named, else cuda:LOCAL_RANK, or the one GPU a launcher left this process) is made the
    current device."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if device.index is not None:  # an explicit GPU: made the current one too (unindexed CUDA calls go there)
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name} does not exist: this node has {torch.cuda.device_count()} GPUs")
        torch.cuda.set_device(device)
        return device
    count = torch.cuda.device_count()
    # One GPU seen: a launcher gave this process its own (SLURM's --gpus-per-task, CUDA_VISIBLE_DEVICES per task).
    index = 0 if count == 1 else local_rank
    if index >= count:
        raise ConfigError(
            f"rank with LOCAL_RANK {local_rank} needs GPU {local_rank}, but this node has {count}; lower tp_size or "
            "add nodes"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` made the calling thread's current CUDA device while inside (CUDA's current device is per thread, and
    Triton launches and graph replays go to the current one: an offline LLM on cuda:1 driven from another thread
    than the one that built it would launch on cuda:0); nothing on a CPU."""
    import torch

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def cpu_threads_per_rank(tp_size: int, num_cpu_threads: int | None = None) -> int:
    """torch threads for one CPU rank of a served model: `num_cpu_threads` where given (EngineConfig's), else the
    cores but one, shared among the tp_size ranks. The one left is the API server's (and a local client's): when every core runs an
    OpenMP thread, each token the server streams preempts one of them while the others spin at the next barrier
    (measured: docs/performance.md)."""
    if num_cpu_threads is not None:
        return num_cpu_threads
    return max(1, ((os.cpu_count() or 1) - 1) // tp_size)


def keep_freed_memory_in_the_heap() -> bool:
    """glibc returns big freed blocks to the OS (mmap / trim), so each step's big activations are faulted in
    page by page again: on CPU that doubled the first matmul at a new shape and slowed served prefill steps
    (docs/performance.md). Raise both thresholds to 1 GiB, once, for this process. glibc only (False elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def freeze_startup_heap() -> None:
    """Take every object alive after start-up out of the garbage collector's view (gc.freeze, as vLLM's engine
    does). The model, the tokenizer and the imported libraries are hundreds of thousands of objects that live as
    long as the process, and every full collection walked all of them: at batch 640 that was ~1.6 ms of each
    engine step on average (docs/performance.md). For processes that run one engine until they exit (the engine
    process, the other ranks); not for a user's process that opens and closes engines (a frozen reference cycle
    is never collected)."""
    gc.collect()
    gc.freeze()


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`. To a GPU through pinned memory, asynchronously: the host goes on preparing (the
    pinned copy stays alive until the transfer is done) and never waits for the step in flight. On a CPU, no copy."""
    import torch

    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors' one copy to the host, started where they are final. On a GPU the copies go at once,
    asynchronously, into pinned host buffers of their own (fresh each time: a later step's copy can never overwrite
    unread ones), an event behind them; `get()` waits for that event alone, so the host waits for the kernels that
    computed these tensors, not for those of a step launched after them (a `.tolist()` of a device tensor would
    queue behind them all and undo overlap scheduling). On a CPU, the tensors themselves, read when asked."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], event: torch.cuda.Event | None = None) -> None:
        """tensors: on the host, or being copied there until `event` (None: nothing to wait for)."""
        self._tensors = tensors
        self._event = event

    @classmethod
    def start(cls, *tensors: torch.Tensor) -> HostCopy:
        import torch

        if not any(t.is_cuda for t in tensors):
            return cls(tensors)  # a CPU: nothing pinned (pinning needs CUDA)
        buffers = []
        for t in tensors:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buffers.append(buffer.copy_(t, non_blocking=True))
        event = torch.cuda.Event()
        # on the tensors' device's current stream (the one that computed and copies them), whatever device is the
        # calling thread's current one
        event.record(torch.cuda.current_stream(next(t.device for t in tensors if t.is_cuda)))
        return cls(tuple(buffers), event)

    def get(self) -> tuple[torch.Tensor, ...]:
        """The tensors on the host (waits for the copy, the first time)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tensors


class HostResult(Generic[T]):
    """Something a step reports that is built on the host from device tensors (its packed rows, logprobs): their
    copy (HostCopy) started in the step, the build done where the step's outputs are read, once. On a GPU the step
    never waits for its own kernels, so overlap scheduling holds."""

    def __init__(self, copy: HostCopy, build: Callable[..., T]) -> None:
        """build: called with the copied tensors, on the host."""
        self._state: HostCopy | tuple[T] = copy  # the copy until built, then the value (the buffers released)
        self._build = build

    def get(self) -> T:
        if isinstance(self._state, HostCopy):
            self._state = (self._build(*self._state.get()),)
        return self._state[0]
