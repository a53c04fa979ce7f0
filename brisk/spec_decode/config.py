"""`speculative_config`: TensorRT-LLM's keys, and vLLM's `--speculative-config` JSON mapped onto them.

trtllm (YAML options):   speculative_config: {decoding_type: NGram | Eagle3, max_draft_len: 4,
                                              speculative_model_dir: PATH, max_matching_ngram_size: 3}
vLLM (--speculative-config / LLM(speculative_config=...)):
                         {"method": "ngram" | "eagle3", "num_speculative_tokens": 4, "model": PATH,
                          "prompt_lookup_min": 1, "prompt_lookup_max": 3}
Both dialects accept `disable_by_batch_size` (vLLM's key): no drafts while this many requests run or more, and
brisk's `draft_len_after_rejection` (adaptive draft length, below).
A dict is one dialect or the other (mixing them is an error naming the key).

trtllm's other keys, of its releases since 0.19: `decoding_type: Eagle` is Eagle3 (as trtllm's PyTorch backend
runs it); `speculative_model`, `pytorch_weights_path` and `pytorch_eagle_weights_path` are speculative_model_dir;
`prompt_lookup_num_tokens` (NGram) is max_draft_len; `max_concurrency: N` is disable_by_batch_size N + 1 (trtllm
drafts while at most N requests run). Its NGram pool policy (is_keep_all, is_use_oldest, is_public_pool) and
eagle3_one_model have no effect (brisk looks up each request's own tokens; only drafts differ, never the output:
logged); draft trees and schedules are refused unless they describe one chain of max_draft_len tokens.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# vLLM key -> trtllm key
_VLLM_KEYS = {
    "method": "decoding_type",
    "num_speculative_tokens": "max_draft_len",
    "model": "speculative_model_dir",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "max_matching_ngram_size",
    "disable_by_batch_size": "disable_by_batch_size",
    "draft_len_after_rejection": "draft_len_after_rejection",  # brisk's, not vLLM's
}
_VLLM_METHODS = {"ngram": "NGram", "eagle3": "Eagle3"}
_DECODING_TYPES = {"ngram": "NGram", "eagle3": "Eagle3", "eagle": "Eagle3"}  # trtllm's names, case-insensitive here
# trtllm's earlier spellings -> its current key
_TRTLLM_RENAMED = {
    "speculative_model": "speculative_model_dir",
    "pytorch_weights_path": "speculative_model_dir",
    "pytorch_eagle_weights_path": "speculative_model_dir",
    "prompt_lookup_num_tokens": "max_draft_len",
}
_TRTLLM_NO_EFFECT = ("is_keep_all", "is_use_oldest", "is_public_pool", "eagle3_one_model")
# trtllm's draft trees and schedules: accepted where they describe brisk's one chain of max_draft_len tokens
_TRTLLM_CHAIN_ONLY = (
    "num_eagle_layers",
    "max_total_draft_tokens",
    "eagle_choices",
    "use_dynamic_tree",
    "dynamic_tree_max_topK",
    "max_non_leaves_per_layer",
    "draft_len_schedule",
)

logger = logging.getLogger(__name__)


class SpeculativeConfig(BaseModel):
    """How requests speculate. `max_draft_len` (k): draft tokens per request and step; the target verifies
    them with the request's next token in one forward (1 + k query tokens)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    decoding_type: Literal["NGram", "Eagle3"]
    max_draft_len: int = Field(ge=1, le=32)
    speculative_model_dir: str | None = None  # Eagle3: the draft head's checkpoint
    # NGram (prompt lookup): the longest suffix of the request's tokens (at most max_matching_ngram_size, at
    # least prompt_lookup_min) that occurred before; the tokens that followed it are the draft.
    max_matching_ngram_size: int = Field(default=3, ge=1)
    prompt_lookup_min: int = Field(default=1, ge=1)
    # No drafts while this many requests (or more) run: verification costs compute a large batch no longer has
    # spare. None: always speculate.
    disable_by_batch_size: int | None = Field(default=None, ge=1)
    # Adaptive draft length: a request drafts max_draft_len tokens while its drafts are accepted whole, this many
    # after a step that rejected one of them (until a step accepts all its drafts again). Copy-heavy text comes in
    # runs: inside one every draft is accepted, after a miss the next drafts are accepted less often, and each
    # verified token costs compute. None: always max_draft_len.
    draft_len_after_rejection: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _from_either_dialect(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "method" not in data:
            return _from_trtllm(data)
        out: dict[str, Any] = {}
        for key, value in data.items():
            if key == "draft_tensor_parallel_size":
                # brisk splits the draft head over the target's ranks, as the target: a placement, not a result
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"draft_tensor_parallel_size must be a positive integer (got {value!r})")
                continue
            if key not in _VLLM_KEYS:
                raise ValueError(
                    f"'{key}' is not a key of vLLM's speculative config (method, num_speculative_tokens, model, "
                    "prompt_lookup_min, prompt_lookup_max, disable_by_batch_size, draft_tensor_parallel_size, and "
                    "brisk's draft_len_after_rejection); "
                    "trtllm's keys go without 'method'"
                )
            out[_VLLM_KEYS[key]] = value
        method = data["method"]
        if method not in _VLLM_METHODS:
            raise ValueError(f"method {method!r} is not supported; brisk speculates with {sorted(_VLLM_METHODS)}")
        out["decoding_type"] = _VLLM_METHODS[method]
        if "max_draft_len" not in out:
            raise ValueError("num_speculative_tokens is required")
        return out

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeConfig:
        if self.draft_len_after_rejection is not None and self.draft_len_after_rejection > self.max_draft_len:
            raise ValueError(
                f"draft_len_after_rejection ({self.draft_len_after_rejection}) exceeds max_draft_len "
                f"(vLLM: num_speculative_tokens, {self.max_draft_len})"
            )
        if self.decoding_type == "Eagle3" and not self.speculative_model_dir:
            raise ValueError("decoding_type Eagle3 needs speculative_model_dir (vLLM: model), the draft head's path")
        if self.decoding_type == "NGram":
            if self.speculative_model_dir:
                raise ValueError("speculative_model_dir (vLLM: model) means nothing to NGram, which has no model")
            if self.prompt_lookup_min > self.max_matching_ngram_size:
                raise ValueError(
                    f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds max_matching_ngram_size "
                    f"(vLLM: prompt_lookup_max, {self.max_matching_ngram_size})"
                )
        return self


def _from_trtllm(data: dict[str, Any]) -> dict[str, Any]:
    """trtllm's dialect, in any of its releases' spellings, as SpeculativeConfig's fields (module docstring)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = _TRTLLM_RENAMED.get(key, key)
        if name in out and out[name] != value:
            raise ValueError(f"'{key}' and another spelling of '{name}' give different values")
        out[name] = value
    kind = out.get("decoding_type")
    if isinstance(kind, str):
        if kind.lower() not in _DECODING_TYPES:
            raise ValueError(
                f"decoding_type {kind!r}: brisk speculates with NGram (prompt lookup) and Eagle3 draft heads (trtllm's "
                "Eagle runs as Eagle3); MTP, Medusa, Lookahead and draft models are not available"
            )
        out["decoding_type"] = _DECODING_TYPES[kind.lower()]
    ignored = [key for key in _TRTLLM_NO_EFFECT if out.pop(key, None) is not None]
    if ignored:
        logger.info(
            "speculative_config %s: no effect; brisk drafts from each request's own tokens (NGram) or its draft "
            "head (Eagle3), and only the drafts depend on it, never the output",
            ", ".join(ignored),
        )
    chain = out.get("max_draft_len")
    for key in _TRTLLM_CHAIN_ONLY:
        value = out.pop(key, None)
        is_chain = key in ("num_eagle_layers", "max_total_draft_tokens") and value == chain
        if value is not None and value is not False and not is_chain:
            raise ValueError(
                f"{key} {value!r}: brisk drafts one chain of max_draft_len tokens a step (no draft trees or schedules)"
            )
    if "max_concurrency" in out:
        concurrency = out.pop("max_concurrency")
        if concurrency is not None:
            if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
                raise ValueError(f"max_concurrency must be a positive integer (got {concurrency!r})")
            if out.get("disable_by_batch_size", concurrency + 1) != concurrency + 1:
                raise ValueError("max_concurrency and disable_by_batch_size both given: give one of them")
            out["disable_by_batch_size"] = concurrency + 1
    if out.get("load_format") in (None, "auto"):
        out.pop("load_format", None)
    else:
        raise ValueError(
            f"load_format {out['load_format']!r}: the draft head loads from its checkpoint's safetensors (auto)"
        )
    return out
