"""The collectives brisk runs, all over torch.distributed's default group (the whole world).

Every rank calls them in the same order with tensors of the same shapes: NCCL on GPUs, gloo on CPUs.
Row counts that differ between ranks (attention data parallel) are known to every rank from the step
message, so variable-size exchanges pad to the largest count instead of exchanging sizes first.
Host-side values (the step channel's address, the KV pool size) go over a gloo group, a separate one when
the tensors live on GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks, in place."""
    dist.all_reduce(x)
    return x


def gathers_into_one_tensor() -> bool:
    """Whether the backend gathers and reduce-scatters into one flat tensor (NCCL: no per-rank buffers to allocate
    and concatenate afterwards); gloo takes the list forms, which every torch version brisk supports has for it."""
    return dist.get_backend() != "gloo"


def all_gather_last_dim(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Concatenate every rank's x along the last dim (vocab-parallel logits)."""
    x = x.contiguous()
    if not gathers_into_one_tensor():
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)
    out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))  # ranks one after another along dim 0
    dist.all_gather_into_tensor(out, x)
    return out.view(world_size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], world_size * x.shape[-1])


def all_gather_rows(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[counts[rank], ...] on each rank -> [sum(counts), ...], rank 0's rows first. Equal counts (attention-DP
    steps on the static buffers, every rank padded to one size) exchange the rows as they are."""
    width = max(counts)
    padded = x
    if x.shape[0] != width:
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
    padded = padded.contiguous()
    if gathers_into_one_tensor():
        out = padded.new_empty((len(counts) * width, *padded.shape[1:]))
        dist.all_gather_into_tensor(out, padded)
        if min(counts) == width:
            return out
        parts = out.split(width)
    else:
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def reduce_scatter_rows(x: torch.Tensor, counts: list[int], rank: int) -> torch.Tensor:
    """The inverse of all_gather_rows for partial sums: x [sum(counts), ...] on every rank -> this rank's
    counts[rank] rows of the sum over ranks."""
    width = max(counts)
    if min(counts) == width:  # the rows already lie rank by rank at the common width
        padded = x.contiguous()
    else:
        padded = x.new_zeros((len(counts) * width, *x.shape[1:]))
        offset = 0
        for r, n in enumerate(counts):
            padded[r * width : r * width + n] = x[offset : offset + n]
            offset += n
    if not gathers_into_one_tensor():  # gloo (in older torch) has no reduce-scatter: reduce all, keep our slice
        dist.all_reduce(padded)
        return padded[rank * width : rank * width + counts[rank]].clone()
    out = x.new_empty((width, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, padded)
    return out[: counts[rank]]


def broadcast_bytes(payload: bytes | None, group: dist.ProcessGroup | None) -> bytes:
    """Rank 0 sends `payload` to every rank of `group` (a gloo group); the others pass None and get it."""
    size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    if payload:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:  # the receivers, and an empty payload (frombuffer refuses empty buffers)
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    if buffer.numel():
        dist.broadcast(buffer, src=0, group=group)
    return buffer.numpy().tobytes()


def agree_min(value: int, group: dist.ProcessGroup | None) -> int:
    """The smallest of every rank's value (e.g. how many KV blocks fit on every rank)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def abort_if_nccl() -> bool:
    """After a step that failed half-way: abort the default group where it is NCCL (True). Destroying it would
    first wait for the step's queued collectives, which the killed peers never join (about 10 minutes, until the
    watchdog aborts the whole process and the step's error is lost). gloo's collectives fail without peers: it is
    left to be destroyed as usual (False)."""
    if dist.get_backend() != "nccl":
        return False
    dist.distributed_c10d._abort_process_group()
    return True
