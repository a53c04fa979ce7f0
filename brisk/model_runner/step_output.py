"""A launched step's result: the packed result tensor shared between ranks, its one host copy, and the one builder
of `ModelRunnerOutput`s, for plain and speculative steps alike.

Sharing (`share_packed`): under TP rank 0 sampled and broadcasts its rows; under attention DP every rank sampled
its own and they gather them all. What rank 0 reports beyond the tokens (logprobs, drafts, prompt logprobs) comes
as `RankExtras`, one per attention-DP rank. The tokens (and a sampling step's logprobs, prompt logprobs) stay on
the device until `StepResult.result()` (or, with speculation, the drafter) takes them to the host, through
`host_rows` (brisk.host.HostResult: on a GPU an asynchronous copy started when the step is launched, so the wait is
for that step only).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from brisk.distributed.comm import all_gather_rows
from brisk.host import HostCopy, HostResult
from brisk.model_config import ParallelConfig
from brisk.model_runner.input_batch import RequestState
from brisk.model_runner.sampling_stage import RowLogprobs
from brisk.scheduler.output import ModelRunnerOutput, PromptLogprobs, SchedulerOutput

logger = logging.getLogger(__name__)


class RankExtras(NamedTuple):
    """What one attention-DP rank reports of a step beside its packed rows."""

    # Logprobs and prompt logprobs: on the host, or their copy there started in the step (HostResult)
    logprobs: list[RowLogprobs] | HostResult[list[RowLogprobs]] | None  # per sampled request, when some asked
    drafts: list[list[int]] | None  # speculation: per sampled request, its drafts for the next step
    prompt_logprobs: dict[str, PromptLogprobs] | HostResult[dict[str, PromptLogprobs]] | None

    def on_host(
        self,
    ) -> tuple[list[RowLogprobs] | None, list[list[int]] | None, dict[str, PromptLogprobs] | None]:
        """The same parts, each on the host (waits for the copies)."""
        logprobs, prompt = self.logprobs, self.prompt_logprobs
        return (
            logprobs.get() if isinstance(logprobs, HostResult) else logprobs,
            self.drafts,
            prompt.get() if isinstance(prompt, HostResult) else prompt,
        )


class ExtrasGather:
    """Attention DP: every rank's RankExtras to rank 0, on a thread of its own over a gloo group of its own (the
    thread is the group's one user). The gather needs host objects, so it waits for each rank's own copies: done in
    the step, it would keep every rank from launching the next step before its kernels end (no overlap scheduling
    for logprobs). Every rank submits the same steps in the same order (each decides from every rank's
    SchedulerOutput), so the threads meet gather for gather; rank 0 waits for a step's in `StepResult.result()`."""

    def __init__(self, parallel: ParallelConfig, device: torch.device) -> None:
        self.rank, self.dp_size = parallel.rank, parallel.dp_size
        self.group = dist.new_group(backend="gloo")  # every rank creates it at the same point (the runner's start)
        # CUDA's current device is per thread and 0 on a new one: the thread's first wait for a copy's event would
        # open a second CUDA context, on GPU 0, for every rank of another GPU (~0.5 GiB each, after the KV sizing).
        self._thread = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="brisk-extras-gather",
            initializer=partial(torch.cuda.set_device, device) if device.type == "cuda" else None,
        )

    def submit(self, mine: RankExtras) -> Future[list[RankExtras] | None]:
        future = self._thread.submit(self._gather, mine)
        future.add_done_callback(_log_failure)  # ranks > 0 never read theirs
        return future

    def _gather(self, mine: RankExtras) -> list[RankExtras] | None:
        gathered: list | None = [None] * self.dp_size if self.rank == 0 else None
        dist.gather_object(RankExtras(*mine.on_host()), gathered, dst=0, group=self.group)
        return [RankExtras(*e) for e in gathered] if gathered is not None else None

    def close(self) -> None:
        # Ranks > 0 stop at rank 0's stop message: their last steps' gathers still meet rank 0's, which runs them.
        # Rank 0 closes after the other ranks have exited (their gathers done), or after killing them when a step
        # failed half-way: gathers not yet started are dropped then, having no one to meet.
        self._thread.shutdown(wait=True, cancel_futures=self.rank == 0)


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error(
            "gathering a step's logprobs and drafts from the attention-DP ranks failed: %r", future.exception()
        )


def share_packed(
    packed: torch.Tensor | None,
    width: int,
    num_sampled_all: list[int],
    parallel: ParallelConfig,
    device: torch.device,
) -> torch.Tensor | None:
    """Every rank's view of the step's packed rows: under TP, rank 0's rows (broadcast); under attention DP every
    rank's rows, in DP-rank order (gathered)."""
    if parallel.dp_size > 1:
        if not any(num_sampled_all):
            return None
        mine = packed if packed is not None else torch.zeros(0, width, dtype=torch.int64, device=device)
        return all_gather_rows(mine, num_sampled_all)
    n = num_sampled_all[0]
    if not n:
        return packed
    buf = (
        packed if parallel.rank == 0 and packed is not None else torch.empty(n, width, dtype=torch.int64, device=device)
    )
    dist.broadcast(buf, src=0)
    return buf


def row_tokens(row: list[int], max_draft_len: int) -> list[int]:
    """The output tokens of one packed row on the host (sampling_stage.py's layout)."""
    return row[: row[max_draft_len + 1]] if max_draft_len else row[:1]


def last_tokens(packed: torch.Tensor, max_draft_len: int) -> torch.Tensor:
    """Each row's last output token (the next step's input), on the device."""
    if max_draft_len == 0:
        return packed[:, 0]
    k = max_draft_len
    return packed[:, : k + 1].gather(1, packed[:, k + 1 : k + 2] - 1)[:, 0]


def rows_of_rank(host: list[list[int]], scheds: list[SchedulerOutput], dp_rank: int) -> list[list[int]]:
    """One attention-DP rank's rows of the packed result (under attention DP every rank's are there)."""
    if not host or len(scheds) == 1:
        return host
    offset = sum(s.num_sampled_requests for s in scheds[:dp_rank])
    return host[offset : offset + scheds[dp_rank].num_sampled_requests]


def packed_rows(*packed: torch.Tensor) -> list[list[int]]:
    """The packed rows as host lists (no tensor: no rows)."""
    return packed[0].tolist() if packed else []


def host_rows(packed: torch.Tensor | None, on_host: np.ndarray | None = None) -> HostResult[list[list[int]]]:
    """The packed rows' one copy to the host, started where the packed tensor is final (after the runner's
    last_sampled write); read as lists once. on_host: the same rows, built on the host (no copy back)."""
    if on_host is not None:
        return HostResult(HostCopy((torch.from_numpy(on_host),)), packed_rows)
    return HostResult(HostCopy.start(*(() if packed is None else (packed,))), packed_rows)


class StepResult:
    """A launched step (the runner's StepHandle). The packed rows of every DP rank (rank 0) or of this rank's part
    of the step; `to_host()` is the one device-to-host copy, made once, where a caller asks for it."""

    def __init__(
        self,
        scheds: list[SchedulerOutput],
        packed: HostResult[list[list[int]]],
        max_draft_len: int,
        dp_rank: int,
        extras: list[RankExtras] | Future[list[RankExtras] | None] | None,
        states: dict[str, RequestState],
        host: list[list[int]] | None = None,
        any_needs_history: bool = True,
    ) -> None:
        """packed: the packed rows' copy to the host (started). host: the packed rows already on the host
        (speculation: the drafter recorded them, history too).
        any_needs_history: False when no request of the batch samples with its history (nothing to record)."""
        self._scheds = scheds
        self._packed = packed
        self._k = max_draft_len
        self._dp_rank = dp_rank
        self._extras = extras  # per DP rank, on rank 0 (None elsewhere), or their gather under way (ExtrasGather)
        self._states = states
        self._host = host
        self._history_recorded = host is not None or not any_needs_history
        self._outputs: list[ModelRunnerOutput] | None = None

    def to_host(self) -> list[list[int]]:
        """The packed rows on the host (the step's host synchronisation, done once)."""
        if self._host is None:
            self._host = self._packed.get()
        return self._host

    def record_history(self) -> None:
        """Append this step's tokens to the outputs of the requests that sample with their history."""
        if self._history_recorded:
            return
        self._history_recorded = True
        k = self._k
        sched = self._scheds[self._dp_rank]
        for rid, row in zip(sched.sampled_req_ids, rows_of_rank(self.to_host(), self._scheds, self._dp_rank)):
            state = self._states.get(rid)
            if state is not None and state.needs_history:
                state.output_token_ids.extend(row_tokens(row, k))

    def result(self) -> list[ModelRunnerOutput]:
        if self._outputs is not None:
            return self._outputs
        every_rank = self._extras.result() if isinstance(self._extras, Future) else self._extras
        if every_rank is None:  # a rank other than 0: nothing to report
            self._outputs = []
            return self._outputs
        host = self.to_host()
        self.record_history()
        outputs = []
        offset = 0
        for sched, extras in zip(self._scheds, every_rank):
            n = sched.num_sampled_requests
            out = runner_output(sched.sampled_req_ids, host[offset : offset + n], extras, self._k)
            offset += n
            outputs.append(out)
        self._outputs = outputs
        return outputs


def runner_output(
    req_ids: list[str], rows: list[list[int]], extras: RankExtras, max_draft_len: int
) -> ModelRunnerOutput:
    """One DP rank's ModelRunnerOutput from its packed rows (in sampled order) and extras."""
    k = max_draft_len
    logprobs, drafts, prompt_logprobs = extras.on_host()
    prompt = prompt_logprobs or None
    if logprobs is None and not any([row[-1] for row in rows]):  # the common step: no failure, no logprobs
        tokens = [[row[0]] for row in rows] if k == 0 else [row[: row[k + 1]] for row in rows]
        return ModelRunnerOutput(req_ids, tokens, prompt_logprobs=prompt, spec_token_ids=drafts)
    out = ModelRunnerOutput(
        [], [], [] if logprobs is not None else None, [], prompt, [] if drafts is not None else None
    )
    for j, rid in enumerate(req_ids):
        row = rows[j]
        if row[-1]:
            out.failed_req_ids.append(rid)
            continue
        out.req_ids.append(rid)
        out.sampled_token_ids.append(row_tokens(row, k))
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.append(logprobs[j])
        if out.spec_token_ids is not None and drafts is not None:
            out.spec_token_ids.append(drafts[j])
    return out
