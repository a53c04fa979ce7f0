"""Rank 0 -> every other rank: each step's inputs, over a ZeroMQ PUB/SUB socket.

Why not a torch.distributed broadcast: benchmarks/bench_step_broadcast.py (docs/performance.md) measured a
gloo broadcast at ~0.6 ms per step even for a 100-byte decode step, because every rank synchronises on it;
a publish returns at once and each rank takes the message when it reaches the next step (the collectives
inside the forward keep the ranks in lock step anyway). One node: an IPC socket in a private directory;
a launcher-started job (several nodes): TCP on rank 0's MASTER_ADDR, which must be a private network.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import zmq

from brisk.distributed.comm import broadcast_bytes

HELLO, STEP, STOP = b"h", b"s", b"x"
HANDSHAKE_POLL_MS = 10


class StepChannel:
    """Every rank constructs it at the same point (it runs collectives on `cpu_group`)."""

    def __init__(self, rank: int, cpu_group: dist.ProcessGroup | None, over_tcp: bool) -> None:
        self._ctx = zmq.Context()
        self._ipc_dir = None
        self._sequence = 0  # steps published (rank 0) or received (the others)
        endpoint = None
        if rank == 0:
            self._socket = self._ctx.socket(zmq.PUB)
            self._socket.setsockopt(zmq.SNDHWM, 0)  # PUB drops messages past its high-water mark: none
            if over_tcp:
                self._socket.bind("tcp://*:*")
                port = self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
                endpoint = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}"
            else:
                self._ipc_dir = tempfile.mkdtemp(prefix="brisk-steps-")
                os.chmod(self._ipc_dir, 0o700)
                endpoint = f"ipc://{self._ipc_dir}/steps"
                self._socket.bind(endpoint)
        endpoint = broadcast_bytes(endpoint.encode() if endpoint is not None else None, cpu_group).decode()
        if rank != 0:
            self._socket = self._ctx.socket(zmq.SUB)
            self._socket.setsockopt(zmq.RCVHWM, 0)
            self._socket.connect(endpoint)
            self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        # A subscription reaches the publisher some time after connect(), and PUB drops what it sends before:
        # repeat a hello until every rank has heard one.
        while True:
            if rank == 0:
                self._socket.send(HELLO)
            heard = torch.tensor([1 if rank == 0 else int(self._socket.poll(HANDSHAKE_POLL_MS) > 0)])
            dist.all_reduce(heard, op=dist.ReduceOp.MIN, group=cpu_group)
            if heard.item():
                break

    def publish(self, payload: bytes) -> None:
        self._sequence += 1
        self._socket.send_multipart([STEP, self._sequence.to_bytes(8, "little"), payload], copy=False)

    def publish_stop(self) -> None:
        self._socket.send(STOP)

    def receive(self) -> memoryview | None:
        """The next step's payload; None when rank 0 stops the job. A step missed is an error: ZeroMQ drops what rank
        0 publishes while a subscriber's TCP connection is down (and reconnects silently), and a rank that went on
        from a later step would issue collectives of other sizes than its peers (NCCL does not check them: a hang or
        wrong results)."""
        while True:
            frames = self._socket.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == STEP:
                sequence = int.from_bytes(frames[1].bytes, "little")
                if sequence != self._sequence + 1:
                    raise RuntimeError(f"step {self._sequence + 1} from rank 0 was lost (step {sequence} came next)")
                self._sequence = sequence
                return frames[2].buffer
            if kind == STOP:
                return None
            # a leftover HELLO from the handshake

    def close(self) -> None:
        self._ctx.destroy(linger=0)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
