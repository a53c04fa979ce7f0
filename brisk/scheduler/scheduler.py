"""Continuous batching on one invariant: each request's `num_computed_tokens` catches up with `num_tokens`.

Every step hands out a token budget (`max_num_tokens`): running requests first (a decode needs one
token, an unfinished prefill its next chunk), then waiting requests by (priority, arrival) while
blocks and batch slots last. When the pool runs dry a running request is preempted by recompute:
its blocks are freed and it re-enters the waiting queue with `num_computed_tokens = 0` (a prefix-cache
hit may give much of it back). Prefill, chunked prefill, prefix hits and preemption need no other
state than that counter.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from brisk.kv_cache.manager import KVCacheManager
from brisk.scheduler.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's known tokens, so a new token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class TokenOutput:
    """What one step produced for one request (the engine adds logprobs)."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_batch_size: int,
        max_num_tokens: int,
        enable_chunked_prefill: bool,
    ) -> None:
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[Request] = []  # sorted by priority_key
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0

    # ---- queue management ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.priority_key)

    def abort(self, req: Request) -> None:
        if req.is_finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = req.finish_reason or reason
        req.status = RequestStatus.FINISHED
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_tokens
        scheduled: dict[Request, int] = {}

        # 1. Running requests, oldest first; preempt the least important when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = max(self.running, key=lambda r: r.priority_key)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                    i -= 1
                if victim is req:
                    break
            else:
                scheduled[req] = num_new
                budget -= num_new
                i += 1

        # 2. Waiting requests, unless this step already had to preempt (admitting more would thrash).
        if not out.preempted:
            for req in list(self.waiting):
                if budget <= 0 or len(self.running) >= self.max_batch_size:
                    break
                if req.follows is not None and not self._prompt_ready(req.follows):
                    continue
                hit = self.kv.get_computed_blocks(req)
                num_new = req.num_tokens - hit.num_tokens
                if num_new > budget:
                    if not self.enable_chunked_prefill:
                        break
                    num_new = budget
                if not self.kv.allocate_slots(req, num_new, hit):
                    break
                self.waiting.remove(req)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = hit.num_tokens
                req.num_computed_tokens = hit.num_tokens
                req.follows = None
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled[req] = num_new
                budget -= num_new

        out.scheduled = [ScheduledRequest(r, n) for r, n in scheduled.items()]
        return out

    @staticmethod
    def _prompt_ready(leader: Request) -> bool:
        return leader.is_finished or leader.num_computed_tokens >= leader.num_prompt_tokens

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req)

    def update(self, out: SchedulerOutput, sampled: dict[Request, int]) -> list[TokenOutput]:
        """Advance each scheduled request by what was computed and append its sampled token."""
        results = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(req)
            if req not in sampled:
                continue  # a prefill chunk that is not the last
            req.append_output(sampled[req])
            done = req.check_stop()
            if done:
                self._finish(req, req.finish_reason or "stop")
            results.append(TokenOutput(req, [req.output_token_ids[-1]], done))
        return results
