"""EngineCore: the step loop. Schedule, run the model, sample, advance the requests, report tokens.

It runs in-process for the offline API and tests, and behind ZMQ in the server's engine process.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace

from brisk.config import EngineConfig, ModelConfig
from brisk.distributed.executor import make_executor
from brisk.engine.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats, TokenLogprob
from brisk.host import resolve_device
from brisk.kv_cache.manager import KVCacheManager
from brisk.model_runner.runner import StepResult
from brisk.scheduler.request import Request
from brisk.scheduler.scheduler import Scheduler, TokenOutput

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (too long, bad token ids...); nothing was admitted."""


def load_model_config(config: EngineConfig, device, model_config: ModelConfig | None = None) -> tuple[ModelConfig, int]:
    """The model's config (dtype resolved for the device, unless given) and the max_seq_len in effect: every
    rank's view."""
    model_config = model_config or ModelConfig.from_pretrained(config.model, config.dtype, device.type)
    return model_config, config.max_seq_len or model_config.max_position_embeddings


class EngineCore:
    """The step loop of rank 0. With attention data parallelism it keeps one scheduler and KV manager per
    DP rank (each rank has its own KV pool) and hands each new request to the least loaded one."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config, self.max_seq_len = load_model_config(config, self.device, model_config)
        self.executor = make_executor(config, self.model_config, self.device, self.max_seq_len)
        self.runner = self.executor.runner
        self.kv_managers: list[KVCacheManager] = []
        self.schedulers: list[Scheduler] = []
        for _ in range(self.runner.parallel.dp_size):
            kv = self.runner.make_kv_manager()
            self.kv_managers.append(kv)
            self.schedulers.append(
                Scheduler(
                    kv,
                    max_batch_size=config.max_batch_size,
                    max_num_tokens=config.max_num_tokens,
                    enable_chunked_prefill=config.enable_chunked_prefill,
                )
            )
        self.requests: dict[str, list[Request]] = {}  # request id -> its n completions
        self.last_step_num_tokens = 0  # tokens the last step() scheduled, for the iteration-tokens metric
        self._arrivals = itertools.count()
        logger.info(
            "engine ready: %s on %s, %d KV blocks of %d tokens, max_seq_len %d",
            self.model_config.architecture,
            self.device,
            self.runner.num_blocks,
            config.block_size,
            self.max_seq_len,
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
            sum(len(s.running) for s in scheds),
            sum(len(s.waiting) for s in scheds),
            sum(kv.usage for kv in kvs) / len(kvs),
            sum(kv.prefix_queries for kv in kvs),
            sum(kv.prefix_hits for kv in kvs),
            sum(s.num_preemptions for s in scheds),
            tuple(kv.usage for kv in kvs),
            iteration_tokens,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        rid, prompt, params = request.request_id, request.prompt_token_ids, request.params
        if rid in self.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in flight")
        self._validate(prompt, params)
        room = self.max_seq_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.model_config.eos_token_ids)
        # All n completions go to one DP rank: the later ones adopt the first one's prompt blocks.
        dp_rank = min(range(len(self.schedulers)), key=lambda d: self.schedulers[d].num_unfinished)
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            children.append(
                Request(
                    request_id=f"{rid}#{i}",
                    prompt_token_ids=list(prompt),
                    params=params if params.n == 1 else replace(params, n=1, seed=seed),
                    max_tokens=max_tokens,
                    stop_token_ids=frozenset(stop_ids),
                    arrival_seq=next(self._arrivals),
                    # Later completions wait for the first one's prefill, then adopt its cached prompt blocks.
                    follows=children[0] if i > 0 and self.config.enable_prefix_caching else None,
                    generator=None if seed is None else self.runner.make_generator(seed),
                    dp_rank=dp_rank,
                )
            )
        self.requests[rid] = children
        for child in children:
            self.schedulers[dp_rank].add(child)

    def _validate(self, prompt: list[int], params) -> None:
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_seq_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens; max_seq_len is {self.max_seq_len}, leaving no room to generate"
            )
        if params.max_tokens is not None and len(prompt) + params.max_tokens > self.max_seq_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds max_seq_len ({self.max_seq_len})"
            )
        total = len(prompt) + (params.max_tokens or self.max_seq_len - len(prompt))
        if self.kv.max_blocks_per_request(total) > self.kv.pool.num_usable:
            raise InvalidRequestError(
                f"a request of {total} tokens needs more KV blocks than the whole cache holds "
                f"({self.kv.pool.num_usable}); lower max_tokens or give the KV cache more memory"
            )
        bad_stop = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad_stop is not None:
            raise InvalidRequestError(f"stop_token_ids holds {bad_stop}, outside the vocabulary")

    def abort_request(self, request_id: str, index: int | None = None) -> list[EngineCoreOutput]:
        """Abort all completions of a request (or one). Returns their final outputs."""
        children = self.requests.get(request_id, [])
        outputs = []
        for i, req in enumerate(children):
            if (index is None or i == index) and not req.is_finished:
                self.schedulers[req.dp_rank].abort(req)
                outputs.append(self._output(request_id, i, req, [], None))
        self._forget_if_done(request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(s.num_unfinished for s in self.schedulers)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        scheds = [s.schedule() for s in self.schedulers]
        self.last_step_num_tokens = sum(s.num_tokens for s in scheds)
        if not any(scheds):
            return []
        now = time.time()
        for scheduled in (s for sched in scheds for s in sched.scheduled):
            scheduled.request.first_scheduled_time = scheduled.request.first_scheduled_time or now
        inputs, rows = [], []
        for sched, kv in zip(scheds, self.kv_managers):
            step_input, step_rows = self.runner.prepare(sched, kv)
            inputs.append(step_input)
            rows.extend(step_rows)
        result = self.runner.sample(self.executor.execute(inputs), rows)
        for req in result.failed:
            # Finished before update(): its token is dropped and its (suspect) KV blocks are not cached.
            logger.error("request %s: the model produced non-finite logits; finishing it with an error", req.request_id)
            req.finish_reason = "error"
            self.schedulers[req.dp_rank].abort(req)
        outputs = [
            self._to_output(t, result)
            for scheduler, sched in zip(self.schedulers, scheds)
            for t in scheduler.update(sched, result.sampled)
        ]
        if self.config.check_kv_invariants:
            for kv in self.kv_managers:
                kv.check_invariants()
        for req in result.failed:
            rid, _, idx = req.request_id.rpartition("#")
            outputs.append(self._output(rid, int(idx), req, [], None))
            self._forget_if_done(rid)
        return outputs

    def _to_output(self, t: TokenOutput, result: StepResult) -> EngineCoreOutput:
        rid, _, idx = t.request.request_id.rpartition("#")
        logprobs = None
        if t.request.params.logprobs is not None and result.sampler_output is not None:
            row = result.rows.index(t.request)
            so = result.sampler_output
            logprobs = [TokenLogprob(t.new_token_ids[0], so.logprobs[row], so.top_logprobs[row])]
        out = self._output(rid, int(idx), t.request, t.new_token_ids, logprobs)
        if t.finished:
            self._forget_if_done(rid)
        return out

    @staticmethod
    def _output(rid: str, index: int, req: Request, new_ids: list[int], logprobs) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=rid,
            index=index,
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
