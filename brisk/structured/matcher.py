"""Per-sequence grammar matchers, and the batched mask application the runner calls before sampling."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from brisk.host import to_device

if TYPE_CHECKING:
    from brisk.kernels.cpu_kernels import CpuKernels
    from brisk.scheduler.output import SchedulerOutput


class Matcher:
    """One sequence's position in its grammar. The engine calls `fill_bitmask` before sampling, then
    `accept_token` with the sampled token; `rollback` undoes accepted tokens (speculative decoding's rejected
    drafts; xgrammar keeps the whole history, so any number up to the tokens accepted); `fork` copies the state for n > 1 siblings."""

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        *,
        terminate_without_stop_token: bool = False,
        _inner: xgr.GrammarMatcher | None = None,
    ) -> None:
        """terminate_without_stop_token: the grammar ends with its own terminator (harmony's `<|return|>` or
        `<|call|>`), so the matcher terminates once the grammar is complete, without a stop token after it."""
        self._compiled = compiled
        self._inner = _inner or xgr.GrammarMatcher(compiled, terminate_without_stop_token=terminate_without_stop_token)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""
        return bool(self._inner.accept_token(token_id))

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance token by token; the number accepted before the first the grammar refuses."""
        for count, token_id in enumerate(token_ids):
            if not self._inner.accept_token(token_id):
                return count
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        self._inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the sequence must finish."""
        return bool(self._inner.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write this sequence's allowed next tokens into row `row` of a batch bitmask (allocate_bitmask).
        False: every token is allowed, so the row need not be applied."""
        return bool(self._inner.fill_next_token_bitmask(bitmask, row))

    def fork(self) -> Matcher:
        return Matcher(self._compiled, _inner=self._inner.fork())

    def reset(self) -> None:
        """Back to the grammar's start (before any prompt tokens GrammarCompiler.matcher accepted)."""
        self._inner.reset()


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A (batch_size, ceil(vocab_size / 32)) int32 bitmask on CPU, all tokens allowed; 1 bit = allowed."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None, vocab_size: int | None = None
) -> None:
    """Set logits[i, t] to -inf where bitmask row i disallows token t, for each i in `rows` (all rows when
    None), in one vectorised pass over the batch. `bitmask` rows index the same batch as `logits` and cover the
    model's vocabulary (allocate_bitmask with the model's vocab size). xgrammar picks the kernel by device: a CUDA/Triton kernel on GPU,
    a C++ loop on CPU (a brisk Triton kernel could replace it later). vocab_size: the columns the bitmask
    covers (None: min of the two widths)."""
    if rows is not None and len(rows) == 0:
        return
    if bitmask.device != logits.device:  # through pinned memory: a pageable copy may wait for the step's forward
        bitmask = to_device(bitmask.numpy(), logits.device)
    xgr.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=vocab_size, indices=None if rows is None else list(rows)
    )


class GrammarBitmaskApplier:
    """The runner's side: masks (-inf), in place, the tokens each constrained row's grammar forbids, in one
    vectorised pass over those rows: on CPU brisk's C kernel where it is built (`cpu_kernels`: a word of the bitmask
    at a time, ~20x faster than xgrammar's C++ loop), else xgrammar's kernel (C++ on CPU, Triton on GPU). On CPU,
    large batches are split by rows over `num_threads` threads (OpenMP in brisk's kernel; for xgrammar's, which
    releases the GIL, Python threads)."""

    MIN_ELEMENTS_PER_THREAD = 1 << 20  # below this a thread costs more than it saves

    def __init__(self, num_threads: int = 1, cpu_kernels: CpuKernels | None = None) -> None:
        self.num_threads = max(1, num_threads)
        self.cpu_kernels = cpu_kernels
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, logits: torch.Tensor, sched: SchedulerOutput, first_rows: list[int] | None = None) -> None:
        """`logits` rows follow sched.sampled_req_ids (with drafts: request i's positions start at logits row
        first_rows[i]); the bitmask covers the model's whole vocabulary, so padded ids are masked too (and any
        column past it: an LM head wider than the vocabulary)."""
        ids = sched.grammar_req_ids
        received = torch.frombuffer(bytearray(sched.grammar_bitmask), dtype=torch.int32).view(len(ids), -1)
        num_words = received.shape[1]
        covered = min(logits.shape[-1], num_words * 32)
        rows: list[int] | None = None
        positions = sched.grammar_positions or [0] * len(ids)
        if first_rows is None and len(ids) == logits.shape[0] and ids == sched.sampled_req_ids:
            bitmask = received
        else:
            row_of = {rid: row for row, rid in enumerate(sched.sampled_req_ids)}
            if first_rows is not None:
                row_of = {rid: first_rows[row] for rid, row in row_of.items()}
            rows = [row_of[rid] + position for rid, position in zip(ids, positions)]
            bitmask = torch.full((logits.shape[0], num_words), -1, dtype=torch.int32)
            bitmask[rows] = received
        self._apply(logits, bitmask, list(range(logits.shape[0])) if rows is None else rows, covered)
        if logits.shape[-1] > covered:
            logits[slice(None) if rows is None else rows, covered:] = float("-inf")

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], covered: int) -> None:
        threads = min(self.num_threads, len(rows) * covered // self.MIN_ELEMENTS_PER_THREAD)
        if self.cpu_kernels is not None and self.cpu_kernels.bitmask_accepts(logits, bitmask):
            self.cpu_kernels.apply_token_bitmask(logits, bitmask, rows, covered, max(1, threads))
            return
        if logits.is_cuda:
            # Every row (the bitmask allows everything on the unconstrained ones): given a row list, xgrammar would
            # upload it from pageable memory, waiting for the step's forward.
            apply_token_bitmask(logits, bitmask, None, covered)
            return
        if threads <= 1:
            apply_token_bitmask(logits, bitmask, None if len(rows) == logits.shape[0] else rows, covered)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="brisk-grammar-mask")
        chunks = [rows[i::threads] for i in range(threads)]
        futures = [self._pool.submit(apply_token_bitmask, logits, bitmask, chunk, covered) for chunk in chunks]
        for future in futures:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def apply_grammar_bitmask(logits: torch.Tensor, sched: SchedulerOutput) -> None:
    """One-off form of GrammarBitmaskApplier (one thread)."""
    GrammarBitmaskApplier()(logits, sched)
