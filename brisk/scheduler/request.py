"""A request as the engine core sees it: token ids in, token ids out, and how far its KV is computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from brisk.sampling_params import SamplingParams
from brisk.scheduler.output import FinishReason

if TYPE_CHECKING:
    from brisk.structured.state import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str  # unique among the requests in flight (one per completion)
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against max_seq_len
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) and params.stop_token_ids
    arrival_seq: int  # admission order among equal priorities
    # n > 1: a sibling whose prefill this one waits for, so it can adopt the prompt's KV blocks.
    follows: Request | None = None
    dp_rank: int = 0  # attention data parallelism: the rank whose KV pool holds this request
    parent_id: str = ""  # the client's request id ("" : request_id)
    index: int = 0  # which of the parent's n completions
    cache_salt: str | None = None  # prefix-cache blocks are shared only among requests with the same salt
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is computed or being computed by a step in flight
    # Tokens sampled by steps in flight whose ids are not known here yet (overlap scheduling): the next step
    # computes their KV from the device-side sampled ids.
    num_placeholders: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the first admission
    num_preemptions: int = 0
    first_scheduled_time: float = 0.0  # time.time() of its first step (0: not yet), for queue-time metrics
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    grammar: GrammarState | None = None  # structured outputs: compiling, then the matcher of its tokens
    # Speculative decoding: drafts proposed for this request's next step (the scheduler sends them with it).
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._all_token_ids = list(self.prompt_token_ids)
        self.parent_id = self.parent_id or self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def priority_key(self) -> tuple[int, int]:
        return (self.params.priority, self.arrival_seq)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def check_stop(self) -> bool:
        """After a token was appended: set finish_reason if the request is done."""
        last = self.output_token_ids[-1]
        if last in self.stop_token_ids and len(self.output_token_ids) > self.params.min_tokens:
            self.finish_reason = FinishReason.STOP
            self.stop_reason = last if last in self.params.stop_token_ids else None
            return True
        if len(self.output_token_ids) >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False
