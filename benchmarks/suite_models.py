"""Model folders for benchmarks/gpu_suite.py: gpt-oss configs with random (`--load_format dummy`) weights.

The configs of gpt-oss-20b and -120b travel with the repository (benchmarks/gpt_oss_configs/, copied from the
Hugging Face repos), so the suite needs no hub and no ../shared on an air-gapped GPU box. The tokenizer is a
synthetic word-level one with exactly the model's vocabulary: the words `brisk bench serve` builds its prompts
from, then "t<id>" (unknown words -> the first word). Random weights make any real text meaningless; this one needs
no file, encodes and decodes every id, counts prompt tokens exactly, and keeps the benchmark's random prompts
distinct (no accidental prefix-cache hits). The smoke model is gpt-oss at toy sizes for the CPU (sliding and full
layers, sinks, top-k experts); its experts are bf16, so that phase d's transformers baseline runs it on a CPU
without an MXFP4 kernel package. (This suite found the CPU kernels' sigmoid turning large negative gates of random
MXFP4 experts into NaN; fixed, and tested in tests/test_models.py.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parent / "gpt_oss_configs"
GPT_OSS_MODELS = ("gpt-oss-20b", "gpt-oss-120b")
TINY_NAME = "tiny-gpt-oss"
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=64,  # a multiple of 32: MXFP4 blocks
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    experts_per_token=2,
    vocab_size=512,
    sliding_window=8,
    max_position_embeddings=4096,
    layer_types=["sliding_attention", "full_attention"],
    pad_token_id=1,
    eos_token_id=2,
)


def model_config(name: str) -> dict[str, Any]:
    """The HF config.json of gpt-oss-20b / -120b, or of the toy smoke model."""
    if name == TINY_NAME:
        config = json.loads((CONFIGS / "gpt-oss-20b" / "config.json").read_text())
        config.update(TINY_SHAPE)
        del config["quantization_config"]
        config["rope_scaling"] = dict(config["rope_scaling"], original_max_position_embeddings=128)
        return config
    return json.loads((CONFIGS / name / "config.json").read_text())


def write_model_dir(name: str, root: str | os.PathLike) -> str:
    """A folder brisk (and transformers) can open with `load_format dummy`: config, generation config, tokenizer."""
    path = Path(root) / name
    if (path / "tokenizer.json").exists():
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model_config(name)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if name == TINY_NAME:
        generation = {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]}
        (path / "generation_config.json").write_text(json.dumps(generation))
    else:
        shutil.copy(CONFIGS / name / "generation_config.json", path / "generation_config.json")
    write_word_tokenizer(path, config["vocab_size"])
    return str(path)


def write_word_tokenizer(path: str | os.PathLike, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from brisk.bench.workload import WORDS

    words = list(dict.fromkeys(WORDS))[:vocab_size]
    vocab = {word: i for i, word in enumerate(words)}
    vocab.update({f"t{i}": i for i in range(len(words), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0])
    tokenizer.save_pretrained(str(path))
