"""Incremental decoding of one message's tokens, safe for characters split across byte-level BPE tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from brisk.detokenizer import BytesToText

# What byte-level decoders put in place of an incomplete UTF-8 sequence.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalText:
    """Text of a growing token sequence, released as soon as it is complete.

    The prefix_offset/read_offset algorithm (as in vLLM and brisk.detokenizer): each token decodes a short
    window of recent ids with and without it; the difference is new text unless it ends in U+FFFD, an
    incomplete character, which is held back until a later token completes it or `flush()` gives up on it.
    With `token_bytes` (a byte-level BPE tokenizer's id -> bytes, brisk.detokenizer.TokenBytes) each token's bytes
    go through one incremental UTF-8 decoder instead, which gives the same text for a fraction of the cost.
    The concatenation of everything `add` and `flush` return is the decode of all tokens.
    """

    def __init__(
        self, decode: Callable[[Sequence[int]], str], token_bytes: Callable[[int], bytes] | None = None
    ) -> None:
        self._decode = decode
        self._by_bytes = BytesToText(token_bytes) if token_bytes is not None else None
        # The decoding window: _ids[:_read_offset] (whose text, _prefix_text, is out already) and the ids after.
        self._ids: list[int] = []
        self._read_offset = 0
        self._prefix_text = ""

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completed ("" while a character is incomplete)."""
        if self._by_bytes is not None:
            return self._by_bytes.add((token_id,))
        self._ids.append(token_id)
        window_text = self._decode(self._ids)
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = window_text[len(self._prefix_text) :]
        # The ids just released become the next window's prefix (decoding context); older ids are not needed.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text

    def flush(self) -> str:
        """The text still held back (incomplete characters as U+FFFD); the sequence is finished."""
        if self._by_bytes is not None:
            return self._by_bytes.flush()
        new_text = self._decode(self._ids)[len(self._prefix_text) :]
        self._ids, self._read_offset, self._prefix_text = [], 0, ""
        return new_text
