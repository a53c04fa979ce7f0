"""EngineCore: the step loop. Schedule, run the model, advance the requests, report tokens.

It runs in-process for the offline API and tests, and behind ZMQ in the server's engine process. Its only call
into the model side is `executor.execute_model(scheds)` (one SchedulerOutput per attention-DP rank).

With overlap scheduling the loop is one step ahead: step N+1 is scheduled and launched before step N's tokens
are taken (the device still runs step N while the host prepares N+1; N+1 reads N's tokens on the device), then
step N's output updates the requests. Without it, each step is scheduled, run and taken in turn.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace

import torch

from brisk.config import EngineConfig, load_model_config
from brisk.distributed.executor import make_executor
from brisk.engine.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats, TokenLogprob, shown_block_sizes
from brisk.errors import InvalidRequest
from brisk.host import resolve_device
from brisk.kv_cache.host_tier import HostTier
from brisk.kv_cache.manager import KVCacheManager
from brisk.model_config import ModelConfig
from brisk.model_runner.interface import StepHandle
from brisk.scheduler.output import FinishReason, ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from brisk.scheduler.request import Request
from brisk.scheduler.scheduler import Scheduler, SpecDecodeLimits
from brisk.structured.engine import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class EngineStep:
    """All that one `EngineCore.step()` produced."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    # Requests refused after admission (a grammar that did not compile in time, or at all), by the client's
    # request id: the server answers them with a 400, the offline LLM raises.
    refused: list[tuple[str, InvalidRequest]] = field(default_factory=list)
    num_tokens: int = 0  # tokens the step scheduled (0: it could schedule nothing), for the iteration-tokens metric


class EngineCore:
    """The step loop of rank 0. With attention data parallelism it keeps one scheduler and KV manager per
    DP rank (each rank has its own KV pool) and hands each new request to the least loaded one."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        torch.manual_seed(config.seed)  # vLLM's --seed: requests without a seed of their own draw from it
        self._iteration = 0  # steps launched (print_iter_log)
        self.model_config, self.max_seq_len = load_model_config(config, self.device, model_config)
        self.executor = make_executor(config, self.model_config, self.device, self.max_seq_len)
        spec = self.executor.kv_cache_spec
        self.num_kv_blocks, self.num_kv_groups = spec.num_blocks, len(spec.groups)
        disable_overlap = config.disable_overlap_scheduler
        self.overlap = self.device.type == "cuda" if disable_overlap is None else not disable_overlap
        spec_config = config.speculative_config
        spec_limits = None
        if spec_config is not None:
            spec_limits = SpecDecodeLimits(
                spec_config.max_draft_len, spec_config.disable_by_batch_size, spec.spec_lookahead_slots
            )
        self.kv_managers: list[KVCacheManager] = []
        self.schedulers: list[Scheduler] = []
        for _ in range(spec.dp_size):
            host = HostTier(spec.num_host_blocks, spec.host_bytes_per_block) if spec.num_host_blocks else None
            kv = KVCacheManager(
                spec.groups, spec.num_blocks, list(spec.block_sizes), config.enable_prefix_caching, host
            )
            self.kv_managers.append(kv)
            self.schedulers.append(
                Scheduler(
                    kv,
                    max_batch_size=config.max_batch_size,
                    max_num_tokens=config.max_num_tokens,
                    enable_chunked_prefill=config.enable_chunked_prefill,
                    spec=spec_limits,
                    max_prefill_chunk=config.long_prefill_token_threshold,
                )
            )
        self.requests: dict[str, list[Request]] = {}  # request id -> its n completions
        self._arrivals = itertools.count()
        self._in_flight: tuple[list[SchedulerOutput], StepHandle] | None = None  # overlap: the step launched last
        mc = self.model_config
        self.structured = StructuredOutputManager(
            config.tokenizer or config.model,
            mc.vocab_size,
            mc.hf_config.model_type,
            mc.eos_token_ids,
            config.grammar_compile_timeout_s,
            config.grammar_max_json_whitespace,
        )
        logger.info(
            "engine ready: %s on %s, %d KV blocks of %s tokens%s, max_seq_len %d, overlap scheduling %s",
            self.model_config.architecture,
            self.device,
            self.num_kv_blocks,
            shown_block_sizes(spec.block_sizes),
            f" (+ {spec.num_host_blocks} in host memory)" if spec.num_host_blocks else "",
            self.max_seq_len,
            "on" if self.overlap else "off",
        )

    @property
    def kv(self) -> KVCacheManager:
        """The KV manager of DP rank 0 (the only one without attention data parallelism)."""
        return self.kv_managers[0]

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of DP rank 0 (the only one without attention data parallelism)."""
        return self.schedulers[0]

    def stats(self, iteration_tokens: tuple[int, ...] = ()) -> SchedulerStats:
        scheds, kvs = self.schedulers, self.kv_managers
        return SchedulerStats(
            sum(s.num_running for s in scheds),
            sum(len(s.waiting) for s in scheds),
            sum(kv.usage for kv in kvs) / len(kvs),
            sum(kv.prefix_queries for kv in kvs),
            sum(kv.prefix_hits for kv in kvs),
            sum(s.num_preemptions for s in scheds),
            tuple(kv.usage for kv in kvs),
            iteration_tokens,
            sum(s.spec_stats.num_drafts for s in scheds),
            sum(s.spec_stats.num_draft_tokens for s in scheds),
            sum(s.spec_stats.num_accepted_tokens for s in scheds),
            tuple(map(sum, zip(*(s.spec_stats.accepted_per_pos for s in scheds)))),
            *self._host_tier_stats(),
        )

    def _host_tier_stats(self) -> tuple[int, int, int, int, float]:
        """Host KV tier: tokens looked up, tokens it gave back, bytes to host, bytes to the device, its usage."""
        tiers = [(kv, kv.host_tier) for kv in self.kv_managers if kv.host_tier is not None]
        if not tiers:
            return 0, 0, 0, 0, 0.0
        return (
            sum(kv.prefix_queries for kv, _ in tiers),
            sum(kv.host_hits for kv, _ in tiers),
            sum(t.blocks_to_host * t.bytes_per_block for _, t in tiers),
            sum(t.blocks_to_device * t.bytes_per_block for _, t in tiers),
            sum(t.usage for _, t in tiers) / len(tiers),
        )

    def shutdown(self) -> None:
        self.structured.close()
        self.executor.shutdown()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        rid, prompt, params = request.request_id, request.prompt_token_ids, request.params
        if rid in self.requests:
            raise InvalidRequest("request_id", f"request id {rid!r} is already in flight")
        self._validate(prompt, params)
        room = self.max_seq_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.model_config.eos_token_ids)
        # All n completions go to one DP rank: the later ones adopt the first one's prompt blocks.
        dp_rank = min(range(len(self.schedulers)), key=lambda d: self.schedulers[d].num_unfinished)
        children: list[Request] = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            arrival = next(self._arrivals)
            children.append(
                Request(
                    # The engine's own id, unique for its lifetime (parent_id and index say whose it is).
                    request_id=str(arrival),
                    prompt_token_ids=list(prompt),
                    # The prompt's logprobs are the request's, not each completion's: the first one computes them.
                    params=params
                    if params.n == 1
                    else replace(params, n=1, seed=seed, prompt_logprobs=None if i else params.prompt_logprobs),
                    max_tokens=max_tokens,
                    stop_token_ids=frozenset(stop_ids),
                    arrival_seq=arrival,
                    # Later completions wait for the first one's prefill, then adopt its cached prompt blocks.
                    follows=children[0] if i > 0 and self.config.enable_prefix_caching else None,
                    dp_rank=dp_rank,
                    parent_id=rid,
                    index=i,
                    cache_salt=request.cache_salt,
                )
            )
        if params.structured_outputs is not None:
            # One compile (off the step loop) for all n completions; each gets its own matcher once it is done.
            grammar = self.structured.submit(params.structured_outputs)
            for child in children:
                child.grammar = replace(grammar)
            self.structured.track(children)
        self.requests[rid] = children
        for child in children:
            self.schedulers[dp_rank].add(child)

    def _validate(self, prompt: list[int], params) -> None:
        if not prompt:
            raise InvalidRequest("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest("prompt", f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_seq_len:
            raise InvalidRequest(
                "prompt",
                f"the prompt has {len(prompt)} tokens; max_seq_len is {self.max_seq_len}, leaving no room to generate",
            )
        if params.max_tokens is not None and len(prompt) + params.max_tokens > self.max_seq_len:
            raise InvalidRequest(
                "max_tokens",
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds max_seq_len ({self.max_seq_len})",
            )
        total = len(prompt) + (self.max_seq_len - len(prompt) if params.max_tokens is None else params.max_tokens)
        if self.kv.max_blocks_per_request(total) > self.kv.pool.num_usable:
            raise InvalidRequest(
                "max_tokens",
                f"a request of {total} tokens needs more KV blocks than the whole cache holds "
                f"({self.kv.pool.num_usable}); lower max_tokens or give the KV cache more memory",
            )
        bad_stop = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad_stop is not None:
            raise InvalidRequest("stop_token_ids", f"stop_token_ids holds {bad_stop}, outside the vocabulary")

    def abort_request(self, request_id: str, index: int | None = None) -> list[EngineCoreOutput]:
        """Abort all completions of a request (or one). Returns their final outputs."""
        children = self.requests.get(request_id, [])
        outputs = []
        for req in children:
            if (index is None or req.index == index) and not req.is_finished:
                self.schedulers[req.dp_rank].abort(req)
                outputs.append(self._output(req, [], None))
        self._forget_if_done(request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or any(s.num_unfinished for s in self.schedulers)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> EngineStep:
        result = EngineStep()
        if self.structured.pending:
            result.refused = self._poll_grammars()
        # Some requests need the last step's tokens on the host before they can be scheduled (speculation: their
        # drafts come with them; structured outputs: the bitmask follows every accepted token): the step in flight
        # is taken first, and this one runs without overlap.
        synchronous = not self.overlap or any(s.needs_host_tokens() for s in self.schedulers)
        if synchronous and self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            result.outputs = self._update(in_flight[0], in_flight[1].result())
        scheds = [s.schedule() for s in self.schedulers]
        for scheduler, sched in zip(self.schedulers, scheds):
            if scheduler.num_constrained and sched.sampled_req_ids:
                self.structured.fill_bitmasks(sched, scheduler.requests)
        result.num_tokens = sum(s.num_tokens for s in scheds)
        handle = self.executor.execute_model(scheds) if any(scheds) else None
        if self.config.print_iter_log and handle is not None:
            self._log_iteration(result.num_tokens)
        if synchronous:
            if handle is not None:
                result.outputs += self._update(scheds, handle.result())
            return result
        previous = self._in_flight
        self._in_flight = (scheds, handle) if handle is not None else None
        if previous is not None:
            result.outputs = self._update(previous[0], previous[1].result())
        return result

    def _log_iteration(self, num_tokens: int) -> None:
        """trtllm's print_iter_log: one line per step launched."""
        self._iteration += 1
        stats = self.stats()
        logger.info(
            "iteration %d: %d tokens, %d requests running, %d waiting, KV cache %.1f%% used",
            self._iteration,
            num_tokens,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_usage,
        )

    def _poll_grammars(self) -> list[tuple[str, InvalidRequest]]:
        """Matchers for the requests whose grammar compiled; a failed or timed-out compile fails its request (the
        request is refused, once for its n completions). An engine with nothing else to run waits a little for a
        compile rather than spin."""
        compiling = sum(not req.is_finished for req in self.structured.pending)
        idle = self._in_flight is None and compiling >= sum(s.num_unfinished for s in self.schedulers)
        refused: list[tuple[str, InvalidRequest]] = []
        for req, error in self.structured.poll(block=idle):
            self.schedulers[req.dp_rank].abort(req, FinishReason.ERROR)
            if not any(rid == req.parent_id for rid, _ in refused):
                refused.append((req.parent_id, error))
            self._forget_if_done(req.parent_id)
        return refused

    def _update(self, scheds: list[SchedulerOutput], results: list[ModelRunnerOutput]) -> list[EngineCoreOutput]:
        outputs = []
        for scheduler, sched, result in zip(self.schedulers, scheds, results):
            logprobs = result.logprobs
            prompt_logprobs: dict[Request, PromptLogprobs] = {}
            if result.prompt_logprobs:  # looked up before the update, which may finish the request
                requests = scheduler.requests
                prompt_logprobs = {requests[r]: lp for r, lp in result.prompt_logprobs.items() if r in requests}
            for req, new_ids, finished, row in scheduler.update_from_output(sched, result):
                token_logprobs = None
                if logprobs is not None and row >= 0 and req.params.logprobs is not None:
                    lps = logprobs[row]
                    if lps is not None:  # one per token (a stop inside an accepted run cut new_ids short)
                        token_logprobs = [TokenLogprob(t, lp.logprob, lp.top) for t, lp in zip(new_ids, lps)]
                elif not new_ids and req.finish_reason is FinishReason.ERROR:
                    logger.error(
                        "request %s: the model produced non-finite logits; it ends with an error", req.parent_id
                    )
                outputs.append(
                    EngineCoreOutput(
                        req.parent_id,
                        req.index,
                        new_ids,
                        token_logprobs,
                        req.finish_reason if finished else None,
                        req.stop_reason,
                        req.num_prompt_tokens,
                        req.num_cached_tokens,
                        req.first_scheduled_time,
                        prompt_logprobs.pop(req, None) if prompt_logprobs else None,
                    )
                )
                if finished:
                    self._forget_if_done(req.parent_id)
            for req, chunk in prompt_logprobs.items():  # a prompt chunk that sampled nothing yet
                outputs.append(
                    EngineCoreOutput(
                        req.parent_id, req.index, [], num_prompt_tokens=req.num_prompt_tokens, prompt_logprobs=chunk
                    )
                )
        if self.config.check_kv_invariants:
            for kv in self.kv_managers:
                kv.check_invariants()
        return outputs

    @staticmethod
    def _output(req: Request, new_ids: list[int], logprobs) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=req.parent_id,
            index=req.index,
            new_token_ids=new_ids,
            logprobs=logprobs,
            finish_reason=req.finish_reason if req.is_finished else None,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            scheduled_time=req.first_scheduled_time,
        )

    def _forget_if_done(self, rid: str) -> None:
        if all(r.is_finished for r in self.requests.get(rid, [])):
            self.requests.pop(rid, None)
