"""Weight and KV-cache memory per rank for a model under each parallel layout, from its config alone.

    python tools/memory_per_rank.py ../shared/models/gpt-oss-120b --tp 1,2,4,8

The model is built on the meta device with each layout's rank-0 shard (the same code that loads real
weights), so the weight figures are exact parameter bytes, not estimates. KV bytes are per token of
of context held by that rank: brisk's KV blocks hold one layer group each (full or sliding attention), so a
long context costs the layers of the largest group per token, while sliding layers stop at their window.
"""

from __future__ import annotations

import argparse

import torch

from brisk.model_config import ModelConfig, ParallelConfig
from brisk.model_runner.interface import kv_groups_for
from brisk.model_runner.loader import load_model

GIB = 1 << 30


def rank_bytes(model_config: ModelConfig, parallel: ParallelConfig) -> tuple[int, int]:
    """(weight bytes, KV bytes per token of full-attention context) on rank 0 of this layout."""
    model = load_model(model_config, load_format="dummy", device="meta", parallel=parallel)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_heads = next(m for m in model.modules() if hasattr(m, "num_kv_heads") and hasattr(m, "k_cache")).num_kv_heads
    elt = torch.empty((), dtype=model_config.dtype).element_size()
    layers_per_block = max(len(g.layer_ids) for g in kv_groups_for(model_config))
    kv_per_token = layers_per_block * 2 * kv_heads * model_config.head_dim * elt
    return weights, kv_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a directory with config.json")
    parser.add_argument("--tp", default="1,2,4,8", help="comma-separated tp_size values")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory per GPU, for the KV room column")
    parser.add_argument("--fraction", type=float, default=0.9, help="kv_cache_free_gpu_memory_fraction")
    args = parser.parse_args()
    mc = ModelConfig.from_pretrained(args.model, "bfloat16", "cuda")
    print(
        f"{mc.architecture}: {mc.num_layers} layers, {mc.num_heads} heads / {mc.num_kv_heads} KV heads, "
        f"bf16 activations and KV cache"
    )
    header = (
        f"| layout | weights / rank (GiB) | KV / token / rank (KiB) | KV tokens / rank in {args.gpu_gib:g} GiB "
        f"x {args.fraction:g} |"
    )
    print(header)
    print("|" + "---|" * 4)
    for tp in (int(t) for t in args.tp.split(",")):
        layouts = [
            ("tp", ParallelConfig.for_rank(0, tp)),
            ("tp+ep", ParallelConfig.for_rank(0, tp, ep_size=tp)),
            ("attention-dp+ep", ParallelConfig.for_rank(0, tp, ep_size=tp, attention_dp=True)),
        ]
        for name, parallel in layouts if tp > 1 else layouts[:1]:
            weights, kv = rank_bytes(mc, parallel)
            room = max(0.0, args.gpu_gib * GIB - weights) * args.fraction
            print(f"| {name} {tp} | {weights / GIB:.2f} | {kv / 1024:.1f} | {int(room // kv):,} |")
    print(
        "(KV room = (GPU memory - weights) x fraction, an upper bound: activations and the CUDA context come out of it)"
    )


if __name__ == "__main__":
    main()
