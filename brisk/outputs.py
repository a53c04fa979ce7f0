"""What the offline API returns (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Logprob(NamedTuple):
    """A prompt token's logprob and its rank in the distribution (1: the most likely), as vLLM reports them."""

    logprob: float
    rank: int


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # Per output token: {token id: logprob} holding the sampled token and the top-k alternatives.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # prompt_logprobs: per prompt token, None for the first (nothing predicts it), then {token id: Logprob} holding
    # the prompt token and the top-k alternatives (ranks 1..k). None unless asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    scheduled_time: float = 0.0  # time.time() when the engine first scheduled it (0: not yet); for metrics

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
