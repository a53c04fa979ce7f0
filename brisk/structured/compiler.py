"""Grammar compilation off the step loop: a thread pool, a cache keyed by the spec's hash, a time limit.

One GrammarCompiler per model (it holds the tokenizer's xgrammar TokenizerInfo, built once, with the model's
vocab size, which may exceed the tokenizer's). The server compiles at request validation (`compile`, waits up to
the time limit, so a bad schema is a synchronous 400); the engine may instead `submit` and keep the request in a
compiling state until the future is done, without blocking the step.

On a harmony model the table spells every special token of the tokenizer as no text: xgrammar would otherwise
match the token `<|end|>` as seven characters inside a JSON string or a reasoning body, where the harmony parser
reads it as structure. Such a token's spelling starts with byte 0xFF, which no UTF-8 text contains, so only the
grammar's `TokenFormat`s (by id) can produce it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import xgrammar as xgr

from brisk.errors import InvalidRequest
from brisk.harmony.parser import HarmonySpecialTokens
from brisk.structured.grammars import compiler_message, structural_tag
from brisk.structured.matcher import Matcher
from brisk.structured.spec import StructuredOutputs
from brisk.structured.state import GrammarCompileError

# the byte-level spelling of byte 0xFF (GPT-2's byte-to-unicode table keeps bytes 0xAE..0xFF as themselves)
_NOT_TEXT = "\u00ff"


class GrammarCompiler:
    """Compiles StructuredOutputs into xgrammar grammars for one tokenizer and model.

    harmony: the model speaks harmony (gpt-oss): the grammar is the assistant's turn, its message structure
    constrained, reasoning free, the final answer and strict tools' arguments constrained (grammars.py).
    compile_timeout_s: a grammar not compiled within it is a 400 (the compile itself cannot be interrupted; it
    finishes in its worker and its result is cached). cache_size: compiled grammars kept (least recently used
    dropped). JSON is compact unless a spec says disable_any_whitespace false; max_json_whitespace: then the longest
    whitespace run JSON output may hold (indentation included), bounded so that a model cannot loop on whitespace
    until max_tokens (a known failure of unbounded JSON grammars), None for unbounded. stop_token_ids (other models): the ids that end a grammar (None: the tokenizer's eos); a
    harmony grammar ends with harmony's own terminators."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        harmony: bool = False,
        stop_token_ids: list[int] | None = None,
        compile_timeout_s: float = 10.0,
        max_workers: int = 2,
        cache_size: int = 256,
        max_json_whitespace: int | None = 32,
    ) -> None:
        self.harmony = harmony
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.max_json_whitespace = max_json_whitespace
        self.harmony_ids: HarmonySpecialTokens | None = None
        self._assistant_ids: list[int] = []
        if harmony:
            self.tokenizer_info, self.harmony_ids = _harmony_tokenizer_info(tokenizer, vocab_size)
            self._assistant_ids = list(tokenizer.encode("assistant", add_special_tokens=False))
        else:
            self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
            )
        # brisk keys its own cache by the spec; xgrammar's cache would key the same grammars a second time
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="brisk-grammar")
        self._cache: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def submit(self, spec: StructuredOutputs) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar's future (cached by the spec's hash). Shape errors found before compiling
        (unsupported keywords, bad JSON text) raise InvalidRequest here; compiler errors come from the future
        as GrammarCompileError (cached with it, so each request names its own field: `naming`)."""
        tag = structural_tag(spec, self.harmony_ids, self.max_json_whitespace)  # cheap checks, synchronous
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, tag)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """Compile (or fetch) now, waiting at most compile_timeout_s; InvalidRequest on any failure."""
        future = self.submit(spec)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise self.timeout_error(spec) from None
        except GrammarCompileError as error:
            raise error.naming(spec.param) from None

    def timeout_error(self, spec: StructuredOutputs) -> InvalidRequest:
        return InvalidRequest(
            spec.param, f"the grammar took longer than {self.compile_timeout_s:g} s to compile; simplify the schema."
        )

    def matcher(
        self, compiled: xgr.CompiledGrammar, spec: StructuredOutputs | None = None, prompt: list[int] | None = None
    ) -> Matcher:
        """A matcher at the start of the output. A harmony grammar ends with harmony's terminator, so the matcher
        terminates there (no further stop token). Given the request's `spec` and `prompt`, a harmony grammar
        (the assistant's turn) first accepts what the prompt already holds of the turn after its last
        `<|start|>assistant` (e.g. `<|channel|>analysis<|message|>`); InvalidRequest if that does not fit."""
        matcher = Matcher(compiled, terminate_without_stop_token=self.harmony)
        if not self.harmony or spec is None or spec.from_start or not prompt:
            return matcher
        opened = self._turn_opened(prompt)
        if opened:
            if matcher.accept_tokens(opened) < len(opened) or matcher.is_terminated():
                raise InvalidRequest(
                    spec.param,
                    "the prompt ends inside an assistant message that the structured output's harmony format "
                    "cannot continue (end the prompt with <|start|>assistant).",
                )
        return matcher

    def _turn_opened(self, prompt: list[int]) -> list[int]:
        """The tokens of the assistant's turn the prompt already holds: those after its last `<|start|>assistant`
        (none when the last message start is not the assistant's)."""
        assert self.harmony_ids is not None
        start = self.harmony_ids.start
        last = next((i for i in range(len(prompt) - 1, -1, -1) if prompt[i] == start), None)
        if last is None:
            return []
        role_end = last + 1 + len(self._assistant_ids)
        if prompt[last + 1 : role_end] != self._assistant_ids:
            return []
        return prompt[role_end:]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, tag: Any) -> xgr.CompiledGrammar:
        try:
            return self._compiler.compile_structural_tag(tag)
        except Exception as error:  # xgrammar raises RuntimeError/ValueError/its own types with the reason
            raise GrammarCompileError(compiler_message(error)) from None


def _harmony_tokenizer_info(tokenizer: Any, vocab_size: int) -> tuple[xgr.TokenizerInfo, HarmonySpecialTokens]:
    """xgrammar's table for a harmony tokenizer, every special token spelled as no text (see the module
    docstring), and the ids of harmony's structural tokens."""
    harmony = HarmonySpecialTokens.from_tokenizer(tokenizer)  # ValueError naming what a tokenizer lacks
    special = {int(i) for i, added in tokenizer.added_tokens_decoder.items() if added.special and i < vocab_size}
    # xgrammar needs a stop token; the matcher terminates at harmony's own terminators without one, so any
    # special token that is no structural token (it can never be sampled under the grammar) serves
    stop = min(special - set(vars(harmony).values()), default=None)
    if stop is None:
        raise ValueError("the harmony tokenizer has no special token besides harmony's own")
    encoded = [""] * vocab_size
    for text, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            encoded[token_id] = _NOT_TEXT + text if token_id in special else text
    spaced = tokenizer.encode(" assistant", add_special_tokens=False)[0]
    if not encoded[spaced].startswith("\u0120"):  # byte-level BPE spells a leading space "Ġ"
        raise ValueError("harmony structured outputs need a byte-level BPE tokenizer (as o200k_harmony is)")
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=stop)
    return info, harmony
