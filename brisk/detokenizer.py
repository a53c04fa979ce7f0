"""Incremental detokenization of one request's output, with stop strings.

Text is decoded with the prefix_offset/read_offset algorithm (as in vLLM and `tokenizers.decoders.DecodeStream`):
each step decodes a short window of recent token ids twice, once without and once with the new tokens, and the
new text is the difference. Decoding a window instead of single tokens keeps tokenizer-specific context right
(byte-level BPE bytes that only form a character together, sentencepiece's leading-space rule); a window that
decodes to text ending in U+FFFD is an incomplete UTF-8 sequence, so it is held back until a later token
completes it. We implement the algorithm ourselves rather than use `DecodeStream` because finishing a request
needs the pending bytes flushed, and `DecodeStream` does not expose them.

Stop strings: the text is searched after each token; on a hit the output is truncated before the stop string
(after it with `include_stop_str_in_output`). Text that might be the start of a stop string is held back from
the deltas until the following text rules the stop string in or out, and `flush()` releases it at the end.
"""

from __future__ import annotations

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


class TokenDecoder:
    """`ids -> text` of one tokenizer with one skip_special_tokens setting, shared by the detokenizers of a front
    end. Single tokens' texts are cached: past its first step a request's decoding window is its last emitted
    token and the new one, and the next window's prefix is that new token alone, so half the decodes of a
    stream are of single tokens. (Decoding the windows of all requests of a step in one `decode_batch` call was
    measured no cheaper in CPU time than one call each: the Rust side spreads a batch over threads.)"""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        self.decode = _decode_function(tokenizer, skip_special_tokens)
        self._single: dict[int, str] = {}
        # A byte-level decoder turns ids into bytes, then bytes into text: text decoded up to a character boundary
        # is a prefix of the text decoded with more tokens, so several new tokens can be decoded as one.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"

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
        if len(new_token_ids) > 1 and self.decoder.byte_level and self._add_tokens_at_once(new_token_ids):
            return DetokenizerUpdate(self._take_delta(hold_back=self._possible_stop_start_len()))
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self._token_ids.append(token_id)
            if self._add_token_text(self.decoder.decode(self._token_ids)):
                return DetokenizerUpdate(self._take_delta(hold_back=0), self.stop_reason)
        return DetokenizerUpdate(self._take_delta(hold_back=self._possible_stop_start_len()))

    def flush(self) -> str:
        """Finish the request: return the text still held back, incomplete characters included (as U+FFFD)."""
        if self.finished:
            return ""
        window_text = self.decoder.decode(self._token_ids)
        self._add_text(window_text[len(self._prefix_text) :])
        self.finished = True
        return self._take_delta(hold_back=0)

    def _add_tokens_at_once(self, new_token_ids: Sequence[int]) -> bool:
        """Several tokens, one decode: the same text as adding them one by one, when the text they complete ends
        on a whole character and holds no stop string (then token by token changes nothing but the windows).
        False, and nothing changed, otherwise: the caller goes token by token."""
        window = self._token_ids + list(new_token_ids)
        window_text = self.decoder.decode(window)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return False
        new_text = window_text[len(self._prefix_text) :]
        if self._stops:
            recent = self._unsent + new_text
            if any(stop in recent for stop in self._stops):
                return False  # where a stop string ends decides which tokens are output: found token by token
        self.output_token_ids += new_token_ids
        # As if the last token's window were the one emitted: the next window is the last token and the one after.
        self._token_ids = window[-1:]
        self._read_offset = 1
        self._prefix_text = self.decoder.decode_window(self._token_ids)
        self._unsent += new_text
        return True

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
