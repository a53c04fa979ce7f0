"""Tiny random Hugging Face checkpoints for tests (not a test module).

`make_tiny_model("llama" | "qwen3" | "gpt_oss", path)` writes config.json, generation_config.json and
model.safetensors (fp32) for a few-layer model; `hf_reference(path)` loads the matching HF model.
With `mxfp4=True` (gpt_oss) the experts are written MXFP4-packed like the real gpt-oss checkpoints, and
the dequantized fp32 twin, the exact reference, goes to `path/reference/`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

REFERENCE_SUBDIR = "reference"
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32

TINY_ARCHS = ("llama", "qwen3", "gpt_oss")


def tiny_config_kwargs(arch: str) -> dict[str, Any]:
    """Fresh (HF mutates rope dicts in place) config kwargs for one tiny architecture."""
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        # Large init: logits far apart, so greedy decoding rarely meets near-ties that rounding could flip.
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return {
            **common,
            "intermediate_size": 128,
            "tie_word_embeddings": True,
            "rope_parameters": dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=128,
            ),
        }
    if arch == "qwen3":
        return {**common, "intermediate_size": 128, "rope_parameters": dict(rope_type="default", rope_theta=1000000.0)}
    if arch == "gpt_oss":
        # Scaled-down real gpt-oss: YaRN like its config (factor = max_pos / original), window 8 so that
        # short prompts cross it, a low swiglu_limit so the clamps actually bite.
        return {
            **common,
            "num_hidden_layers": 4,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "swiglu_limit": 1.5,
            "rope_parameters": dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=8.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=128,
            ),
        }
    raise ValueError(f"unknown tiny arch '{arch}'; choose one of {', '.join(TINY_ARCHS)}")


def tiny_config(arch: str, **overrides: Any):
    from transformers import GptOssConfig, LlamaConfig, Qwen3Config

    kwargs = {**tiny_config_kwargs(arch), **overrides}
    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config, "gpt_oss": GptOssConfig}[arch]
    if arch == "gpt_oss" and "layer_types" not in overrides:
        pattern = ("sliding_attention", "full_attention")
        kwargs["layer_types"] = [pattern[i % 2] for i in range(kwargs["num_hidden_layers"])]
    config = config_class(**kwargs)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def make_tiny_model(
    arch: str, path: str | os.PathLike, *, seed: int = 0, mxfp4: bool = False, **config_overrides: Any
) -> str:
    """Write a tiny random fp32 checkpoint of `arch` to `path`; returns the path as a string."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if mxfp4 and arch != "gpt_oss":
        raise ValueError("mxfp4=True is only for gpt_oss")
    path = Path(path)
    config = tiny_config(arch, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model)
    generation = GenerationConfig(bos_token_id=1, eos_token_id=0, pad_token_id=0)
    if not mxfp4:
        model.save_pretrained(path)
        generation.save_pretrained(path)
        return str(path)

    packed = _quantize_experts(model)  # also replaces the experts by their dequantized values
    model.save_pretrained(path / REFERENCE_SUBDIR)
    generation.save_pretrained(path / REFERENCE_SUBDIR)
    _save_packed_checkpoint(model, packed, path)
    generation.save_pretrained(path)
    return str(path)


def make_tiny_llama_with_tokenizer(path: str | os.PathLike, **config_overrides: Any) -> str:
    """A tiny random Llama plus the tiny BPE tokenizer: what the server-level tests serve."""
    from tests.tiny_tokenizer import make_tiny_tokenizer

    make_tiny_model("llama", path, seed=0, **config_overrides)
    make_tiny_tokenizer(path)
    return str(path)


def hf_reference(path: str | os.PathLike):
    """The fp32 HF model for a tiny checkpoint (the dequantized twin for MXFP4 ones), eager everything."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    source = path / REFERENCE_SUBDIR if (path / REFERENCE_SUBDIR).is_dir() else path
    kwargs: dict[str, Any] = dict(dtype=torch.float32, attn_implementation="eager")
    if AutoConfig.from_pretrained(source).model_type == "gpt_oss":
        kwargs["experts_implementation"] = "eager"  # HF's plain per-expert loop
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs).eval()
    return with_config_swiglu_clamps(model, model.config)


def with_config_swiglu_clamps(module: torch.nn.Module, config: Any) -> torch.nn.Module:
    """`module` with gpt-oss's expert activation clamps taken from `config`, as brisk takes them: transformers
    before 5.2x hard-coded alpha 1.702 and limit 7.0 (the released checkpoints' values) whatever the config said,
    and the tiny gpt-oss sets a low limit so that the clamps bite."""
    for experts in module.modules():
        if type(experts).__name__ == "GptOssExperts":
            experts.alpha = getattr(config, "swiglu_alpha", experts.alpha)
            experts.limit = getattr(config, "swiglu_limit", experts.limit)
    return module


@torch.no_grad()
def _perturb(model: torch.nn.Module) -> None:
    """HF inits norms to 1 and biases to 0; randomise them so a wrongly mapped tensor shows in the logits."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.1 * torch.randn_like(param))
        elif name.endswith("bias"):
            param.copy_(0.1 * torch.randn_like(param))


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]).

    Scale per 32-block: the smallest power of two that maps max|w| into E2M1's range (<= 6); values
    round to the nearest E2M1 code; two codes per byte, the even element in the low nibble.
    """
    *prefix, rows, cols = weight.shape
    groups = weight.float().reshape(*prefix, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = groups.abs().amax(-1)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -127.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    code = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    code = code | ((scaled < 0).long() << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    scales = (exponent + 127).to(torch.uint8)
    return blocks, scales


@torch.no_grad()
def _quantize_experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """MXFP4-pack each layer's experts; write the (HF-)dequantized values back into the model."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = {}
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(experts, proj)  # HF layout [E, in, out]
            blocks, scales = quantize_mxfp4(param.transpose(1, 2))
            param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            packed[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
            packed[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    return packed


def _save_packed_checkpoint(model: torch.nn.Module, packed: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    tensors.update(packed)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
