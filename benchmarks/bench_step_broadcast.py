"""How rank 0 should hand each step's inputs to the other ranks: the cost per step of each way.

    python benchmarks/bench_step_broadcast.py [--world-size 2] [--steps 2000] [--out broadcast.json]

Rank 0 sends a `SchedulerOutput` list (what `DistributedExecutor.execute_model` broadcasts) of a decode step of
1, 64 and 256 running requests at 2k context (a new block every 32 steps: here each message carries one), and of
an 8,192-token prompt scheduled for the first time; every other rank decodes it. Ways compared:
    gloo-bytes     msgspec bytes over a torch.distributed gloo group: a size, then the payload
    gloo-pickle    torch.distributed.broadcast_object_list (pickle)
    zmq-ipc        msgspec bytes over ZeroMQ PUB/SUB on an IPC socket: brisk's StepChannel (what brisk does)
    shm-barrier    msgspec bytes in a multiprocessing shared-memory buffer, two barriers per step
Each way sends `steps` messages back to back and ends with one round trip; the figure is the total time per
message, so it includes the receivers keeping up. It prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from multiprocessing import shared_memory

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from brisk.distributed.channel import StepChannel
from brisk.distributed.comm import broadcast_bytes
from brisk.sampling_params import SamplingParams
from brisk.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

SHM_BYTES = 64 << 20
WAYS = ("gloo-bytes", "gloo-pickle", "zmq-ipc", "shm-barrier")


def make_inputs(batch: int, context: int, new_tokens: int, block_size: int = 32) -> list[SchedulerOutput]:
    """One DP rank's step: `batch` requests of `context` tokens each computing `new_tokens` (gpt-oss: 2 KV groups).
    A request computing its whole context is new (prompt, parameters, block tables); others are running ones."""
    rids = [f"req-{i}" for i in range(batch)]
    nblocks = context // block_size
    if new_tokens == context:
        blocks = [list(range(1 + i * nblocks, 1 + (i + 1) * nblocks)) for i in range(batch)]
        new = [NewRequestData(r, list(range(context)), SamplingParams(), None, [b, b], 0) for r, b in zip(rids, blocks)]
        return [
            SchedulerOutput(
                new_requests=new,
                num_scheduled_tokens=dict.fromkeys(rids, new_tokens),
                total_num_scheduled_tokens=batch * new_tokens,
                sampled_req_ids=rids,
            )
        ]
    cached = CachedRequestData(rids, [[[1 + i], [1 + i]] for i in range(batch)])
    return [
        SchedulerOutput(
            cached_requests=cached,
            num_scheduled_tokens=dict.fromkeys(rids, new_tokens),
            total_num_scheduled_tokens=batch * new_tokens,
            sampled_req_ids=rids,
        )
    ]


CASES = {
    "decode-1": (1, 2048, 1),
    "decode-64": (64, 2048, 1),
    "decode-256": (256, 2048, 1),
    "prefill-8192": (1, 8192, 8192),
}


def run_rank(rank: int, world: int, port: int, steps: int, shm_name: str, barrier, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(list[SchedulerOutput])
    channel = StepChannel(rank, None, over_tcp=False)
    shm = shared_memory.SharedMemory(name=shm_name)
    for case, shape in CASES.items():
        inputs = make_inputs(*shape) if rank == 0 else None
        for way in WAYS:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                if way == "gloo-bytes":
                    payload = broadcast_bytes(encoder.encode(inputs) if rank == 0 else None, None)
                    if rank:
                        decoder.decode(payload)
                elif way == "gloo-pickle":
                    box = [inputs]
                    dist.broadcast_object_list(box, src=0)
                elif way == "zmq-ipc":
                    if rank == 0:
                        channel.publish(encoder.encode(inputs))
                    else:
                        decoder.decode(channel.receive())
                else:
                    if rank == 0:
                        data = encoder.encode(inputs)
                        shm.buf[:8] = len(data).to_bytes(8, "little")
                        shm.buf[8 : 8 + len(data)] = data
                    barrier.wait()  # written
                    if rank:
                        size = int.from_bytes(shm.buf[:8], "little")
                        decoder.decode(bytes(shm.buf[8 : 8 + size]))
                    barrier.wait()  # read: the buffer may be reused
            dist.barrier()
            per_step_us = (time.perf_counter() - start) / steps * 1e6
            if rank == 0:
                results.append(
                    dict(case=case, way=way, per_step_us=per_step_us, payload_bytes=len(encoder.encode(inputs)))
                )
    shm.close()
    dist.barrier()  # every message was taken before the publisher goes
    channel.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    from brisk.distributed.launch import free_port

    manager = mp.get_context("spawn").Manager()
    results = manager.list()
    barrier = mp.get_context("spawn").Barrier(args.world_size)
    shm = shared_memory.SharedMemory(create=True, size=SHM_BYTES)
    try:
        mp.start_processes(
            run_rank,
            args=(args.world_size, free_port(), args.steps, shm.name, barrier, results),
            nprocs=args.world_size,
            start_method="spawn",
        )
    finally:
        shm.close()
        shm.unlink()
    rows = list(results)
    print(f"| case | payload (bytes) | {' | '.join(WAYS)} |")
    print("|---|---|" + "---|" * len(WAYS))
    for case in CASES:
        cells = {r["way"]: r for r in rows if r["case"] == case}
        print(
            f"| {case} | {cells[WAYS[0]]['payload_bytes']:,} | "
            + " | ".join(f"{cells[w]['per_step_us']:.0f} us" for w in WAYS)
            + " |"
        )
    if args.out:
        meta = dict(
            date=datetime.datetime.now().isoformat(timespec="seconds"),
            machine=platform.node(),
            cpu_count=os.cpu_count(),
            command=shlex.join([sys.executable, *sys.argv]),
            world_size=args.world_size,
            steps=args.steps,
        )
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=2)


if __name__ == "__main__":
    main()
