"""The host KV tier's block copies at a real model's KV layout: time a step's copies of scattered blocks, both ways.

    python benchmarks/bench_kv_block_copies.py [--config benchmarks/gpt_oss_configs/gpt-oss-120b] [--blocks 16 64]
                                               [--block-size 32] [--tp-size 1] [--repeats 5] [--device auto]
                                               [--staged]
                                               [--out bench_results/kv_block_copies.json]

One rank's KV tensors of the config (every layer's K and V: [pool blocks, block size, KV heads / tp, head dim] in
bf16) and a host tier (kv_offload.HostKVCache) on --device. A step copies --blocks blocks out to the host and
--blocks back, none adjacent to another on either side (blocks taken from LRU queues are scattered). Two ways in
the same run, on the same tensors:
- `brisk`: HostKVCache.start; on a GPU, batches through a staging buffer (a gather or scatter per KV tensor, one
  transfer per run of host blocks); on a CPU, each block's bytes straight between the two; --staged forces the
  GPU's way on a CPU;
- `per_tensor`: one copy per block and KV tensor (the way before), into per-tensor host tensors of the same size.
Per way and block count: the host's time to issue the copies (what a step's preparation pays) and the time until
they are done (on a GPU: the copy stream synchronised), per block, and the bytes per second moved. Best of
--repeats. Prints a table and writes it as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from brisk.kv_cache.host_tier import KVBlockCopy  # noqa: E402
from brisk.model_config import ModelConfig  # noqa: E402
from brisk.model_runner.kv_offload import HostKVCache  # noqa: E402


def kv_tensors(config: ModelConfig, pool_blocks: int, block_size: int, tp: int, device: torch.device) -> list:
    heads = max(1, config.num_kv_heads // tp)
    shape = (pool_blocks, block_size, heads, config.head_dim)
    return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(2 * config.num_layers)]


def scattered_copies(n: int, seed: int) -> tuple[list[KVBlockCopy], list[KVBlockCopy]]:
    """n blocks out (device 2i + 1 -> host 2j) and n back (host 2j -> device 2i), in shuffled order: no two
    consecutive on either side."""
    rng = random.Random(seed)
    device_ids, host_ids = [2 * i + 1 for i in range(n)], [2 * j for j in range(n)]
    rng.shuffle(device_ids)
    rng.shuffle(host_ids)
    out = [KVBlockCopy(True, d, h) for d, h in zip(device_ids, host_ids)]
    back = [KVBlockCopy(False, d - 1, h) for d, h in zip(device_ids, host_ids)]
    return out, back


class PerTensorCopies(HostKVCache):
    """The way before: per-tensor host tensors, one copy per block and tensor (HostKVCache's stream and order)."""

    def __init__(self, device_tensors: list[torch.Tensor], num_host_blocks: int, device: torch.device) -> None:
        super().__init__(device_tensors, 1, device)  # its own host blocks below
        self.device_tensors = device_tensors
        pin = device.type == "cuda"
        self.host_tensors = [
            torch.empty((num_host_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in device_tensors
        ]

    def _copy(self, copies: list[KVBlockCopy]) -> None:
        for c in copies:
            for device_tensor, host_tensor in zip(self.device_tensors, self.host_tensors):
                if c.to_host:
                    host_tensor[c.host_block].copy_(device_tensor[c.device_block], non_blocking=True)
                else:
                    device_tensor[c.device_block].copy_(host_tensor[c.host_block], non_blocking=True)


def time_copies(tier, copies: list[KVBlockCopy], repeats: int) -> tuple[float, float]:
    """Best issue time and best done time, in seconds."""
    issue, done = [], []
    for _ in range(repeats):
        if tier.stream is not None:
            torch.cuda.synchronize()
        start = time.perf_counter()
        tier.start(copies)
        issued = time.perf_counter()
        if tier.stream is not None:
            tier.stream.synchronize()
        finished = time.perf_counter()
        issue.append(issued - start)
        done.append(finished - start)
    return min(issue), min(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "benchmarks" / "gpt_oss_configs" / "gpt-oss-120b"))
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--staged", action="store_true", help="the GPU's staged way on a CPU too")
    parser.add_argument("--out", default="bench_results/kv_block_copies.json")
    args = parser.parse_args()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    config = ModelConfig.from_pretrained(args.config)
    most = max(args.blocks)
    tensors = kv_tensors(config, 2 * most + 2, args.block_size, args.tp_size, device)
    batched = HostKVCache(tensors, 2 * most, device, staged=True if args.staged else None)
    per_tensor = PerTensorCopies(tensors, 2 * most, device)
    rows = []
    try:
        for n in args.blocks:
            out, back = scattered_copies(n, seed=n)
            for name, tier in (("brisk", batched), ("per_tensor", per_tensor)):
                for direction, copies in (("to_host", out), ("to_device", back)):
                    tier.start(copies)  # warm-up: kernels, the staging buffer, pinned pages touched
                    issue, done = time_copies(tier, copies, args.repeats)
                    moved = n * batched.bytes_per_block
                    rows.append(
                        {
                            "way": name,
                            "direction": direction,
                            "blocks": n,
                            "issue_us_per_block": round(issue / n * 1e6, 2),
                            "done_us_per_block": round(done / n * 1e6, 2),
                            "gb_per_s": round(moved / done / 1e9, 2),
                        }
                    )
    finally:
        batched.close()
        per_tensor.close()
    row_of = {(r["way"], r["direction"], r["blocks"]): r for r in rows}
    ratios = {}
    for n in args.blocks:
        for direction in ("to_host", "to_device"):
            a, b = row_of["brisk", direction, n], row_of["per_tensor", direction, n]
            ratios[f"{direction}_{n}"] = {
                "issue": round(b["issue_us_per_block"] / a["issue_us_per_block"], 2),
                "done": round(b["done_us_per_block"] / a["done_us_per_block"], 2),
            }
    print(
        f"{config.architecture}: {len(tensors)} KV tensors, {batched.bytes_per_block:,} bytes a block "
        f"(block size {args.block_size}, tp {args.tp_size}) on {device}, brisk's way "
        f"{'staged' if batched.staging is not None else 'direct'}"
    )
    print(f"{'way':<11} {'direction':<10} {'blocks':>6} {'issue us/blk':>13} {'done us/blk':>12} {'GB/s':>7}")
    for r in rows:
        print(
            f"{r['way']:<11} {r['direction']:<10} {r['blocks']:>6} {r['issue_us_per_block']:>13} "
            f"{r['done_us_per_block']:>12} {r['gb_per_s']:>7}"
        )
    print("per_tensor / brisk:", json.dumps(ratios))
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.node(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "command": " ".join(sys.argv),
        "kv_tensors": len(tensors),
        "bytes_per_block": batched.bytes_per_block,
        "rows": rows,
        "staged": batched.staging is not None,
        "per_tensor_over_brisk": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
