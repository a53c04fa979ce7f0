"""A rank other than 0: holds its shard of the model and KV cache, and runs every step rank 0 broadcasts
(the SchedulerOutputs: each rank keeps its own persistent batch from them).

Started by rank 0 (`python -m brisk.distributed.worker`, its place as one JSON line on stdin) or by a
launcher (torchrun: `brisk serve` on ranks > 0 calls `run_worker`). Rank 0's stop message ends the loop.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import msgspec
import torch
import torch.distributed as dist

from brisk.config import EngineConfig, load_model_config
from brisk.distributed.channel import StepChannel
from brisk.distributed.launch import WorldPlace, init_distributed
from brisk.host import cpu_threads_per_rank, freeze_startup_heap, resolve_device
from brisk.model_config import ModelConfig, ParallelConfig
from brisk.model_runner.interface import ModelRunnerInterface
from brisk.model_runner.setup import load_model_runner
from brisk.scheduler.output import SchedulerOutput

logger = logging.getLogger("brisk.worker")


class WorkerSpec(msgspec.Struct):
    config_json: str
    rank: int
    world_size: int
    init_method: str


def join_world(
    config: EngineConfig, place: WorldPlace, device: torch.device, model_config: ModelConfig, max_seq_len: int
) -> tuple[ModelRunnerInterface, StepChannel]:
    """How every rank, 0 included, joins: the process group, the step channel, then its shard of the model
    and KV cache. Each step runs collectives, so every rank must take them in this one order."""
    cpu_group = init_distributed(place, device)
    channel = StepChannel(place.rank, cpu_group, over_tcp=place.launched_externally)
    parallel = ParallelConfig.for_rank(place.rank, place.world_size, config.ep_size, config.enable_attention_dp)
    return load_model_runner(config, model_config, device, max_seq_len, parallel, cpu_group), channel


def run_worker(config: EngineConfig, place: WorldPlace) -> None:
    device = resolve_device(config.device, place.local_rank)
    torch.manual_seed(config.seed)  # as EngineCore on rank 0: an attention-DP rank's unseeded requests draw from it
    if device.type == "cpu":  # ranks on one host share its cores
        torch.set_num_threads(cpu_threads_per_rank(config.tp_size, config.num_cpu_threads))
    runner, channel = join_world(config, place, device, *load_model_config(config, device))
    logger.info("rank %d/%d ready on %s", place.rank, place.world_size, device)
    freeze_startup_heap()
    decoder = msgspec.msgpack.Decoder(list[SchedulerOutput])
    while (payload := channel.receive()) is not None:
        runner.execute_model(decoder.decode(payload))
    runner.close()
    channel.close()
    dist.destroy_process_group()


def _exit_when_rank0_is_gone(done: threading.Event) -> None:
    while os.read(0, 4096):  # b"" at EOF: rank 0 closed the pipe or died (raw reads: no buffer lock at exit)
        pass
    if not done.is_set():
        logger.error("rank 0 is gone; this worker exits")
        os._exit(1)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s worker: %(message)s")
    spec = msgspec.json.decode(sys.stdin.buffer.readline(), type=WorkerSpec)
    done = threading.Event()
    threading.Thread(target=_exit_when_rank0_is_gone, args=(done,), daemon=True).start()
    config = EngineConfig.model_validate_json(spec.config_json)
    run_worker(config, WorldPlace(spec.rank, spec.world_size, spec.rank, spec.init_method, launched_externally=False))
    done.set()


if __name__ == "__main__":
    main()
