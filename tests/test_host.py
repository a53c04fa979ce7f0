"""brisk.host: the CPU facts read from /proc/cpuinfo, the kernel instruction sets they allow, device resolution."""

from __future__ import annotations

import pytest
import torch

from brisk import host
from brisk.config import ConfigError, EngineConfig
from brisk.host import (
    check_cpu_kernels_choice,
    cpu_has_native_bf16,
    cpu_info,
    cpu_kernel_isas,
    cpu_threads_per_rank,
    resolve_device,
)

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx fma avx2 bmi2

processor\t: 1
model name\t: another
flags\t\t: fpu avx512f
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd bf16 sve

"""


def test_the_first_processors_name_and_flags_are_read(tmp_path):
    (tmp_path / "x86").write_text(X86)
    info = cpu_info(str(tmp_path / "x86"))
    assert info.model_name == "AMD EPYC 7B13"
    assert info.flags == {"fpu", "sse2", "avx", "fma", "avx2", "bmi2"}  # not the second processor's
    (tmp_path / "arm").write_text(ARM)
    assert cpu_info(str(tmp_path / "arm")).flags == {"fp", "asimd", "bf16", "sve"}
    missing = cpu_info(str(tmp_path / "none"))  # not Linux: a name from platform, no flags
    assert missing.model_name and missing.flags == frozenset()


def test_kernel_instruction_sets_follow_the_flags():
    avx2 = frozenset({"avx2", "fma"})
    avx512 = avx2 | {"avx512f", "avx512bw"}
    assert cpu_kernel_isas(avx512, "x86_64") == ("avx512", "avx2")  # best first
    assert cpu_kernel_isas(avx2, "x86_64") == ("avx2",)
    assert cpu_kernel_isas(frozenset({"avx2"}), "x86_64") == ()  # AVX2 without FMA
    assert cpu_kernel_isas(avx512, "aarch64") == ()
    check_cpu_kernels_choice("avx2", ("avx2",))
    check_cpu_kernels_choice("auto", ())  # auto and torch run anywhere
    check_cpu_kernels_choice("torch", ())
    with pytest.raises(ValueError, match="'avx512' needs a CPU with avx2, avx512bw, avx512f, fma; this one runs: avx2"):
        check_cpu_kernels_choice("avx512", ("avx2",))
    assert cpu_has_native_bf16(frozenset({"avx512_bf16"})) and cpu_has_native_bf16(frozenset({"amx_bf16"}))
    assert not cpu_has_native_bf16(avx512)


def test_one_device_resolution_for_every_rank():
    assert resolve_device("cpu") == resolve_device("cpu", local_rank=1) == torch.device("cpu")
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected


@pytest.mark.parametrize("count, local_rank, expected", [(8, 3, 3), (1, 3, 0), (1, 0, 0), (2, 3, None)])
def test_each_rank_takes_its_local_gpu_or_the_one_it_was_given(monkeypatch, count, local_rank, expected):
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    if expected is None:
        with pytest.raises(ConfigError, match="LOCAL_RANK 3 needs GPU 3, but this node has 2"):
            resolve_device("cuda", local_rank)
        return
    assert resolve_device("cuda", local_rank) == torch.device("cuda", expected) and chosen == [expected]


def test_one_named_gpu_for_several_ranks_is_refused():
    with pytest.raises(ConfigError, match="cuda:1 names one GPU, but tp_size 2 ranks need one each"):
        EngineConfig.build("m", device="cuda:1", tp_size=2)
    assert EngineConfig.build("m", device="cuda:1").device == "cuda:1"


def test_cpu_threads_leave_one_core_to_the_api_server(monkeypatch):
    for cores, tp_size, expected in ((8, 1, 7), (8, 2, 3), (2, 1, 1), (1, 1, 1), (2, 2, 1)):
        monkeypatch.setattr(host.os, "cpu_count", lambda cores=cores: cores)
        assert cpu_threads_per_rank(tp_size) == expected
    assert cpu_threads_per_rank(1, num_cpu_threads=5) == 5


def test_a_step_runs_with_its_gpu_current_on_any_thread(tmp_path, monkeypatch):
    """CUDA's current device is per thread, and Triton launches and graph replays go to it: the runner makes its own
    device current around each step (on a GPU), whichever thread drives the engine."""
    import contextlib
    import threading

    from brisk import LLM, SamplingParams
    from brisk.model_runner import runner as runner_module
    from tests.tiny_models import make_tiny_model
    from tests.tiny_tokenizer import make_tiny_tokenizer

    assert isinstance(host.on_device(torch.device("cpu")), contextlib.nullcontext)
    on_gpu = host.on_device(torch.device("cuda", 1))
    assert isinstance(on_gpu, torch.cuda.device) and on_gpu.idx == 1
    entered: list[tuple[torch.device, str]] = []

    @contextlib.contextmanager
    def recorded(device):
        entered.append((device, threading.current_thread().name))
        yield

    monkeypatch.setattr(runner_module, "on_device", recorded)
    path = make_tiny_model("llama", tmp_path / "m", seed=0)
    make_tiny_tokenizer(path)
    with LLM(path, dtype="float32", max_seq_len=64) as llm:
        entered.clear()
        worker = threading.Thread(
            target=llm.generate, args=([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True)), name="driver"
        )
        worker.start()
        worker.join()
    assert entered and all(e == (torch.device("cpu"), "driver") for e in entered)
