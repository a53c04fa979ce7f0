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


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, stopping on `params.stop` strings.

    `output_text` is all the text decoded so far (truncated at a stop string); it may run ahead of the deltas
    by the text held back as a possible stop string start. After a stop string is hit (`stop_reason` is set)
    or `flush()` is called, further tokens are ignored.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._decode = _decode_function(tokenizer, params.skip_special_tokens)
        self._stops = tuple(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens

        # The decoding window is _token_ids[_prefix_offset:]; the text of _token_ids[_prefix_offset:_read_offset]
        # has been emitted already and is _prefix_text. Only a few prompt tokens are kept, as context.
        self._token_ids: list[int] = list(prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS) :])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)

        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False
        self._num_emitted_chars = 0  # output_text[:_num_emitted_chars] has been returned as deltas

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Add newly generated tokens; return the text that became final and the stop string if one was hit."""
        if self.finished:
            return DetokenizerUpdate("")
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self._token_ids.append(token_id)
            text_end_before = len(self.output_text)
            self.output_text += self._decode_new_text()
            if self._check_stop_strings(text_end_before):
                return DetokenizerUpdate(self._take_delta(hold_back=0), self.stop_reason)
        return DetokenizerUpdate(self._take_delta(hold_back=self._possible_stop_start_len()))

    def flush(self) -> str:
        """Finish the request: return the text still held back, incomplete characters included (as U+FFFD)."""
        if self.finished:
            return ""
        text_end_before = len(self.output_text)
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        self.output_text += window_text[len(self._prefix_text) :]
        self._check_stop_strings(text_end_before)
        self.finished = True
        return self._take_delta(hold_back=0)

    def _decode_new_text(self) -> str:
        """Text added by the tokens after _read_offset, or "" while it ends in an incomplete character."""
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = window_text[len(self._prefix_text) :]
        # The text just emitted becomes the next window's prefix; older ids are no longer needed.
        del self._token_ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)
        return new_text

    def _check_stop_strings(self, text_end_before: int) -> bool:
        """Truncate output_text at the earliest stop string that ends after `text_end_before`; True on a hit."""
        # Like vLLM, stop strings do not count while the output is within min_tokens.
        if not self._stops or len(self.output_token_ids) <= self._min_tokens:
            return False
        hit: tuple[int, str] | None = None
        for stop in self._stops:
            position = self.output_text.find(stop, max(0, text_end_before - len(stop) + 1))
            if position != -1 and (hit is None or position < hit[0]):
                hit = (position, stop)
        if hit is None:
            return False
        position, stop = hit
        self.output_text = self.output_text[: position + len(stop) if self._include_stop else position]
        self.stop_reason = stop
        self.finished = True
        return True

    def _possible_stop_start_len(self) -> int:
        """Length of the longest end of output_text that is the beginning (not all) of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self.output_text)), longest, -1):
                if self.output_text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _take_delta(self, hold_back: int) -> str:
        """The text between what was already emitted and the last `hold_back` characters; marks it emitted."""
        end = max(len(self.output_text) - hold_back, self._num_emitted_chars)
        delta = self.output_text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
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
