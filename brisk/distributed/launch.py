"""How the ranks of a job find each other.

Two ways in, as with vLLM / TensorRT-LLM:
- `brisk serve --tp_size N` on one node: rank 0 (the engine core) spawns ranks 1..N-1 as worker processes
  (`python -m brisk.distributed.worker`) and hands each its place over the worker's stdin, which it keeps
  open: a worker exits when that pipe closes, so a dead engine never leaves workers behind.
- Multi-node: `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK) or `mpirun` (OMPI_COMM_WORLD_*), with MASTER_ADDR and
  MASTER_PORT exported, starts `brisk serve` on every rank; rank 0 serves HTTP, the others run the
  worker loop. See docs/parallelism.md.
"""

from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from brisk.config import EngineConfig
from brisk.errors import ConfigError

INIT_TIMEOUT = timedelta(minutes=10)  # loading a 120B checkpoint on a slow disk takes minutes


@dataclass(frozen=True)
class WorldPlace:
    """Where this process sits in the job and how it joins it."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str
    launched_externally: bool  # torchrun started every rank; nobody here spawns workers


# torchrun's variables, then Open MPI's (mpirun, as in the TensorRT-LLM guide; MASTER_ADDR / MASTER_PORT must
# still be exported to every rank).
LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
)


def launcher_env() -> dict[str, int] | None:
    """RANK / WORLD_SIZE / LOCAL_RANK as set by torchrun or mpirun, if this is such a job."""
    for rank, world, local in LAUNCHER_VARIABLES:
        if int(os.environ.get(world, "1")) > 1:
            values = {
                "RANK": os.environ.get(rank, "0"),
                "WORLD_SIZE": os.environ[world],
                "LOCAL_RANK": os.environ.get(local, "0"),
            }
            return {key: int(value) for key, value in values.items()}
    return None


def ranks_on_this_machine(world_size: int) -> int:
    """How many of the world's ranks share this machine (each pins its own host KV tier): what torchrun / mpirun
    say, else all of them (rank 0 spawned them here)."""
    if launcher_env() is None:
        return world_size
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return 1


def rank_place(config: EngineConfig, env: dict[str, int]) -> WorldPlace:
    """This process's place in a launcher-started job."""
    if env["WORLD_SIZE"] != config.tp_size:
        raise ConfigError(f"the launcher started WORLD_SIZE={env['WORLD_SIZE']} ranks but tp_size is {config.tp_size}")
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ConfigError("a launcher-started job needs MASTER_ADDR and MASTER_PORT (rank 0's host and a free port)")
    return WorldPlace(
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], f"tcp://{addr}:{port}", launched_externally=True
    )


def rank0_place(config: EngineConfig) -> WorldPlace:
    """Rank 0's place: from the launcher's variables, else a fresh local world that rank 0 will spawn. Checked
    before any worker is spawned: a process joins one world at a time."""
    if dist.is_initialized():
        gc.collect()  # an engine dropped inside a reference cycle leaves its world when collected (LLM's finalizer)
    if dist.is_initialized():
        raise RuntimeError(
            "this process is already in a distributed world: another engine with tp_size > 1 is still open here "
            "(close() its LLM, or leave its `with` block, before creating the next one)"
        )
    env = launcher_env()
    if env is None:
        return WorldPlace(0, config.tp_size, 0, f"tcp://127.0.0.1:{free_port()}", launched_externally=False)
    return rank_place(config, env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(place: WorldPlace, device: torch.device) -> dist.ProcessGroup | None:
    """Join the world (NCCL for GPU tensors, gloo for CPU ones); returns the gloo group for host bytes
    (None: the default group already is gloo)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=place.init_method, rank=place.rank, world_size=place.world_size, timeout=INIT_TIMEOUT
    )
    return dist.new_group(backend="gloo") if backend != "gloo" else None
