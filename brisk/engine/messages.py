"""Typed messages between the front end (offline LLM or API server) and the engine core.

msgspec Structs, so the same types cross the process boundary (ZMQ) in the server unchanged.
"""

from __future__ import annotations

import msgspec

from brisk.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives, best first


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    index: int  # which of the n completions
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
