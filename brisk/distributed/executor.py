"""Who runs the model for the engine core: this process alone, or a torch.distributed world it drives.

`execute_model(scheds)` is the engine core's only call into the model side, the same for one process and for
many ranks: `scheds` holds one `SchedulerOutput` per attention-DP rank, and it returns a `StepHandle` whose
`result()` is the step's `ModelRunnerOutput` per DP rank. `DistributedExecutor` is rank 0: each step it
publishes the SchedulerOutputs (msgspec bytes over the `StepChannel`) and runs its own part; the other ranks
(worker.py) keep their own persistent batch from the same messages. Collectives inside the model keep the ranks
in lock step.
A worker that dies takes rank 0 down with a non-zero exit (the API server then reports unhealthy and exits),
never a hang in a collective that can no longer complete.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import msgspec
import torch
import torch.distributed as dist

from brisk.config import EngineConfig
from brisk.distributed.comm import abort_if_nccl
from brisk.distributed.launch import rank0_place
from brisk.distributed.worker import WorkerSpec, join_world
from brisk.host import resolve_device
from brisk.model_config import ModelConfig
from brisk.model_runner.cuda_graph import effective_graph_config
from brisk.model_runner.interface import KVCacheSpec, ModelRunnerInterface, StepHandle
from brisk.model_runner.setup import load_model_runner
from brisk.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)
WORKER_EXIT_TIMEOUT_S = 30


class LocalExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device, max_seq_len: int):
        self.runner: ModelRunnerInterface = load_model_runner(config, model_config, device, max_seq_len)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.runner.kv_cache_spec

    def execute_model(self, scheds: list[SchedulerOutput]) -> StepHandle:
        return self.runner.execute_model(scheds)

    def shutdown(self) -> None:
        self.runner.close()


class DistributedExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_seq_len: int):
        place = rank0_place(config)
        if place.rank != 0:
            raise RuntimeError(
                f"the engine core runs on rank 0, not rank {place.rank}: launch `brisk serve` on "
                "every rank (ranks > 0 become workers)"
            )
        self.device = resolve_device(config.device, place.local_rank)
        self._stopping = threading.Event()
        self._in_step = False
        self._workers: list[subprocess.Popen[bytes]] = []
        if not place.launched_externally:
            # Every rank must run the same steps: the cuda_graph_config in effect, as if given explicitly.
            rank_config = config.model_copy(update={"cuda_graph_config": effective_graph_config(config, self.device)})
            config_json = rank_config.model_dump_json()
            for rank in range(1, place.world_size):
                spec = WorkerSpec(
                    config_json=config_json, rank=rank, world_size=place.world_size, init_method=place.init_method
                )
                self._spawn(spec)
        self.runner, self.channel = join_world(config, place, self.device, model_config, max_seq_len)
        self._encoder = msgspec.msgpack.Encoder()
        logger.info("%d ranks ready (%s)", place.world_size, self.runner.parallel)

    def _spawn(self, spec: WorkerSpec) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "brisk.distributed.worker"], stdin=subprocess.PIPE)
        assert proc.stdin is not None  # stdin=PIPE
        proc.stdin.write(msgspec.json.encode(spec) + b"\n")
        proc.stdin.flush()  # the pipe stays open: the worker exits when it closes
        self._workers.append(proc)
        threading.Thread(
            target=self._watch, args=(spec.rank, proc), daemon=True, name=f"brisk-watch-rank{spec.rank}"
        ).start()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._stopping.is_set():
            # Rank 0 may be blocked in a collective that can never complete now (NCCL waits forever):
            # exit at once and loudly; whoever started this process sees the non-zero status.
            logger.critical("rank %d exited with code %s; the engine cannot go on and exits", rank, code)
            os._exit(1)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.runner.kv_cache_spec

    def execute_model(self, scheds: list[SchedulerOutput]) -> StepHandle:
        self._in_step = True  # cleared only if every rank is known to have finished the step
        self.channel.publish(self._encoder.encode(scheds))
        handle = self.runner.execute_model(scheds)
        self._in_step = False
        return handle

    def shutdown(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        aborted = False
        if self._in_step:
            # A step failed half-way on this rank: the workers wait in a collective that will never
            # complete, so there is no orderly stop to broadcast. This rank's own queued collectives of the step
            # never complete either: the group is ended before anything waits on the device.
            for proc in self._workers:
                proc.kill()
            aborted = abort_if_nccl()
        else:
            self.channel.publish_stop()  # ends the workers' loops
        for proc in self._workers:
            try:
                proc.wait(timeout=WORKER_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
            if proc.stdin is not None:  # always (stdin=PIPE); the check is for the type checker
                proc.stdin.close()
        self.runner.close()
        self.channel.close()
        if not aborted:
            dist.destroy_process_group()


def make_executor(config: EngineConfig, model_config: ModelConfig, device: torch.device, max_seq_len: int):
    if config.tp_size == 1:
        return LocalExecutor(config, model_config, device, max_seq_len)
    return DistributedExecutor(config, model_config, max_seq_len)
