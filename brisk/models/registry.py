"""Maps HF `architectures[0]` names to brisk model classes."""

from __future__ import annotations

from types import MappingProxyType

from brisk.models.gpt_oss import GptOssForCausalLM
from brisk.models.llama import CausalLM, LlamaForCausalLM
from brisk.models.null import BriskNullForCausalLM
from brisk.models.qwen3 import Qwen3ForCausalLM

# What every model class offers the loader and runner beyond nn.Module: forward, compute_logits, load_weights.
BriskModel = CausalLM | BriskNullForCausalLM

_MODEL_CLASSES: MappingProxyType[str, type[BriskModel]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "GptOssForCausalLM": GptOssForCausalLM,
        "BriskNullForCausalLM": BriskNullForCausalLM,
    }
)


def supported_architectures() -> list[str]:
    return sorted(_MODEL_CLASSES)


def get_model_class(architecture: str) -> type[BriskModel]:
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture '{architecture}'; supported: {', '.join(supported_architectures())}"
        ) from None
