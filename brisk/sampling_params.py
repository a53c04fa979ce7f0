"""Per-request sampling parameters (vLLM-compatible names and semantics)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from brisk.errors import InvalidRequest
from brisk.structured.spec import StructuredOutputs

# Integers cross the process boundary as msgpack int64/uint64; these bounds keep every field encodable.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**64 - 1  # torch generators take uint64 seeds; the API caps seeds lower so seed + i fits
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled (the others' logits -inf)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_seq_len; 0: prefill only (e.g. for prompt_logprobs)
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per output token (0: sampled token only)
    # vLLM's: the alternatives are these token ids' logprobs (in this order), not the likeliest tokens'; logprobs is
    # then their count
    logprob_token_ids: list[int] | None = None
    # Top logprobs per prompt token (0: the prompt token's own only); the prompt is then computed in full (no
    # prefix-cache hit), as its logits are needed.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    priority: int = 0  # lower value is served first
    # output constrained by a grammar (JSON schema, regex, choice, grammar, strict tools); see brisk.structured
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logprob_token_ids is not None and self.logprobs is None:
            self.logprobs = len(self.logprob_token_ids)
        self.validate()

    def check_max_logprobs(self, limit: int) -> None:
        """The engine's max_logprobs (vLLM's --max-logprobs): asking for more is an InvalidRequest naming the field."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if name == "logprobs" and self.logprob_token_ids is not None:
                continue  # chosen ids are bounded by MAX_LOGPROB_TOKEN_IDS, as in vLLM, not by max_logprobs
            if value is not None and value > limit:
                raise InvalidRequest(name, f"{name} {value} is more than this server's max_logprobs ({limit}).")

    def validate(self) -> None:
        """Check each field on its own (ranges, finiteness); raises InvalidRequest naming the field."""

        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(name, f"{name} {why}; got {getattr(self, name)!r}.")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "must be a finite number")
        for name, low, high in (
            ("n", 1, MAX_INT32),
            ("top_k", -1, MAX_INT32),
            ("min_tokens", 0, MAX_INT32),
            ("priority", -MAX_INT32, MAX_INT32),
        ):
            if not low <= getattr(self, name) <= high:
                raise bad(name, f"must be in [{low}, {high}]")
        if self.max_tokens is not None and not 0 <= self.max_tokens <= MAX_INT32:
            raise bad("max_tokens", f"must be in [0, {MAX_INT32}]")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise bad("seed", f"must be in [0, {MAX_SEED}]")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.min_tokens and self.structured_outputs is not None:
            # The grammar decides where the output ends: masking its stop tokens could leave no token allowed.
            raise bad("min_tokens", "cannot be combined with structured outputs (the grammar decides the length)")
        if self.logprob_token_ids is not None:
            if not 1 <= len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS:
                raise InvalidRequest(
                    "logprob_token_ids", f"logprob_token_ids must hold 1 to {MAX_LOGPROB_TOKEN_IDS} token ids."
                )
            if any(not -MAX_INT32 <= t <= MAX_INT32 for t in self.logprob_token_ids):
                raise InvalidRequest("logprob_token_ids", "logprob_token_ids must hold token ids.")
            if self.logprobs != len(self.logprob_token_ids):
                raise InvalidRequest(
                    "logprob_token_ids",
                    f"logprobs ({self.logprobs}) must equal the number of logprob_token_ids "
                    f"({len(self.logprob_token_ids)}) when both are given.",
                )
        elif self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", "must be in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop", "stop strings must be non-empty strings.")
        if any(not -MAX_INT32 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "stop_token_ids must hold token ids.")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequest("allowed_token_ids", "allowed_token_ids must hold at least one token id.")
        if self.allowed_token_ids is not None and self.structured_outputs is not None:
            # Both mask the logits: together they could leave no token to sample.
            raise InvalidRequest("allowed_token_ids", "allowed_token_ids cannot be combined with structured outputs.")
        if any(not -MAX_INT32 <= t <= MAX_INT32 for t in self.allowed_token_ids or ()):
            raise InvalidRequest("allowed_token_ids", "allowed_token_ids must hold token ids.")
        for tok, bias in (self.logit_bias or {}).items():
            if not -MAX_INT32 <= tok <= MAX_INT32:
                raise InvalidRequest("logit_bias", f"logit_bias key {tok} is not a token id.")
            if not math.isfinite(bias):
                raise InvalidRequest("logit_bias", f"logit_bias for token {tok} must be finite; got {bias!r}.")

    def check_for_model(self, prompt_token_ids: Sequence[int], vocab_size: int, max_seq_len: int) -> None:
        """Check the request against the model: every token id in the vocabulary, prompt + output within
        max_seq_len. The one validation path: offline `LLM.generate` and every HTTP endpoint call it before
        the engine sees the request. Raises InvalidRequest naming the field (`prompt` or a field of these
        params)."""
        if not prompt_token_ids:
            raise InvalidRequest("prompt", "The prompt is empty.")
        for name, ids in (
            ("prompt", prompt_token_ids),
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("logprob_token_ids", self.logprob_token_ids or ()),
        ):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    name, f"{name} holds token id {bad}, which is outside the vocabulary [0, {vocab_size})."
                )
        prompt_len = len(prompt_token_ids)
        if prompt_len >= max_seq_len:
            raise InvalidRequest(
                "prompt",
                f"This model's maximum context length is {max_seq_len} tokens, and the prompt has {prompt_len} "
                "tokens, which leaves no room for output.",
                code="context_length_exceeded",
            )
        if self.max_tokens is not None and prompt_len + self.max_tokens > max_seq_len:
            raise InvalidRequest(
                "max_tokens",
                f"This model's maximum context length is {max_seq_len} tokens; the prompt has {prompt_len} tokens "
                f"and max_tokens asks for {self.max_tokens} more (at most {max_seq_len - prompt_len} fit).",
                code="context_length_exceeded",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
