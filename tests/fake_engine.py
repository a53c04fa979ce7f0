"""A model-free engine for scheduler and KV-cache tests.

The fake "model" stores each token id in its KV slot and computes the next token from what it reads
back through the block tables (the full context for full-attention groups, the last `window` tokens
for sliding groups). A wrong block table, a bad prefix hit or a block released too early changes the
output, so comparing against the same function on the true token list checks the KV bookkeeping.
"""

from __future__ import annotations

import itertools

from brisk.kv_cache.manager import KVCacheManager, KVGroupSpec
from brisk.sampling_params import SamplingParams
from brisk.scheduler.request import Request
from brisk.scheduler.scheduler import Scheduler, SchedulerOutput

VOCAB = 97
EOS = 0


def next_token(full_ctx: tuple[int, ...], window_ctx: tuple[int, ...]) -> int:
    # 1 + ... keeps EOS out unless a test asks for it.
    return 1 + hash((full_ctx, window_ctx)) % (VOCAB - 1)


def oracle(tokens: list[int], window: int | None) -> int:
    full = tuple(tokens)
    win = tuple(tokens[-window:]) if window else ()
    return next_token(full, win)


class FakeEngine:
    def __init__(
        self,
        groups: list[KVGroupSpec],
        num_blocks: int,
        block_size: int,
        *,
        max_batch_size=8,
        max_num_tokens=64,
        chunked=True,
        prefix_caching=True,
    ):
        self.kv = KVCacheManager(groups, num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.kv, max_batch_size, max_num_tokens, chunked)
        self.groups = groups
        self.block_size = block_size
        # One "tensor" per group; a slot holds (position, token id) so reading a wrong slot shows.
        self.cache = [dict() for _ in groups]
        self.ids = itertools.count()
        self.finished: list[Request] = []

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

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        bs = self.block_size
        sampled = {}
        for s in out.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            tables = self.kv.tables[req.request_id]
            for g, table in enumerate(tables):
                for p in range(start, end):
                    if table[p // bs] == 0:
                        raise AssertionError(f"{req.request_id}: writing position {p} into the null block")
                    self.cache[g][table[p // bs] * bs + p % bs] = (p, req.all_token_ids[p])
            if s.samples:
                ctx = {}
                for g, (spec, table) in enumerate(zip(self.groups, tables)):
                    lo = 0 if spec.sliding_window is None else max(0, end - spec.sliding_window)
                    toks = []
                    for p in range(lo, end):
                        pos, tok = self.cache[g].get(table[p // bs] * bs + p % bs, (None, None))
                        if pos != p:
                            raise AssertionError(f"{req.request_id}: slot for position {p} holds position {pos}")
                        toks.append(tok)
                    ctx[spec.sliding_window is not None] = tuple(toks)
                sampled[req] = next_token(ctx.get(False, tuple(req.all_token_ids[:end])), ctx.get(True, ()))
        for t in self.sched.update(out, sampled):
            if t.finished:
                self.finished.append(t.request)
        self.kv.check_invariants()
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.num_unfinished:
                return
            self.step()
        raise AssertionError("scheduler made no progress")

    def expected_output(self, prompt: list[int], max_tokens: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(oracle(tokens, self.window()))
        return tokens[len(prompt) :]
