"""Structured outputs on the engine side: grammar state lives with the scheduler's requests (as in vLLM v1).

EngineCore owns one StructuredOutputManager. `submit` starts a request's compile in a thread (the request
waits in the scheduler, skipped, until `poll` finds its future done: a compile never blocks the step loop);
`fill_bitmasks` writes one token bitmask per constrained sampled row into a persistent buffer and attaches it to
the step's SchedulerOutput (every rank gets it; the runner applies it to those rows' logits before sampling);
the scheduler advances each request's matcher by its new tokens (`GrammarState.advance`, structured/state.py); the
runner masks the logits (`GrammarBitmaskApplier`, structured/matcher.py).

The tokenizer and its xgrammar table are built on the first structured request (seconds for a 200k vocabulary),
in the compile thread like the grammars.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from brisk.errors import InvalidRequest
from brisk.structured.matcher import allocate_bitmask
from brisk.structured.spec import StructuredOutputs
from brisk.structured.state import GrammarCompileError, GrammarState

if TYPE_CHECKING:
    import xgrammar as xgr

    from brisk.scheduler.output import SchedulerOutput
    from brisk.scheduler.request import Request
    from brisk.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    """The engine's grammar compiler, the compiles in flight and the bitmask buffer of the step."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        model_type: str,
        eos_token_ids: list[int],
        compile_timeout_s: float,
        max_json_whitespace: int | None = 32,
        *,
        tokenizer: Any = None,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.model_type = model_type
        self.eos_token_ids = list(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.max_json_whitespace = max_json_whitespace
        self.tokenizer = tokenizer  # None: loaded from tokenizer_path when the first grammar is compiled
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        # Waits for the compiler's own pool (its futures are shared through its cache); 2 threads, like it.
        self._pool: ThreadPoolExecutor | None = None
        self.pending: list[Request] = []  # compiling, in arrival order
        self._bitmask = allocate_bitmask(0, vocab_size)  # grown to the largest constrained batch seen

    # ---- compiling ----------------------------------------------------------------------------
    def compiler(self) -> GrammarCompiler:
        """The model's GrammarCompiler (built on first use; thread-safe)."""
        with self._compiler_lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                from brisk.harmony.chat import is_harmony_model
                from brisk.structured.compiler import GrammarCompiler

                tokenizer = self.tokenizer or AutoTokenizer.from_pretrained(self.tokenizer_path)
                harmony = is_harmony_model(self.model_type, tokenizer)
                self._compiler = GrammarCompiler(
                    tokenizer,
                    self.vocab_size,
                    harmony=harmony,
                    # the model's own stop ids end a grammar (harmony: <|return|> and <|call|>)
                    stop_token_ids=None if harmony else (self.eos_token_ids or None),
                    compile_timeout_s=self.compile_timeout_s,
                    max_json_whitespace=self.max_json_whitespace,
                )
            return self._compiler

    def submit(self, spec: StructuredOutputs) -> GrammarState:
        """Start compiling `spec` off the step loop; the state is ready once `poll` saw its future done."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="brisk-grammar-wait")
        future = self._pool.submit(self._compile, spec)
        return GrammarState(future, time.monotonic() + self.compile_timeout_s)

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        compiler = self.compiler()
        return compiler.submit(spec).result()  # the compiler's cache shares one compile between requests

    def track(self, requests: Iterable[Request]) -> None:
        self.pending.extend(requests)

    def poll(self, block: bool = False) -> list[tuple[Request, InvalidRequest]]:
        """Give each request whose compile finished its matcher; returns (request, why it is refused) for those
        whose compile failed or ran past the time limit. block: wait (briefly) for a compile to finish, for an engine
        that has nothing else to do."""
        if block and self.pending:
            futures = {req.grammar.future for req in self.pending if req.grammar is not None}
            remaining = min(req.grammar.deadline for req in self.pending if req.grammar is not None)
            wait(futures, timeout=max(0.0, min(0.05, remaining - time.monotonic())), return_when=FIRST_COMPLETED)
        failed: list[tuple[Request, InvalidRequest]] = []
        still: list[Request] = []
        now = time.monotonic()
        for req in self.pending:
            state = req.grammar
            if state is None or req.is_finished:
                continue
            spec = req.params.structured_outputs
            param = spec.param if spec is not None else "structured_outputs"
            if state.future.done():
                error = state.future.exception()
                if error is None:
                    try:  # harmony: the matcher takes up the assistant's turn where the prompt leaves it
                        state.matcher = self.compiler().matcher(
                            state.future.result(), req.params.structured_outputs, req.prompt_token_ids
                        )
                        continue
                    except InvalidRequest as refused:
                        error = refused
                if isinstance(error, GrammarCompileError):
                    error = error.naming(param)
                elif not isinstance(error, InvalidRequest):
                    error = InvalidRequest(param, f"grammar compile failed: {error}")
                failed.append((req, error))
            elif now > state.deadline:
                message = f"{param}: the grammar took longer than {self.compile_timeout_s:g} s to compile; simplify it."
                failed.append((req, InvalidRequest(param, message)))
            else:
                still.append(req)
        self.pending = still
        return failed

    # ---- each step ----------------------------------------------------------------------------
    def fill_bitmasks(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Attach to `sched` the bitmask rows of its constrained sampled requests (in sampled order). A request with
        drafts (speculative decoding; the scheduler kept only drafts its grammar allows) has a row per verified
        position: the matcher walks its drafts and is rolled back. A row whose grammar allows every token is left
        out: nothing to apply (harmony reasoning is not such a row: its special tokens are masked)."""
        drafts = sched.scheduled_spec_decode_tokens
        ids: list[str] = []
        num_rows = 0
        for rid in sched.sampled_req_ids:
            req = requests.get(rid)
            if req is not None and req.grammar is not None:
                ids.append(rid)
                num_rows += 1 + len(drafts.get(rid, ()))
        if not ids:
            return
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = allocate_bitmask(max(num_rows, 2 * self._bitmask.shape[0]), self.vocab_size)
        bitmask = self._bitmask
        kept: list[str] = []
        positions: list[int] = []
        for rid in ids:
            matcher = requests[rid].grammar.matcher  # type: ignore[union-attr]
            assert matcher is not None  # scheduled only once compiled
            walked = drafts.get(rid, ())
            for position in range(len(walked) + 1):
                if matcher.fill_bitmask(bitmask, len(kept)):
                    kept.append(rid)
                    positions.append(position)
                if position < len(walked) and not matcher.accept_token(walked[position]):
                    raise AssertionError("a draft the scheduler checked against the grammar was refused")
            if walked:
                matcher.rollback(len(walked))
        if kept:
            sched.grammar_req_ids = kept
            sched.grammar_bitmask = bitmask[: len(kept)].numpy().tobytes()
            if any(positions):
                sched.grammar_positions = positions

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:
            self._compiler.close()
