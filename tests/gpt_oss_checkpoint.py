"""Random gpt-oss checkpoints at the real shapes, in the public MXFP4 layout, written without building a model.

`write_gpt_oss_checkpoint(path, num_layers=...)` writes the shared gpt-oss-20b config (hidden 2,880, 32 experts of
2,880, 64 / 8 heads of 64, 201,088 tokens; `num_layers` of its 24), the real o200k_harmony tokenizer and chat
template (tests/harmony_tokenizer.py) and safetensors shards named and laid out as openai/gpt-oss-20b's:
bf16 attention, router, norms, sinks, embedding and LM head, experts as MXFP4 `*_blocks` uint8 [E, out, in/32, 16]
and `*_scales` uint8 [E, out, in/32] with bf16 biases. The values are spread like brisk's dummy weights
(brisk/model_runner/loader.py): normal(0, 0.02), norms 1, random E2M1 codes under scales 2^-9 .. 2^-6. One shard
per layer plus one each for the embedding and the LM head, so writing and loading never hold the whole checkpoint.

The 24-layer model is what benchmarks/gpt_oss_20b_cpu.py serves (about 13 GB); tests write one or two layers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from brisk.model_runner.loader import DUMMY_MXFP4_SCALE_RANGE, DUMMY_STD, INDEX_FILE
from tests.harmony_tokenizer import MODEL_DIR, make_gpt_oss_tokenizer

MODEL_FILES = ("chat_template.jinja", "generation_config.json", "special_tokens_map.json")


def gpt_oss_config(num_layers: int) -> dict:
    """The shared gpt-oss-20b config cut to its first `num_layers` layers."""
    config = json.loads((MODEL_DIR / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    config["layer_types"] = config["layer_types"][:num_layers]
    return config


def layer_tensors(
    config: dict, layer: int, gen: torch.Generator, blocks: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of one decoder layer, as the public checkpoint names and lays them out. `blocks`:
    each projection's random expert blocks, drawn for the first layer; later layers XOR them with a byte of their
    own (other codes everywhere, at memory speed: drawing 10 GB of bytes one by one took minutes)."""
    h, heads, kv_heads, d = (
        config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    experts, inter = config["num_local_experts"], config["intermediate_size"]
    prefix = f"model.layers.{layer}"
    shapes = {
        "self_attn.q_proj": (heads * d, h),
        "self_attn.k_proj": (kv_heads * d, h),
        "self_attn.v_proj": (kv_heads * d, h),
        "self_attn.o_proj": (h, heads * d),
        "mlp.router": (experts, h),
    }
    for name, shape in shapes.items():
        yield f"{prefix}.{name}.weight", normal(shape, gen)
        yield f"{prefix}.{name}.bias", normal(shape[:1], gen)
    yield f"{prefix}.self_attn.sinks", normal((heads,), gen)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        yield f"{prefix}.{norm}.weight", torch.ones(h, dtype=torch.bfloat16)
    for proj, (out, inp) in (("gate_up_proj", (2 * inter, h)), ("down_proj", (h, inter))):
        name = f"{prefix}.mlp.experts.{proj}"
        if proj not in blocks:
            blocks[proj] = torch.randint(0, 256, (experts, out, inp // 32, 16), dtype=torch.uint8, generator=gen)
        yield f"{name}_blocks", blocks[proj] ^ (layer * 73 % 256)
        low, high = DUMMY_MXFP4_SCALE_RANGE
        yield (
            f"{name}_scales",
            torch.randint(low, high + 1, (experts, out, inp // 32), dtype=torch.uint8, generator=gen),
        )
        yield f"{name}_bias", normal((experts, out), gen)


TILE_ROWS = 4096


def normal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """normal(0, DUMMY_STD) in bf16. Past TILE_ROWS rows (the embedding and the LM head: 201,088), a random tile of
    rows repeats, each row times its own random factor in [0.5, 1.5): every row differs, at a fraction of the
    time of drawing 579 M values one by one (torch's CPU generator is sequential)."""
    if len(shape) < 2 or shape[0] <= TILE_ROWS:
        return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, DUMMY_STD, generator=gen)
    tile = normal((TILE_ROWS, *shape[1:]), gen)
    factors = torch.rand(shape[0], generator=gen).add_(0.5).to(torch.bfloat16)
    repeats = -(-shape[0] // TILE_ROWS)
    return tile.repeat(repeats, *([1] * (len(shape) - 1)))[: shape[0]].mul_(factors.view(-1, *([1] * (len(shape) - 1))))


def write_gpt_oss_checkpoint(path: str | Path, num_layers: int = 24, seed: int = 0) -> Path:
    """Write the checkpoint into `path` (see the module doc) unless a finished one is there; returns the path."""
    from safetensors.torch import save_file

    path = Path(path)
    if (path / INDEX_FILE).is_file():  # written last: a finished checkpoint
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = gpt_oss_config(num_layers)
    gen = torch.Generator().manual_seed(seed)
    h, vocab = config["hidden_size"], config["vocab_size"]
    weight_map: dict[str, str] = {}
    expert_blocks: dict[str, torch.Tensor] = {}
    total = 0

    def write(shard: str, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        nonlocal total
        file = f"model-{shard}.safetensors"
        named = dict(tensors)
        save_file(named, str(path / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in named.values())
        weight_map.update(dict.fromkeys(named, file))

    write("embed", iter([("model.embed_tokens.weight", normal((vocab, h), gen))]))
    for layer in range(num_layers):
        write(f"layer{layer:02d}", layer_tensors(config, layer, gen, expert_blocks))
    final = [("model.norm.weight", torch.ones(h, dtype=torch.bfloat16)), ("lm_head.weight", normal((vocab, h), gen))]
    write("head", iter(final))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in MODEL_FILES:
        shutil.copy(MODEL_DIR / name, path / name)
    make_gpt_oss_tokenizer(path)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return path
