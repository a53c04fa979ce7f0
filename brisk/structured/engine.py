"""Structured outputs on the engine side: grammar state lives with the scheduler's requests (as in vLLM v1).

EngineCore owns one StructuredOutputManager. `submit` starts a request's compile in a thread (the request
waits in the scheduler, skipped, until `poll` finds its future done: a compile never blocks the step loop);
`fill_bitmasks` writes one token bitmask per constrained sampled row into a persistent buffer and attaches it to
the step's SchedulerOutput (every rank gets it; the runner applies it to those rows' logits before sampling);
the scheduler advances each request's matcher by its new tokens (`GrammarState.advance`).

The tokenizer and its xgrammar table are built on the first structured request (seconds for a 200k vocabulary),
in the compile thread like the grammars.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from brisk.sampling_params import InvalidRequest
from brisk.structured.matcher import Matcher, allocate_bitmask
from brisk.structured.spec import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar as xgr

    from brisk.kernels.cpu_kernels import CpuKernels
    from brisk.scheduler.output import SchedulerOutput
    from brisk.scheduler.request import Request
    from brisk.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


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

    def poll(self, block: bool = False) -> list[tuple[Request, str]]:
        """Give each request whose compile finished its matcher; returns (request, error message) for those whose
        compile failed or ran past the time limit. block: wait (briefly) for a compile to finish, for an engine
        that has nothing else to do."""
        if block and self.pending:
            futures = {req.grammar.future for req in self.pending if req.grammar is not None}
            remaining = min(req.grammar.deadline for req in self.pending if req.grammar is not None)
            wait(futures, timeout=max(0.0, min(0.05, remaining - time.monotonic())), return_when=FIRST_COMPLETED)
        failed: list[tuple[Request, str]] = []
        still: list[Request] = []
        now = time.monotonic()
        for req in self.pending:
            state = req.grammar
            if state is None or req.is_finished:
                continue
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
                message = error.message if isinstance(error, InvalidRequest) else f"grammar compile failed: {error}"
                failed.append((req, message))
            elif now > state.deadline:
                spec = req.params.structured_outputs
                param = spec.param if spec is not None else "structured_outputs"
                failed.append(
                    (
                        req,
                        f"{param}: the grammar took longer than {self.compile_timeout_s:g} s to compile; simplify it.",
                    )
                )
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
        from brisk.structured.matcher import apply_token_bitmask

        threads = min(self.num_threads, len(rows) * covered // self.MIN_ELEMENTS_PER_THREAD)
        if self.cpu_kernels is not None and self.cpu_kernels.bitmask_accepts(logits, bitmask):
            self.cpu_kernels.apply_token_bitmask(logits, bitmask, rows, covered, max(1, threads))
            return
        if logits.is_cuda or threads <= 1:
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
