"""The proposers' registry: the one `speculative_config` names (NGram: prompt lookup; Eagle3: a draft head)."""

from __future__ import annotations

import torch

from brisk.config import EngineConfig
from brisk.model_config import ModelConfig
from brisk.spec_decode.eagle import make_eagle_proposer
from brisk.spec_decode.ngram import NgramProposer
from brisk.spec_decode.proposer import Proposer


def make_proposer(config: EngineConfig, model_config: ModelConfig, model: torch.nn.Module) -> Proposer | None:
    """The proposer `config.speculative_config` asks for (None: no speculation)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.decoding_type == "NGram":
        return NgramProposer(spec.max_draft_len, spec.prompt_lookup_min, spec.max_matching_ngram_size)
    return make_eagle_proposer(config, model_config, model)
