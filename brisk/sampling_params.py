"""Per-request sampling parameters (vLLM-compatible names and semantics)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Integers cross the process boundary as msgpack int64/uint64; these bounds keep every field encodable.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**64 - 1  # torch generators take uint64 seeds; the API caps seeds lower so seed + i fits


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
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_seq_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per output token (0: sampled token only)
    skip_special_tokens: bool = True
    priority: int = 0  # lower value is served first

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

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
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_INT32:
            raise bad("max_tokens", f"must be in [1, {MAX_INT32}]")
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
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(not -MAX_INT32 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not -MAX_INT32 <= tok <= MAX_INT32:
                    raise ValueError(f"logit_bias key {tok} is not a token id")
                if not math.isfinite(bias):
                    raise ValueError(f"logit_bias for token {tok} must be finite, got {bias!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
