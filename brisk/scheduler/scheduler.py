"""Continuous batching on one invariant: each request's `num_computed_tokens` catches up with `num_tokens`.

Every step hands out a token budget (`max_num_tokens`): running requests first (a decode needs one
token, an unfinished prefill its next chunk), then waiting requests by (priority, arrival) while
blocks and batch slots last. When the pool runs dry a running request is preempted by recompute:
its blocks are freed and it re-enters the waiting queue with `num_computed_tokens = 0` (a prefix-cache
hit may give much of it back; with the host KV tier, blocks evicted while it waited come back from host
memory). Prefill, chunked prefill, prefix hits and preemption need no other state than that counter.

Speculative decoding: a decoding request's drafts (`spec_token_ids`, proposed by the runner with the last step's
output) are scheduled as extra query tokens after its next token (1 + k, counted in the budget). After
verification `num_computed_tokens` drops by the rejected drafts and the KV blocks past it are freed
(`_roll_back`); only verified tokens are ever indexed for prefix hits. Drafts need the previous step's tokens on
the host, so such steps run without overlap (`needs_host_tokens`).

Overlap scheduling: `schedule()` advances `num_computed_tokens` at once and counts the token a step will
sample as a placeholder, so step N+1 can be scheduled while step N runs; `update_from_output(N)` later
replaces the placeholder by the sampled token. A request that finishes in step N may thus have been scheduled
in step N+1: that step's token for it is dropped (never output), and its blocks were freed with it.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

from brisk.kv_cache.manager import KVCacheManager, PrefixHit
from brisk.scheduler.output import (
    CachedRequestData,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    roll_back_drafts,
)
from brisk.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)


# What one step produced for one request: (request, new token ids, finished, row of the runner output whose logprobs
# are its, -1 for none). A plain tuple, not a NamedTuple: built for every running request every step, and a
# NamedTuple's constructor costs ~0.2 us more (0.13 ms of a 640-request step).
TokenOutput = tuple[Request, list[int], bool, int]


@dataclass(frozen=True)
class SpecDecodeLimits:
    """What the scheduler needs to know of speculative decoding."""

    max_draft_len: int
    disable_by_batch_size: int | None = None  # no drafts while this many requests run (or more)
    lookahead_slots: int = 0  # KV slots past a request's tokens its drafter writes (see spec_decode/proposer.py)


@dataclass
class SpecDecodeCounters:
    """Cumulative speculation counts (vLLM's metric names): drafts verified, their tokens, the accepted ones,
    and per draft position how often it was accepted."""

    max_draft_len: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.max_draft_len

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_batch_size: int,
        max_num_tokens: int,
        enable_chunked_prefill: bool,
        spec: SpecDecodeLimits | None = None,
        max_prefill_chunk: int = 0,
    ) -> None:
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # vLLM's long_prefill_token_threshold: a prompt's tokens a step at most (0: the budget), so prompts share steps
        self.max_prefill_chunk = max_prefill_chunk or max_num_tokens
        self.waiting: list[Request] = []  # sorted by priority_key
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.num_preemptions = 0
        self._num_finished_running = 0  # finished requests still in `running` (see _finish)
        self._num_sent_blocks: dict[str, list[int]] = {}  # blocks per KV group the runner holds, per running request
        # Finished (the runner held them) or preempted since the last step that ran: the next one tells the runner.
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self.num_constrained = 0  # unfinished requests with a grammar (structured outputs)
        self.spec = spec
        self.spec_stats = SpecDecodeCounters(spec.max_draft_len if spec else 0)

    # ---- queue management ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.num_constrained += req.grammar is not None
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.priority_key)

    def abort(self, req: Request, reason: FinishReason = FinishReason.ABORT) -> None:
        if not req.is_finished:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = req.finish_reason or reason
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.RUNNING:
            self._num_finished_running += 1  # dropped from `running` in one pass, not one list.remove each
        req.status = RequestStatus.FINISHED
        self.num_constrained -= req.grammar is not None
        self.requests.pop(req.request_id, None)
        if self._num_sent_blocks.pop(req.request_id, None) is not None or req.num_preemptions:
            self._finished_ids.append(req.request_id)
        self.kv.free(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) - self._num_finished_running

    def needs_host_tokens(self) -> bool:
        """The next step needs the previous step's tokens on the host before it is scheduled (overlap scheduling
        drains the step in flight first): a grammar's bitmask follows every token its request accepted, and the
        next step's drafts come from the last step's output."""
        return self.num_constrained > 0 or (self.spec is not None and self.num_running > 0)

    @property
    def num_running(self) -> int:
        return len(self.running) - self._num_finished_running

    def _drop_finished_running(self) -> None:
        if self._num_finished_running:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
            self._num_finished_running = 0

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._drop_finished_running()
        budget = self.max_num_tokens
        scheduled: dict[Request, int] = {}
        preempted: list[Request] = []
        allocate_slots = self.kv.allocate_slots
        spec_tokens: dict[Request, list[int]] = {}
        spec = self.spec
        lookahead = spec.lookahead_slots if spec else 0
        speculate = spec is not None and (
            spec.disable_by_batch_size is None or self.num_running < spec.disable_by_batch_size
        )

        # 1. Running requests, oldest first; preempt the least important when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = len(req._all_token_ids) + req.num_placeholders - req.num_computed_tokens
            if num_new > self.max_prefill_chunk:
                num_new = self.max_prefill_chunk
            if num_new > budget:
                num_new = budget
            if num_new <= 0 or (req.max_tokens and len(req.output_token_ids) + req.num_placeholders >= req.max_tokens):
                i += 1  # its last token is being sampled (or its prompt is computed, max_tokens 0): nothing to do
                continue
            drafts = req.spec_token_ids
            if drafts:
                req.spec_token_ids = []
                if num_new == 1 and speculate:  # a decode: its drafts follow, as far as budget and max_tokens allow
                    room = min(budget - 1, req.max_tokens - len(req.output_token_ids) - 1)
                    drafts = drafts[: max(0, room)]
                    if drafts and req.grammar is not None:  # only drafts its grammar allows: the rest would be rejected
                        drafts = req.grammar.valid_prefix(drafts)
                    if drafts:
                        spec_tokens[req] = drafts
                        num_new += len(drafts)
            while not allocate_slots(req, num_new + lookahead):
                victim = max(self.running, key=lambda r: r.priority_key)
                self._preempt(victim)
                preempted.append(victim)
                spec_tokens.pop(victim, None)
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
        new_reqs: list[Request] = []
        if not preempted:
            for req in self.waiting:
                if budget <= 0 or self.num_running >= self.max_batch_size:
                    break
                if req.num_placeholders or (req.follows is not None and not self._prompt_ready(req.follows)):
                    continue  # a preempted request whose last step's token is not known yet; an n > 1 sibling
                if req.grammar is not None and not req.grammar.ready:
                    continue  # its grammar is still compiling
                if req.params.prompt_logprobs is None:
                    hit = self.kv.get_computed_blocks(req)
                else:  # its prompt's logits are wanted: every position is computed
                    hit = PrefixHit(0, [[] for _ in self.kv.groups])
                num_new = min(req.num_tokens - hit.num_tokens, self.max_prefill_chunk)
                if num_new > budget:
                    if not self.enable_chunked_prefill:
                        break
                    num_new = budget
                if not self.kv.allocate_slots(req, num_new + lookahead, hit):
                    break
                if req.num_preemptions == 0:
                    req.num_cached_tokens = hit.num_tokens
                if req.params.prompt_logprobs is None:
                    self.kv.record_prefix_lookup(req, hit)
                req.num_computed_tokens = hit.num_tokens
                req.follows = None
                req.status = RequestStatus.RUNNING
                req.first_scheduled_time = req.first_scheduled_time or time.time()  # queue-time metric
                self.running.append(req)
                scheduled[req] = num_new
                new_reqs.append(req)
                budget -= num_new
            if new_reqs:  # one pass, not one list.remove per admitted request
                admitted = set(new_reqs)
                self.waiting = [r for r in self.waiting if r not in admitted]
        return self._build_output(scheduled, new_reqs, preempted, spec_tokens)

    def _build_output(
        self,
        scheduled: dict[Request, int],
        new_reqs: list[Request],
        preempted: list[Request],
        spec_tokens: dict[Request, list[int]],
    ) -> SchedulerOutput:
        new_data = []
        cached = CachedRequestData([], [])
        sampled: list[str] = []
        needs_logprobs = needs_prompt_logprobs = False
        prefill_done: list[str] = []
        sent, watched = self._num_sent_blocks, self.kv.tightest_group  # no other group's table grows unless its does
        for req in new_reqs:
            tables = self.kv.tables[req.request_id]
            new_data.append(
                NewRequestData(
                    req.request_id,
                    list(req.all_token_ids),
                    req.params,
                    req.params.seed,
                    [list(t) for t in tables],
                    req.num_computed_tokens,
                    len(req.output_token_ids),
                    resumed=req.num_preemptions > 0,
                )
            )
            sent[req.request_id] = [len(t) for t in tables]
        new_ids = {r.request_id for r in new_reqs}
        num_scheduled = {}
        total = 0
        for req, n in scheduled.items():
            rid = req.request_id
            num_scheduled[rid] = n
            total += n
            if rid not in new_ids:
                tables = self.kv.tables[rid]
                have = sent[rid]
                if len(tables[watched]) > have[watched]:
                    cached.req_ids.append(rid)
                    cached.new_block_ids.append([t[h:] for t, h in zip(tables, have)])
                    sent[rid] = [len(t) for t in tables]
            if req.params.prompt_logprobs is not None and req.num_computed_tokens < req.num_prompt_tokens - 1:
                needs_prompt_logprobs = True
            # Advance now (the step is in flight); the sampled token is a placeholder until its output arrives.
            req.num_computed_tokens += n
            if not req.max_tokens:  # prefill only: it samples nothing, and ends once its prompt is computed
                if req.num_computed_tokens == req.num_tokens:
                    prefill_done.append(rid)
            elif req.num_computed_tokens - len(spec_tokens.get(req, ())) == req.num_tokens + req.num_placeholders:
                req.num_placeholders += 1
                sampled.append(rid)
                if req.params.logprobs is not None:
                    needs_logprobs = True
        for req in preempted:
            sent.pop(req.request_id, None)
        self._preempted_ids.extend(r.request_id for r in preempted)
        if not total:  # a step that runs nothing: the runner hears of these with the next one that runs
            return SchedulerOutput()
        finished, self._finished_ids = self._finished_ids, []
        preempted_ids, self._preempted_ids = self._preempted_ids, []
        return SchedulerOutput(
            new_requests=new_data,
            cached_requests=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            sampled_req_ids=sampled,
            needs_logprobs=needs_logprobs,
            needs_prompt_logprobs=needs_prompt_logprobs,
            prefill_done_req_ids=prefill_done,
            scheduled_spec_decode_tokens={r.request_id: d for r, d in spec_tokens.items()} if spec_tokens else {},
            finished_req_ids=finished,
            preempted_req_ids=preempted_ids,
            kv_block_copies=self.kv.take_copies(),
        )

    def _roll_back(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """After verification (roll_back_drafts: the runner's drafter rolls its batch back the same way)."""
        self.spec_stats.record(num_drafts, num_accepted)
        if num_accepted < num_drafts:
            lookahead = self.spec.lookahead_slots if self.spec else 0
            req.num_computed_tokens, slots = roll_back_drafts(
                req.num_computed_tokens, num_drafts, num_accepted, lookahead
            )
            kept = self.kv.trim(req, slots)
            if req.request_id in self._num_sent_blocks:
                self._num_sent_blocks[req.request_id] = kept

    @staticmethod
    def _prompt_ready(leader: Request) -> bool:
        # Its first token is taken only after its prompt's blocks were computed and indexed for prefix hits.
        return leader.is_finished or bool(leader.output_token_ids)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    @staticmethod
    def _advance_grammar(req: Request, new_ids: list[int]) -> bool:
        """Advance the request's matcher by its new tokens; True when it must finish: its grammar is complete
        (finish_reason stop), or it refused a token (error; the mask should make this impossible)."""
        assert req.grammar is not None
        terminated = req.grammar.advance(new_ids)
        if terminated is None:
            logger.error("request %s: a token outside its grammar was sampled; it ends with an error", req.parent_id)
            req.finish_reason = FinishReason.ERROR
            return True
        if terminated:
            req.finish_reason = FinishReason.STOP
        return terminated

    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[TokenOutput]:
        """Take a step's sampled tokens: append each to its request, check stops, index newly full blocks."""
        results: list[TokenOutput] = []
        requests = self.requests
        kv = self.kv
        if kv.enable_prefix_caching:
            failed = set(output.failed_req_ids)  # their (suspect) KV is never offered to another request
            bs, num_cached = kv.block_size, kv.num_cached_blocks
            running = RequestStatus.RUNNING
            for rid in sched.num_scheduled_tokens:
                req = requests.get(rid)
                if req is None or req.status is not running or rid in failed:
                    continue
                # Full blocks whose tokens are all known; their KV is written by this step or by one in flight,
                # which runs before any step that could read them through a prefix hit.
                known = req.num_computed_tokens
                if known > len(req._all_token_ids):
                    known = len(req._all_token_ids)
                if known // bs > num_cached.get(rid, 0):
                    kv.cache_full_blocks(req, known)
        spec_scheduled = sched.scheduled_spec_decode_tokens
        drafts_out = output.spec_token_ids
        for row, (rid, tokens) in enumerate(zip(output.req_ids, output.sampled_token_ids)):
            req = requests.get(rid)
            if req is None:
                continue  # finished (or aborted) while the step ran: its tokens are dropped
            req.num_placeholders -= 1
            if spec_scheduled and rid in spec_scheduled:
                self._roll_back(req, len(spec_scheduled[rid]), len(tokens) - 1)
            if len(tokens) == 1 and req.grammar is None:  # the common decode step, without the loop's overhead
                req.output_token_ids.append(tokens[0])
                req._all_token_ids.append(tokens[0])
                done = req.check_stop()
            else:
                done = False
                for n, token in enumerate(tokens, 1):
                    req.output_token_ids.append(token)
                    req._all_token_ids.append(token)
                    done = req.check_stop()
                    if not done and req.grammar is not None:
                        done = self._advance_grammar(req, [token])
                    if done:  # a stop inside an accepted run: the tokens after it are not output
                        tokens = tokens[:n]
                        break
            if done:
                self._finish(req, FinishReason.STOP)
            elif drafts_out is not None:
                req.spec_token_ids = drafts_out[row]
            results.append((req, tokens, done, row))
        for rid in sched.prefill_done_req_ids:
            req = requests.get(rid)
            if req is not None:
                self._finish(req, FinishReason.LENGTH)
                results.append((req, [], True, -1))
        for rid in output.failed_req_ids:
            req = requests.get(rid)
            if req is not None:
                # Its token is dropped and its (suspect) KV blocks are not cached.
                req.num_placeholders -= 1
                self._finish(req, FinishReason.ERROR)
                results.append((req, [], True, -1))
        return results
