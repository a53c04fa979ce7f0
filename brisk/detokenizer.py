"""Incremental detokenization of one request's output, with stop strings.

Text is decoded with the prefix_offset/read_offset algorithm (as in vLLM and `tokenizers.decoders.DecodeStream`):
each step decodes a short window of recent token ids twice, once without and once with the new tokens, and the
new text is the difference. Decoding a window instead of single tokens keeps tokenizer-specific context right
(byte-level BPE bytes that only form a character together, sentencepiece's leading-space rule); a window that
decodes to text ending in U+FFFD is an incomplete UTF-8 sequence, so it is held back until a later token
completes it. We implement the algorithm ourselves rather than use `DecodeStream` because finishing a request
needs the pending bytes flushed, and `DecodeStream` does not expose them.

Byte-level BPE tokenizers (GPT-2's alphabet: gpt-oss's o200k, Llama 3, Qwen) need no window: each id stands for
fixed bytes, and decode(ids) is those bytes concatenated and decoded as UTF-8 with replacement. For them a request
keeps an incremental UTF-8 decoder and each token costs a table lookup and a decode of its few bytes (`TokenBytes`),
which gives the same text as the window algorithm (tests/test_detokenizer.py checks the table against `decode` for
every id of the bundled and the o200k tokenizers).

Stop strings: the text is searched after each token; on a hit the output is truncated before the stop string
(after it with `include_stop_str_in_output`). Text that might be the start of a stop string is held back from
the deltas until the following text rules the stop string in or out, and `flush()` releases it at the end.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from transformers import PreTrainedTokenizerBase

from brisk.sampling_params import SamplingParams

# How many trailing prompt tokens are decoded with the first output tokens, so that e.g. a sentencepiece
# tokenizer keeps the space at the start of the output (the same value as vLLM).
PROMPT_CONTEXT_TOKENS = 5
# What byte-level decoders (and Python's errors="replace") put in place of an incomplete UTF-8 sequence.
REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerUpdate:
    text_delta: str  # new text that is final: never retracted, never half of a character or of a stop string
    stop_reason: str | None = None  # the stop string that ended the request in this update, if any


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in (`bytes_to_unicode`
    in GPT-2's encoder and in `tokenizers`): printable bytes stand for themselves, the others for U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


class TokenBytes:
    """The bytes each id of a byte-level BPE tokenizer decodes to, looked up once per id.

    The `tokenizers` ByteLevel decoder maps each token's characters through the alphabet above (a token with a
    character outside it, such as an added token's text, stands for its own UTF-8 bytes), joins the bytes of all
    tokens and decodes them as UTF-8 with replacement; skipped special tokens and unknown ids add nothing."""

    def __init__(self, backend, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._alphabet = {c: b for b, c in byte_level_alphabet().items()}
        added = backend.get_added_tokens_decoder()
        self._skipped = {i for i, token in added.items() if token.special} if skip_special_tokens else set()
        self._bytes: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = self._lookup(token_id)
        return data

    def _lookup(self, token_id: int) -> bytes:
        token = self._backend.id_to_token(token_id)
        if token is None or token_id in self._skipped:
            return b""
        alphabet = self._alphabet
        if all(c in alphabet for c in token):
            return bytes(alphabet[c] for c in token)
        return token.encode()


class BytesToText:
    """The text of a byte-level tokenizer's tokens as they come: each id's bytes (TokenBytes) through one incremental
    UTF-8 decoder, which holds an incomplete character back until its last byte arrives. Shared by the
    detokenizer and the harmony parser's message bodies."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_ids: Sequence[int]) -> str:
        token_bytes = self._token_bytes
        data = token_bytes(token_ids[0]) if len(token_ids) == 1 else b"".join(map(token_bytes, token_ids))
        return self._utf8.decode(data)

    def flush(self) -> str:
        """The bytes still held, as U+FFFD; the decoder starts afresh."""
        return self._utf8.decode(b"", final=True)


class TokenDecoder:
    """`ids -> text` of one tokenizer with one skip_special_tokens setting, shared by the detokenizers of a front
    end. Single tokens' texts are cached: past its first step a request's decoding window is its last emitted
    token and the new one, and the next window's prefix is that new token alone, so half the decodes of a
    stream are of single tokens. (Decoding the windows of all requests of a step in one `decode_batch` call was
    measured no cheaper in CPU time than one call each: the Rust side spreads a batch over threads.)"""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        self.decode = _decode_function(tokenizer, skip_special_tokens)
        self._single: dict[int, str] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
        # None: the tokenizer's tokens are decoded in windows (IncrementalDetokenizer)
        self.token_bytes = TokenBytes(backend, skip_special_tokens) if byte_level else None

    def decode_window(self, ids: list[int]) -> str:
        if len(ids) != 1:
            return self.decode(ids)
        text = self._single.get(ids[0])
        if text is None:
            text = self._single[ids[0]] = self.decode(ids)
        return text


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, stopping on `params.stop` strings.

    `output_text` is all the text decoded so far (truncated at a stop string); it may run ahead of the deltas
    by the text held back as a possible stop string start. After a stop string is hit (`stop_reason` is set)
    or `flush()` is called, further tokens are ignored.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        decoder: TokenDecoder | None = None,
    ) -> None:
        self.decoder = decoder or TokenDecoder(tokenizer, params.skip_special_tokens)
        self._stops = tuple(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens

        # The decoding window is _token_ids; the text of _token_ids[:_read_offset] has been emitted already and is
        # _prefix_text. Only a few prompt tokens are kept, as context.
        self._token_ids: list[int] = list(prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS) :])
        self._read_offset = len(self._token_ids)
        self._prefix_text = self.decoder.decode(self._token_ids)
        # A byte-level tokenizer's tokens are decoded by their bytes (see the module's docstring), unless the prompt
        # ends inside a character: then the window keeps that character's first bytes with the output's.
        token_bytes = self.decoder.token_bytes
        self._by_bytes: BytesToText | None = None
        if token_bytes is not None and not self._prefix_text.endswith(REPLACEMENT_CHAR):
            self._by_bytes = BytesToText(token_bytes)

        self.output_token_ids: list[int] = []
        # The text so far is "".join(_emitted) + _unsent: what was returned as deltas, and what was decoded but
        # not returned yet (held back as a possible stop string start); kept apart so that a long output is not
        # copied at every token.
        self._emitted: list[str] = []
        self._unsent = ""
        self.stop_reason: str | None = None
        self.finished = False

    @property
    def output_text(self) -> str:
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return (self._emitted[0] if self._emitted else "") + self._unsent

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Add newly generated tokens; return the text that became final and the stop string if one was hit."""
        if self.finished:
            return DetokenizerUpdate("")
        if self._by_bytes is not None:
            return self._update_by_bytes(self._by_bytes, new_token_ids)
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self._token_ids.append(token_id)
            if self._add_token_text(self.decoder.decode(self._token_ids)):
                return DetokenizerUpdate(self._take_delta(hold_back=0), self.stop_reason)
        return DetokenizerUpdate(self._take_delta(hold_back=self._possible_stop_start_len()))

    def _update_by_bytes(self, by_bytes: BytesToText, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        if not self._stops:  # nothing to search or hold back: the new bytes' text is the delta (the common case)
            self.output_token_ids += new_token_ids
            text = by_bytes.add(new_token_ids)
            if text:
                self._emitted.append(text)
            return DetokenizerUpdate(text)
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            text = by_bytes.add((token_id,))
            if text and self._add_text(text):
                return DetokenizerUpdate(self._take_delta(hold_back=0), self.stop_reason)
        return DetokenizerUpdate(self._take_delta(hold_back=self._possible_stop_start_len()))

    def flush(self) -> str:
        """Finish the request: return the text still held back, incomplete characters included (as U+FFFD)."""
        if self.finished:
            return ""
        if self._by_bytes is not None:
            self._add_text(self._by_bytes.flush())
        else:
            window_text = self.decoder.decode(self._token_ids)
            self._add_text(window_text[len(self._prefix_text) :])
        self.finished = True
        return self._take_delta(hold_back=0)

    def _add_token_text(self, window_text: str) -> bool:
        """Take the decoded window of the token just added; True if a stop string was hit."""
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return False  # nothing new yet, or it ends in an incomplete character: wait for the next token
        new_text = window_text[len(self._prefix_text) :]
        # The text just emitted becomes the next window's prefix; older ids are no longer needed.
        del self._token_ids[: self._read_offset]
        self._read_offset = len(self._token_ids)
        self._prefix_text = self.decoder.decode_window(self._token_ids)
        return self._add_text(new_text)

    def _add_text(self, new_text: str) -> bool:
        """Append decoded text; on the earliest stop string that ends in it, truncate there and return True."""
        text_end_before = len(self._unsent)
        self._unsent += new_text
        # Like vLLM, stop strings do not count while the output is within min_tokens.
        if not self._stops or len(self.output_token_ids) <= self._min_tokens:
            return False
        # A stop string cannot start in emitted text: text that could begin one is held back (in _unsent).
        hit: tuple[int, str] | None = None
        for stop in self._stops:
            position = self._unsent.find(stop, max(0, text_end_before - len(stop) + 1))
            if position != -1 and (hit is None or position < hit[0]):
                hit = (position, stop)
        if hit is None:
            return False
        position, stop = hit
        self._unsent = self._unsent[: position + len(stop) if self._include_stop else position]
        self.stop_reason = stop
        self.finished = True
        return True

    def _possible_stop_start_len(self) -> int:
        """Length of the longest end of the unsent text that is the beginning (not all) of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._unsent)), longest, -1):
                if self._unsent.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _take_delta(self, hold_back: int) -> str:
        """The unsent text but its last `hold_back` characters; marks it emitted."""
        if not self._unsent:
            return ""
        end = len(self._unsent) - hold_back
        if end <= 0:
            return ""
        delta, self._unsent = self._unsent[:end], self._unsent[end:]
        self._emitted.append(delta)
        return delta


def _decode_function(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A fast `ids -> text` function for `tokenizer`, without the (not prefix-stable) clean-up of spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Straight to the Rust tokenizer: the Python wrapper's per-call overhead dominates for short windows.
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    # one sequence of ids decodes to one string (transformers types the result for batches too)
    return lambda ids: cast(
        str, tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    )
