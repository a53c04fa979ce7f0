"""The collectives of brisk/distributed/comm.py on two gloo ranks, against the same exchange computed on one
process: both ways of each (the flat-tensor forms NCCL takes, the list forms gloo takes), with unequal row counts
(attention-DP steps) and equal ones (the static-buffer steps)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from brisk.distributed import comm

WORLD = 2
H = 5


def _rows(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n * H, dtype=torch.float32).reshape(n, H) + 100 * rank


def _ranks(rank: int, port: int, flat: bool, counts: list[int], failures) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        if flat:  # the NCCL branches (this torch's gloo has the flat-tensor collectives too)
            comm.gathers_into_one_tensor = lambda: True
        gathered = comm.all_gather_rows(_rows(rank, counts[rank]), counts)
        torch.testing.assert_close(gathered, torch.cat([_rows(r, n) for r, n in enumerate(counts)]), rtol=0, atol=0)
        partial = torch.stack([torch.full((H,), float(rank + i)) for i in range(sum(counts))])
        mine = comm.reduce_scatter_rows(partial, counts, rank)
        first = sum(counts[:rank])
        expected = sum(torch.stack([torch.full((H,), float(r + i)) for i in range(sum(counts))]) for r in range(WORLD))
        torch.testing.assert_close(mine, expected[first : first + counts[rank]], rtol=0, atol=0)
        shard = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank  # [rows, vocab / world]
        logits = comm.all_gather_last_dim(shard, WORLD)
        whole = torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(WORLD)], -1)
        torch.testing.assert_close(logits, whole, rtol=0, atol=0)
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the test in the parent, then raised
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


@pytest.mark.parametrize("flat", [False, True], ids=["lists", "flat"])
@pytest.mark.parametrize("counts", [[3, 1], [0, 2], [2, 2]])
def test_collectives_match_one_process(flat: bool, counts: list[int]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    procs = [ctx.Process(target=_ranks, args=(r, port, flat, counts, failures)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():  # a rank stuck in a collective: the assertion below reports it
            p.terminate()
    errors = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert not errors and all(p.exitcode == 0 for p in procs), (errors, [p.exitcode for p in procs])


def _channel_ranks(rank: int, port: int, failures) -> None:
    from brisk.distributed.channel import StepChannel

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        channel = StepChannel(rank, None, over_tcp=False)
        if rank == 0:
            for payload in (b"one", b"two"):
                channel.publish(payload)
            channel._sequence += 1  # a step ZeroMQ dropped (a subscriber's connection down while it was published)
            channel.publish(b"four")
            channel.publish_stop()
        else:
            assert [bytes(channel.receive()), bytes(channel.receive())] == [b"one", b"two"]
            with pytest.raises(RuntimeError, match="step 3 from rank 0 was lost"):
                channel.receive()
        dist.barrier()
        channel.close()
        dist.destroy_process_group()
    except BaseException as exc:
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def test_a_step_the_channel_lost_stops_the_rank_instead_of_running_the_next():
    """A rank that missed a step would apply the next to a batch that no longer matches rank 0's, and its
    collectives would differ in size (NCCL: a hang or wrong results): each step is numbered, a gap is an error."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    procs = [ctx.Process(target=_channel_ranks, args=(r, port, failures)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.terminate()
    errors = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert not errors and all(p.exitcode == 0 for p in procs), (errors, [p.exitcode for p in procs])
