"""Typed messages between the front end (offline LLM or API server) and the engine core.

msgspec Structs, so the same types cross the process boundary (ZMQ) in the server unchanged.
"""

from __future__ import annotations

import msgspec

from brisk.sampling_params import SamplingParams
from brisk.scheduler.output import FinishReason, PromptLogprobs


class EngineCoreRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # vLLM's: the prefix cache shares blocks only among requests of one salt


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives, best first


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    index: int  # which of the n completions
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    scheduled_time: float = 0.0  # time.time() of the first step that scheduled it (0: not yet)
    prompt_logprobs: PromptLogprobs | None = None  # the prompt positions the step computed (prompt_logprobs)
    num_steps: int = 1  # engine steps whose tokens this output carries (several: held for stream_interval)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# ---- over the wire between the API server process and the engine-core process ------------------
class AddRequest(msgspec.Struct, tag=True):
    request: EngineCoreRequest
    client_index: int = 0  # which API-server process sent it: its outputs go back to that process


class AbortRequests(msgspec.Struct, tag=True):
    targets: list[tuple[str, int]]  # (request id, completion index); index -1 aborts all n completions


class ProfileRequest(msgspec.Struct, tag=True):
    action: str  # "start" | "stop"
    trace_path: str = ""  # stop: where the engine writes the Chrome trace JSON


class StopEngine(msgspec.Struct, tag=True):
    """End the engine in order: with ranks on other processes (tensor parallel), they are told to stop, where a
    SIGKILL of rank 0 would leave launcher-started ranks (torchrun, mpirun) waiting for the next step forever."""


def shown_block_sizes(block_sizes: list[int] | tuple[int, ...]) -> str:
    """The tokens a block holds as logs show them: '32', or '64/32' where KV groups differ (largest first)."""
    return "/".join(map(str, sorted(set(block_sizes), reverse=True)))


class EngineInfo(msgspec.Struct, tag=True):
    """Sent once by the engine process when the model is loaded and the KV cache allocated."""

    architecture: str
    vocab_size: int
    max_seq_len: int
    num_kv_blocks: int
    block_sizes: list[int]  # per KV group: the tokens a block holds (they differ where FP8 skips sliding layers)

    @property
    def num_kv_groups(self) -> int:
        return len(self.block_sizes)


class EngineStartupError(msgspec.Struct, tag=True):
    """Sent instead of EngineInfo when the engine cannot start for a reason the user can act on (a ConfigError:
    the KV cache does not fit, a layout the devices cannot run); the API server reports it as one line."""

    message: str


class SchedulerStats(msgspec.Struct, array_like=True, frozen=True):
    """Scheduler and KV gauges for /metrics, sampled after a step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    kv_usage_per_dp_rank: tuple[float, ...] = ()
    iteration_tokens: tuple[int, ...] = ()  # tokens scheduled in each step since the last stats
    # Speculative decoding, cumulative: drafts verified, draft tokens, accepted ones, accepted per draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # Host KV tier (kv_cache_config.host_cache_size), cumulative: prompt tokens looked up with it on, tokens whose
    # KV it gave back, bytes copied to host and back; and the share of its blocks holding content.
    host_queries: int = 0
    host_hits: int = 0
    host_bytes_to_host: int = 0
    host_bytes_to_device: int = 0
    host_usage: float = 0.0


class EngineOutputs(msgspec.Struct, tag=True):
    outputs: list[EngineCoreOutput]
    # (request id, param, message) of each request the core refused: an InvalidRequest on the client's side
    refused: list[tuple[str, str, str]] = []
    stats: SchedulerStats = SchedulerStats()


ToEngine = AddRequest | AbortRequests | ProfileRequest | StopEngine
FromEngine = EngineInfo | EngineStartupError | EngineOutputs
