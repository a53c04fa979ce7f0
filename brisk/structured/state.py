"""One completion's grammar as the engine core keeps it with the scheduler's request: compiling, then followed."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from brisk.errors import InvalidRequest

if TYPE_CHECKING:
    import xgrammar as xgr

    from brisk.structured.matcher import Matcher


class GrammarCompileError(ValueError):
    """xgrammar's reason a grammar does not compile, with no request field in it: a cached compile is shared by
    requests that gave the same grammar in different fields (structured_outputs, guided_regex...)."""

    def naming(self, param: str) -> InvalidRequest:
        return InvalidRequest(param, f"invalid {param}: {self}")


@dataclass(eq=False)
class GrammarState:
    """One completion's grammar: compiling (future pending), then followed by its matcher. n > 1 siblings share
    the future (one compile) and each gets its own matcher."""

    future: Future[xgr.CompiledGrammar]
    deadline: float  # time.monotonic() after which a compile still running fails the request
    matcher: Matcher | None = None
    failed: str | None = field(default=None)  # the compile's error, once known

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def advance(self, token_ids: Iterable[int]) -> bool | None:
        """Accept the request's new tokens. True: the grammar terminated (the request is complete); None: a token
        the grammar refused (the mask was not applied to it: a bug, the request ends with an error)."""
        matcher = self.matcher
        assert matcher is not None  # a request is scheduled only once its matcher exists
        for token in token_ids:
            if not matcher.accept_token(token):
                return None
            if matcher.is_terminated():
                return True
        return False

    def valid_prefix(self, draft_ids: list[int]) -> list[int]:
        """The longest prefix of a request's drafts (speculative decoding) its grammar allows and that leaves it
        unfinished; the matcher is left where it was."""
        matcher = self.matcher
        assert matcher is not None
        accepted = 0
        for token in draft_ids:
            if not matcher.accept_token(token):
                break
            accepted += 1
            if matcher.is_terminated():  # the request would end at this draft: it is sampled as the next token
                break
        keep = accepted - (accepted > 0 and matcher.is_terminated())
        if accepted:
            matcher.rollback(accepted)
        return draft_ids[:keep]
