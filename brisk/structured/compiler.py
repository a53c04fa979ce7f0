"""Grammar compilation off the step loop: a thread pool, a cache keyed by the spec's hash, a time limit.

One GrammarCompiler per model (it holds the tokenizer's xgrammar TokenizerInfo, built once, with the model's
vocab size, which may exceed the tokenizer's). The server compiles at request validation (`compile`, waits up to
the time limit, so a bad schema is a synchronous 400); the engine may instead `submit` and keep the request in a
compiling state until the future is done, without blocking the step.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import xgrammar as xgr

from brisk.sampling_params import InvalidRequest
from brisk.structured.grammars import HARMONY_STOP_TOKENS, structural_tag
from brisk.structured.matcher import Matcher
from brisk.structured.spec import StructuredOutputs

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "; the rest is the message users need
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


def compiler_message(error: BaseException) -> str:
    """xgrammar's error text without the C++ source location."""
    return _CPP_PREFIX.sub("", str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)


class GrammarCompiler:
    """Compiles StructuredOutputs into xgrammar grammars for one tokenizer and model.

    harmony: the model speaks harmony (gpt-oss): reasoning stays free, the constraint starts at the final
    channel or a strict tool's call header. compile_timeout_s: a grammar not compiled within it is a 400 (the
    compile itself cannot be interrupted; it finishes in its worker and its result is cached). cache_size:
    compiled grammars kept (least recently used dropped). max_json_whitespace: the longest whitespace run
    JSON output may hold (indentation included); bounded so that a model cannot loop on whitespace until
    max_tokens (a known failure of unbounded JSON grammars), None for unbounded."""

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
        if harmony and stop_token_ids is None:
            stop_token_ids = [int(tokenizer.convert_tokens_to_ids(token)) for token in HARMONY_STOP_TOKENS]
        self.harmony = harmony
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.max_json_whitespace = max_json_whitespace
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
        as InvalidRequest."""
        tag = structural_tag(spec, self.harmony, self.max_json_whitespace)  # cheap checks, synchronous
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, tag, spec.param)
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

    def timeout_error(self, spec: StructuredOutputs) -> InvalidRequest:
        return InvalidRequest(
            spec.param, f"the grammar took longer than {self.compile_timeout_s:g} s to compile; simplify the schema."
        )

    def matcher(self, compiled: xgr.CompiledGrammar) -> Matcher:
        return Matcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, tag: Any, param: str) -> xgr.CompiledGrammar:
        try:
            return self._compiler.compile_structural_tag(tag)
        except Exception as error:  # xgrammar raises RuntimeError/ValueError/its own types with the reason
            raise InvalidRequest(param, f"invalid {param}: {compiler_message(error)}") from None
