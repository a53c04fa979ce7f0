"""Per-request grammar state and the batched mask application the sampler calls."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


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
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=vocab_size, indices=None if rows is None else list(rows)
    )
