"""The seam between the engine core and the model side: what a step asks for, and what it produced.

`SchedulerOutput` carries everything a model runner needs and nothing it can derive itself: a request's prompt,
sampling parameters and block ids the first time it is scheduled, and afterwards only what changed (new block ids,
how many tokens to compute, whether it resumes after a preemption). Every rank (tensor, expert, attention-data
parallel) receives the same message and keeps its own persistent batch from it. `ModelRunnerOutput` comes back:
the token sampled for each request whose known tokens the step reached, their logprobs, and the requests whose
logits were not finite. Both are msgspec structs: they cross the process boundary to the other ranks unchanged.
"""

from __future__ import annotations

import enum

import msgspec

from brisk.kv_cache.host_tier import KVBlockCopy
from brisk.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a completion ended; the OpenAI API's strings ("error": the model produced non-finite logits). A str,
    so it compares, prints and serialises as that string."""

    def __str__(self) -> str:
        return self.value

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class NewRequestData(msgspec.Struct, array_like=True):
    """A request scheduled for the first time (or again after a preemption: then `token_ids` holds its outputs
    too, and `resumed` is set)."""

    req_id: str
    token_ids: list[int]  # every token known now: the prompt, plus the outputs of a resumed request
    params: SamplingParams
    seed: int | None  # the request's own generator; None: the shared one
    block_ids: list[list[int]]  # per KV group
    num_computed_tokens: int  # a prefix-cache hit
    num_output_tokens: int = 0  # outputs already produced (a resumed request): min_tokens counts them
    resumed: bool = False  # back after a preemption: the runner kept its generator


class CachedRequestData(msgspec.Struct, array_like=True):
    """Scheduled requests the runner already holds and whose block tables grew; the runner advances every
    request's computed tokens itself, by what it computes."""

    req_ids: list[str] = []
    new_block_ids: list[list[list[int]]] = []  # per request, per KV group: blocks appended since the last step


class SchedulerOutput(msgspec.Struct):
    new_requests: list[NewRequestData] = []
    cached_requests: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = {}  # tokens to compute this step, per scheduled request
    total_num_scheduled_tokens: int = 0
    # The requests whose known tokens this step reaches, so it samples their next one (in scheduling order).
    sampled_req_ids: list[str] = []
    needs_logprobs: bool = False  # some sampled request asked for logprobs (attention DP gathers them)
    # Some request computes prompt positions whose logprobs it asked for (prompt_logprobs): the runner takes the
    # logits of those positions too. False: the step costs nothing more.
    needs_prompt_logprobs: bool = False
    # Prefill-only requests (max_tokens 0) whose prompt this step completes: they end after it, sampling nothing.
    prefill_done_req_ids: list[str] = []
    # Speculative decoding: per request, the draft tokens this step verifies; they follow the request's next token
    # (its num_scheduled_tokens counts 1 + len(drafts)).
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Requests the runner forgets (finished, aborted) or drops from its batch until they resume (preempted).
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    # Structured outputs: the sampled requests whose grammar restricts their next token, and one token bitmask
    # row each (int32 words, bit t of the row set: token t allowed; brisk.structured.engine), in that order.
    grammar_req_ids: list[str] = []
    grammar_bitmask: bytes = b""
    # With drafts, a request has a row per verified position: the position (0 = its next token) of each row.
    grammar_positions: list[int] = []  # empty: every row is position 0
    # Host KV tier: blocks copied between the device pool and host memory before this step's forward, in this order
    # (evictions to host, host hits back to fresh device blocks; kv_cache/host_tier.py).
    kv_block_copies: list[KVBlockCopy] = []

    def __bool__(self) -> bool:
        return self.total_num_scheduled_tokens > 0

    @property
    def num_tokens(self) -> int:
        return self.total_num_scheduled_tokens

    @property
    def num_sampled_requests(self) -> int:
        return len(self.sampled_req_ids)


class TokenLogprobs(msgspec.Struct, array_like=True):
    logprob: float  # of the sampled token
    top: list[tuple[int, float]]  # the top-k alternatives, best first


class PromptLogprobs(msgspec.Struct, array_like=True):
    """One step's prompt logprobs of one request: entry i is prompt token `start + i + 1`'s, given the tokens
    before it (prompt token 0 has none). Chunked prefill: each chunk's entries follow the last one's."""

    start: int
    logprobs: list[float]  # of the prompt token itself
    ranks: list[int]  # its rank in the distribution (1: the most likely)
    top: list[list[tuple[int, float]]]  # the top-k alternatives, best first


class ModelRunnerOutput(msgspec.Struct):
    req_ids: list[str] = []  # the requests that sampled, in row order
    # Per row, the tokens the step produced: one without speculation, 1..k+1 with it (the accepted drafts and
    # the target's own next token). Code that takes them loops over them, never assumes one.
    sampled_token_ids: list[list[int]] = []
    # Per row when some row asked for logprobs: one entry per token of sampled_token_ids (None: not asked).
    logprobs: list[list[TokenLogprobs] | None] | None = None
    failed_req_ids: list[str] = []  # non-finite logits: their token is dropped, the request ends with "error"
    prompt_logprobs: dict[str, PromptLogprobs] | None = None  # per request whose prompt positions this step computed
    # Speculative decoding: per row, the drafts proposed for the request's next step (empty: none).
    spec_token_ids: list[list[int]] | None = None


def roll_back_drafts(num_computed: int, num_drafts: int, num_accepted: int, lookahead: int) -> tuple[int, int]:
    """A request after a step verified its drafts: the rejected drafts' positions are no longer computed, and its
    KV keeps the slots of its computed tokens plus its drafter's lookahead (blocks past them are freed). Returns
    (computed tokens, KV slots kept). The scheduler's books and each rank's persistent batch roll back by this."""
    computed = num_computed - (num_drafts - num_accepted)
    return computed, computed + lookahead
