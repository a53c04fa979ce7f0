"""Models for the side-by-side CPU comparison (benchmarks/compare_cpu.sh), and its ratio table.

    python benchmarks/make_compare_models.py OUT_DIR            # writes OUT_DIR/{demo,gptoss-bf16,gptoss-fp32}
    python benchmarks/make_compare_models.py --ratios RESULTS   # brisk/peer output tok/s per model and concurrency

Every model shares the demo model's tokenizer and chat template, so all servers see the same prompts. The random
gpt-oss is larger than the demo model (whose matmuls are too small for the engine to matter) but keeps its
architecture: alternating sliding/full attention with sinks, YaRN, 8 experts top-4.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
from pathlib import Path

DEMO_MODEL = Path(__file__).resolve().parent.parent / "brisk" / "demo_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
GPTOSS_SHAPE = dict(
    hidden_size=512,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=4,
)


def write_gptoss(path: Path, dtype_name: str, seed: int = 0) -> None:
    """A random gpt-oss in `dtype_name` ("bfloat16" or "float32") with the demo model's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, GptOssConfig

    demo = json.loads((DEMO_MODEL / "config.json").read_text())
    layers = GPTOSS_SHAPE["num_hidden_layers"]
    config = GptOssConfig(
        **GPTOSS_SHAPE,
        vocab_size=demo["vocab_size"],
        bos_token_id=demo["bos_token_id"],
        eos_token_id=demo["eos_token_id"],
        pad_token_id=demo["pad_token_id"],
        max_position_embeddings=demo["max_position_embeddings"],
        sliding_window=demo["sliding_window"],
        rope_parameters=dict(demo["rope_parameters"]),
        tie_word_embeddings=False,
        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
    )
    config.architectures = ["GptOssForCausalLM"]
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    GenerationConfig.from_pretrained(DEMO_MODEL).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_MODEL / name, path / name)


def write_models(out_dir: Path, names: list[str]) -> None:
    """Writes each named model unless its folder already holds one (reruns are cheap)."""
    for name in names:
        path = out_dir / name
        if (path / "config.json").exists():
            continue
        if name == "demo":
            shutil.copytree(DEMO_MODEL, path, dirs_exist_ok=True)
        elif name in ("gptoss-bf16", "gptoss-fp32"):
            write_gptoss(path, "bfloat16" if name.endswith("bf16") else "float32")
        else:
            raise SystemExit(f"unknown model {name!r}: choose from demo, gptoss-bf16, gptoss-fp32")
        print(f"wrote {path}")


def latest_run(folder: str) -> dict | None:
    runs = sorted(glob.glob(os.path.join(folder, "*.json")))
    if not runs:
        return None
    with open(runs[-1]) as f:
        return json.load(f)


def ratio_table(results_dir: str) -> str:
    """One row per (model, peer): brisk's output tok/s divided by the peer's, per concurrency (>1: brisk faster)."""
    lines = []
    for model_dir in sorted(glob.glob(os.path.join(results_dir, "*", ""))):
        model = os.path.basename(model_dir.rstrip("/"))
        brisk = latest_run(os.path.join(model_dir, "brisk"))
        if brisk is None:
            continue
        ours = {p["concurrency"]: p["output_throughput"] for p in brisk["points"]}
        concs = sorted(c for c in ours if c is not None)
        lines.append(f"\n{model}: brisk output tok/s / peer output tok/s (brisk absolute in brackets)")
        lines.append(f"{'peer':<14}" + "".join(f"{f'conc {c}':>22}" for c in concs))
        for peer_dir in sorted(glob.glob(os.path.join(model_dir, "*", ""))):
            peer = os.path.basename(peer_dir.rstrip("/"))
            run = latest_run(peer_dir)
            if peer == "brisk" or run is None:
                continue
            theirs = {p["concurrency"]: p["output_throughput"] for p in run["points"]}
            cells = []
            for c in concs:
                if theirs.get(c):
                    cells.append(f"{ours[c] / theirs[c]:.2f}x ({ours[c]:.0f} vs {theirs[c]:.0f})")
                else:
                    cells.append("-")
            lines.append(f"{peer:<14}" + "".join(f"{cell:>22}" for cell in cells))
    return "\n".join(lines) if lines else f"no brisk results under {results_dir}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", help="folder to write the models into")
    parser.add_argument("--models", default="demo,gptoss-bf16,gptoss-fp32")
    parser.add_argument("--ratios", metavar="RESULTS_DIR", help="print the brisk/peer table and exit")
    args = parser.parse_args()
    if args.ratios:
        print(ratio_table(args.ratios))
    elif args.out_dir:
        write_models(Path(args.out_dir), [m for m in args.models.split(",") if m])
    else:
        parser.error("give OUT_DIR or --ratios RESULTS_DIR")


if __name__ == "__main__":
    main()
