"""A model-free engine for scheduler and KV-cache tests.

The fake "model" stores each token id in its KV slot and computes the next token from what it reads
back through the block tables (the full context for full-attention groups, the last `window` tokens
for sliding groups). A wrong block table, a bad prefix hit or a block released too early changes the
output, so comparing against the same function on the true token list checks the KV bookkeeping.
"""

from __future__ import annotations

import itertools

from brisk.kv_cache.host_tier import HostTier
from brisk.kv_cache.manager import KVCacheManager, KVGroupSpec
from brisk.sampling_params import SamplingParams
from brisk.scheduler.output import ModelRunnerOutput, SchedulerOutput
from brisk.scheduler.request import Request
from brisk.scheduler.scheduler import Scheduler

VOCAB = 97
EOS = 0


def next_token(full_ctx: tuple[int, ...], window_ctx: tuple[int, ...]) -> int:
    # 1 + ... keeps EOS out unless a test asks for it.
    return 1 + hash((full_ctx, window_ctx)) % (VOCAB - 1)


def oracle(tokens: list[int], window: int | None) -> int:
    full = tuple(tokens)
    win = tuple(tokens[-window:]) if window else ()
    return next_token(full, win)


class _FakeRow:
    def __init__(self, tokens: list[int], blocks: list[list[int]], num_computed: int) -> None:
        self.tokens = list(tokens)  # what this "rank" knows: prompt, then every token it sampled
        self.blocks = [list(b) for b in blocks]
        self.num_computed = num_computed


class FakeEngine:
    """Scheduler + KV manager driven through the engine's seam: the fake runner sees only SchedulerOutputs (it
    keeps its own block tables and tokens, as a model runner does) and answers ModelRunnerOutputs. With `overlap`
    the loop runs one step ahead, as EngineCore does: step N+1 is scheduled before step N's output is taken."""

    def __init__(
        self,
        groups: list[KVGroupSpec],
        num_blocks: int,
        block_size: int | list[int],
        *,
        max_batch_size=8,
        max_num_tokens=64,
        chunked=True,
        prefix_caching=True,
        overlap=False,
        host_blocks=0,
        max_prefill_chunk=0,
    ):
        host = HostTier(host_blocks, bytes_per_block=1) if host_blocks else None
        # block_size: one for every group, or per group (a narrower KV dtype's group holds more tokens a block)
        self.block_sizes = [block_size] * len(groups) if isinstance(block_size, int) else list(block_size)
        self.kv = KVCacheManager(groups, num_blocks, self.block_sizes, prefix_caching, host)
        self.sched = Scheduler(self.kv, max_batch_size, max_num_tokens, chunked, max_prefill_chunk=max_prefill_chunk)
        self.groups = groups
        self.overlap = overlap
        # One "tensor" per group; a slot holds (position, token id) so reading a wrong slot shows.
        self.cache = [dict() for _ in groups]
        self.host_cache = [dict() for _ in groups]  # the host KV tier's blocks, the same way
        self.ids = itertools.count()
        self.finished: list[Request] = []
        self.rows: dict[str, _FakeRow] = {}
        self.preempted: dict[str, _FakeRow] = {}
        self._in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def add(self, prompt: list[int], max_tokens: int, priority: int = 0, follows: Request | None = None) -> Request:
        n = next(self.ids)
        req = Request(
            f"r{n}",
            list(prompt),
            SamplingParams(max_tokens=max_tokens, priority=priority, temperature=0),
            max_tokens,
            frozenset(),
            n,
            follows=follows,
        )
        self.sched.add(req)
        return req

    def window(self) -> int | None:
        return next((g.sliding_window for g in self.groups if g.sliding_window), None)

    def _run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The fake model runner: only what the SchedulerOutput says."""
        for copy in out.kv_block_copies:  # before the step, in order, as the model runner does
            for device, host, bs in zip(self.cache, self.host_cache, self.block_sizes):
                src, dst = (device, host) if copy.to_host else (host, device)
                s0, d0 = (copy.device_block, copy.host_block) if copy.to_host else (copy.host_block, copy.device_block)
                for o in range(bs):
                    dst.pop(d0 * bs + o, None)
                    if s0 * bs + o in src:
                        dst[d0 * bs + o] = src[s0 * bs + o]
        for rid in out.finished_req_ids:
            self.rows.pop(rid, None)
            self.preempted.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.preempted[rid] = self.rows.pop(rid)
        for new in out.new_requests:
            if new.resumed:
                self.preempted.pop(new.req_id)
            self.rows[new.req_id] = _FakeRow(new.token_ids, new.block_ids, new.num_computed_tokens)
        for rid, new_blocks in zip(out.cached_requests.req_ids, out.cached_requests.new_block_ids):
            for table, blocks in zip(self.rows[rid].blocks, new_blocks):
                table.extend(blocks)
        result = ModelRunnerOutput([], [], None, [])
        for rid, n in out.num_scheduled_tokens.items():
            row = self.rows[rid]
            start, end = row.num_computed, row.num_computed + n
            for g, (table, bs) in enumerate(zip(row.blocks, self.block_sizes)):
                for p in range(start, end):
                    if table[p // bs] == 0:
                        raise AssertionError(f"{rid}: writing position {p} into the null block")
                    self.cache[g][table[p // bs] * bs + p % bs] = (p, row.tokens[p])
            row.num_computed = end
            if end >= len(row.tokens):
                ctx = {}
                for spec, g_cache, table, bs in zip(self.groups, self.cache, row.blocks, self.block_sizes):
                    lo = 0 if spec.sliding_window is None else max(0, end - spec.sliding_window)
                    toks = []
                    for p in range(lo, end):
                        pos, tok = g_cache.get(table[p // bs] * bs + p % bs, (None, None))
                        if pos != p:
                            raise AssertionError(f"{rid}: slot for position {p} holds position {pos}")
                        toks.append(tok)
                    ctx[spec.sliding_window is not None] = tuple(toks)
                token = next_token(ctx.get(False, tuple(row.tokens[:end])), ctx.get(True, ()))
                row.tokens.append(token)
                result.req_ids.append(rid)
                result.sampled_token_ids.append([token])
        if result.req_ids != out.sampled_req_ids:
            raise AssertionError(f"sampled {result.req_ids}, the scheduler expected {out.sampled_req_ids}")
        return result

    def _update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        for request, _, finished, _ in self.sched.update_from_output(out, result):
            if finished:
                self.finished.append(request)
        self.kv.check_invariants()

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        result = self._run(out) if out else None
        if not self.overlap:
            if result is not None:
                self._update(out, result)
            return out
        previous, self._in_flight = self._in_flight, (out, result) if result is not None else None
        if previous is not None:
            self._update(*previous)
        return out

    def busy(self) -> bool:
        return bool(self.sched.num_unfinished) or self._in_flight is not None

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.busy():
                return
            self.step()
        raise AssertionError("scheduler made no progress")

    def expected_output(self, prompt: list[int], max_tokens: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(oracle(tokens, self.window()))
        return tokens[len(prompt) :]
