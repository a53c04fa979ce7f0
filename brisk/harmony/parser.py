"""A streaming parser of gpt-oss output (the harmony format): reasoning, content and tool calls from token ids.

The model continues the prompt's `<|start|>assistant`, so its output is a header, then messages:

    <|channel|>analysis<|message|>We need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>

A header is the text before `<|message|>`: a role (implicit in the first message), an optional recipient
`to=...` (after the role or after the channel), `<|channel|>` and a channel name, and a content type (`json`,
or `<|constrain|>json`). Messages end with `<|end|>`; `<|return|>` (final answer) and `<|call|>` (tool call)
end the output. Routing: `analysis` -> reasoning_content; `final` and `commentary` without a recipient (a
preamble) -> content; a `functions.NAME` recipient -> a tool call, the body being its arguments.

Malformed output never raises. What the parser cannot make sense of degrades to content, a warning is recorded
(and logged), and the parser carries on with the next message: output without any header is plain text, an
unknown or missing channel is content, a header that runs on without `<|message|>` is text, a message missing
its `<|end|>` is closed by the next `<|start|>` or `<|channel|>`, stray `<|message|>`/`<|constrain|>` tokens in
a body are dropped. Output cut off mid-message keeps the text so far; output cut off inside a header drops the
header (unless it does not look like one, then it is text). A header that never reaches `<|message|>` but opened
with a channel name ("<|channel|>analysis We need...") sends the rest to that channel.

Every token is handled the same way whatever the chunking of `feed` calls, and text reaches the result only
through the deltas, so concatenating all deltas (with `finish().last_delta`) gives exactly the final result.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from brisk.detokenizer import TokenDecoder
from brisk.harmony.results import HarmonyDelta, HarmonyResult, ToolCall, ToolCallDelta, make_tool_call_id_factory
from brisk.harmony.text import IncrementalText

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# A real header is a handful of tokens; past this many, the "header" is text that never reached <|message|>.
MAX_HEADER_TOKENS = 64
KNOWN_CHANNELS = ("analysis", "commentary", "final")
# Words a header is made of; a header containing other words (or their prefixes) is not a header.
HEADER_WORDS = (*KNOWN_CHANNELS, "assistant", "json")
FUNCTIONS_PREFIX = "functions."

# HarmonySpecialTokens field -> token text.
SPECIAL_TOKEN_TEXTS = MappingProxyType(
    {
        "start": "<|start|>",
        "end": "<|end|>",
        "message": "<|message|>",
        "channel": "<|channel|>",
        "constrain": "<|constrain|>",
        "return_": "<|return|>",
        "call": "<|call|>",
    }
)

REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "tool_call"  # where a message's text goes


@dataclass(frozen=True)
class HarmonySpecialTokens:
    """The ids of harmony's structural tokens in one tokenizer."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> HarmonySpecialTokens:
        ids: dict[str, Any] = {
            name: tokenizer.convert_tokens_to_ids(text) for name, text in SPECIAL_TOKEN_TEXTS.items()
        }
        missing = [
            text
            for name, text in SPECIAL_TOKEN_TEXTS.items()
            if ids[name] is None or tokenizer.convert_ids_to_tokens(ids[name]) != text
        ]
        if missing:
            raise ValueError(f"the tokenizer lacks harmony's special tokens {missing}")
        return cls(**ids)

    @property
    def stop_token_ids(self) -> tuple[int, int]:
        """<|return|> and <|call|>: the assistant's output ends at either (<|end|> only ends a message)."""
        return (self.return_, self.call)


@dataclass
class _Header:
    explicit: bool  # began with <|start|>, so its first word is the role (else the role is assistant)
    # (kind, text token ids) in order: "role" first, then a "channel" and/or "constrain" part per special token.
    parts: list[tuple[str, list[int]]] = field(default_factory=lambda: [("role", [])])
    num_tokens: int = 0

    def text_ids(self) -> list[int]:
        return [token for _, ids in self.parts for token in ids]

    def is_empty(self) -> bool:
        return not (self.explicit or self.num_tokens or len(self.parts) > 1)


@dataclass
class _Body:
    destination: str  # REASONING, CONTENT or TOOL_CALL
    text: IncrementalText
    tool_index: int = -1
    degraded: bool = False  # text that was meant to be a header; warned about already


class _DeltaBuilder:
    """Collects one feed()'s output, merging consecutive fragments of one tool call."""

    def __init__(self) -> None:
        self.delta = HarmonyDelta()

    def add_text(self, destination: str, text: str) -> None:
        if destination == REASONING:
            self.delta.reasoning_content += text
        else:
            self.delta.content += text

    def add_tool_call(self, fragment: ToolCallDelta) -> None:
        calls = self.delta.tool_calls
        if calls and calls[-1].index == fragment.index and fragment.id is None:
            calls[-1].arguments += fragment.arguments
        else:
            calls.append(fragment)


class HarmonyParser:
    """Parses one request's output token ids as they are generated; see the module docstring."""

    def __init__(
        self,
        special_tokens: HarmonySpecialTokens,
        decode: Callable[[Sequence[int]], str],
        *,
        tool_call_ids: Callable[[], str] | None = None,
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        """`decode` turns text token ids into text (byte-level BPE: it may end in U+FFFD mid-character);
        `token_bytes`, where the tokenizer is byte-level, each id's bytes (message bodies decode by them)."""
        self._tokens = special_tokens
        self._structural = frozenset(
            (special_tokens.start, special_tokens.end, special_tokens.message, special_tokens.channel)
            + (special_tokens.constrain, special_tokens.return_, special_tokens.call)
        )
        self._decode = decode
        self._token_bytes = token_bytes
        self._new_tool_call_id = tool_call_ids or make_tool_call_id_factory()
        # Exactly one of _header and _body is set while parsing; neither after <|end|> or once stopped.
        self._header: _Header | None = _Header(explicit=False)
        self._body: _Body | None = None
        self._stopped = False
        self._result: HarmonyResult | None = None
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._tool_calls: list[ToolCall] = []
        self._warnings: list[str] = []
        self._ended = False
        self._out = _DeltaBuilder()

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        *,
        tool_call_ids: Callable[[], str] | None = None,
        text_decoder: TokenDecoder | None = None,
    ) -> HarmonyParser:
        """`text_decoder`: the tokenizer's TokenDecoder without special tokens, shared by a server's requests (its
        byte table fills once); one of this parser's own otherwise."""
        # Other special tokens (<|endoftext|>, reserved ones) are not text.
        decoder = text_decoder or TokenDecoder(tokenizer, skip_special_tokens=True)
        decode = decoder.decode
        return cls(
            HarmonySpecialTokens.from_tokenizer(tokenizer),
            lambda token_ids: decode(list(token_ids)),
            tool_call_ids=tool_call_ids,
            token_bytes=decoder.token_bytes,
        )

    def feed(self, token_ids: Sequence[int], destinations: list[str | None] | None = None) -> HarmonyDelta:
        """Parse newly generated tokens; return the reasoning, content and tool call text they completed.

        `destinations`, if given, gets one entry per token: where its text goes (REASONING, CONTENT, TOOL_CALL),
        or None for a structural token (headers, special tokens): what chat logprobs report per field."""
        if self._result is not None:
            if destinations is not None:
                destinations.extend([None] * len(token_ids))
            return HarmonyDelta()
        structural = self._structural
        for token in token_ids:
            if destinations is not None:
                body = self._body
                text_token = body is not None and not self._stopped and token not in structural
                destinations.append(body.destination if text_token and body is not None else None)
            self._feed_token(token)
        return self._take_delta()

    def finish(self) -> HarmonyResult:
        """End of output: flush what is held back and return the whole result (the same on later calls)."""
        if self._result is not None:
            return self._result
        header, body = self._header, self._body
        # What is noted from here on is an output cut short, which max_tokens does as a matter of course: kept in
        # the result's warnings, logged at debug level only (a warning for every length-limited answer floods the log)
        self._ended = True
        if header is not None:
            self._abandon_header(header, "output ended inside a message header")
        elif body is not None:
            self._close_body(body)
            if not body.degraded:
                self._warn("output ended inside a message (the text so far is kept)")
        self._result = HarmonyResult(
            reasoning_content="".join(self._reasoning),
            content="".join(self._content),
            tool_calls=[ToolCall(call.id, call.name, call.arguments) for call in self._tool_calls],
            warnings=list(self._warnings),
            last_delta=self._take_delta(),
        )
        return self._result

    def parse(self, token_ids: Sequence[int]) -> HarmonyResult:
        """Non-streaming: the result of a whole output."""
        self.feed(token_ids)
        return self.finish()

    # Token handling, by state --------------------------------------------------------------------------------

    def _feed_token(self, token: int) -> None:
        if self._stopped:
            self._warn("tokens after <|return|> or <|call|> ignored")
        elif self._header is not None:
            self._header_token(self._header, token)
        elif self._body is not None:
            self._body_token(self._body, token)
        else:
            self._between_messages_token(token)

    def _between_messages_token(self, token: int) -> None:
        """After <|end|>, the next message must begin with <|start|>."""
        special = self._tokens
        if token == special.start:
            self._header = _Header(explicit=True)
        elif token in (special.return_, special.call):
            self._stopped = True
        elif token == special.end:
            self._warn("stray <|end|> between messages ignored")
        else:
            self._warn("message without <|start|>; role assistant assumed")
            self._header = _Header(explicit=False)
            self._header_token(self._header, token)

    def _header_token(self, header: _Header, token: int) -> None:
        special = self._tokens
        if token == special.message:
            self._open_body(header)
        elif token == special.channel:
            header.parts.append(("channel", []))
        elif token == special.constrain:
            header.parts.append(("constrain", []))
        elif token == special.start:
            self._abandon_header(header, "message header cut short by <|start|>")
            self._header = _Header(explicit=True)
        elif token == special.end:
            self._abandon_header(header, "message header ended by <|end|> without <|message|>")
        elif token in (special.return_, special.call):
            self._abandon_header(header, "message header ended the output without <|message|>")
            self._stopped = True
        else:
            header.parts[-1][1].append(token)
            header.num_tokens += 1
            if header.num_tokens > MAX_HEADER_TOKENS:
                self._header_as_text(header, f"no <|message|> within {MAX_HEADER_TOKENS} header tokens")
            elif (
                not header.explicit
                and len(header.parts) == 1
                and not _looks_like_header(self._decode(header.parts[0][1]))
            ):
                # What came instead of a header is text, not a recipient or a channel: there is no header.
                self._header_as_text(header, "output without a harmony header taken as text")

    def _body_token(self, body: _Body, token: int) -> None:
        special = self._tokens
        if token == special.end:
            self._close_body(body)
        elif token in (special.return_, special.call):
            self._close_body(body)
            self._stopped = True
        elif token == special.start:
            self._warn("message not ended before <|start|>")
            self._close_body(body)
            self._header = _Header(explicit=True)
        elif token == special.channel:
            self._warn("message not ended before <|channel|>; a new message assumed")
            self._close_body(body)
            self._header = _Header(explicit=False, parts=[("role", []), ("channel", [])])
        elif token in (special.message, special.constrain):
            self._warn("stray <|message|> or <|constrain|> inside a message dropped")
        else:
            self._emit(body, body.text.add(token))

    # Headers -----------------------------------------------------------------------------------------------

    def _open_body(self, header: _Header) -> None:
        """<|message|> ends the header: parse it and route the body that follows."""
        self._header = None
        words: dict[str, list[str]] = {kind: [] for kind in ("role", "channel", "constrain")}
        for kind, ids in header.parts:
            words[kind].extend(self._decode(ids).split())
        role = words["role"].pop(0) if header.explicit and words["role"] else "assistant"
        recipients = [w[3:] for w in words["role"] + words["channel"] if w.startswith("to=")]
        channels = [w for w in words["channel"] if not w.startswith("to=")][:1]
        if not any(kind == "channel" for kind, _ in header.parts):
            # "<|start|>assistant analysis<|message|>": a channel name without <|channel|>.
            channels = [w for w in words["role"] if w in KNOWN_CHANNELS][:1]
            if channels:
                self._warn(f"channel {channels[0]!r} given without <|channel|>")
        channel = channels[0] if channels else None
        if role != "assistant":
            self._warn(f"message from role {role!r} in the assistant's output")

        recipient = recipients[-1] if recipients else None
        if recipient and recipient.startswith(FUNCTIONS_PREFIX) and len(recipient) > len(FUNCTIONS_PREFIX):
            self._open_tool_call(recipient[len(FUNCTIONS_PREFIX) :])
            return
        if recipient is not None:
            # A built-in tool (browser, python) or nonsense: not a function the client offered, so not a tool call.
            self._warn(f"message to recipient {recipient!r} kept as reasoning")
            destination = REASONING
        elif channel == "analysis":
            destination = REASONING
        elif channel in ("final", "commentary"):
            destination = CONTENT
        else:
            what = "message without a channel" if channel is None else f"unknown channel {channel!r}"
            self._warn(f"{what} taken as content")
            destination = CONTENT
        self._body = _Body(destination, IncrementalText(self._decode, self._token_bytes))

    def _open_tool_call(self, name: str) -> None:
        index = len(self._tool_calls)
        call_id = self._new_tool_call_id()
        self._tool_calls.append(ToolCall(call_id, name, ""))
        self._out.add_tool_call(ToolCallDelta(index, call_id, name, ""))
        self._body = _Body(TOOL_CALL, IncrementalText(self._decode, self._token_bytes), tool_index=index)

    def _abandon_header(self, header: _Header, reason: str) -> None:
        """A header that ends without <|message|>: dropped if it looks like one, else its text is content."""
        self._header = None
        if header.is_empty():
            return
        if all(_looks_like_header(self._decode(ids)) for _, ids in header.parts):
            self._warn(f"{reason}; header dropped")
        else:
            self._close_body(self._header_as_text(header, f"{reason}; taken as text"))

    def _header_as_text(self, header: _Header, reason: str) -> _Body:
        """Degrade a header that never reached <|message|>: its text tokens become a message body.

        If it opened with a channel name ("<|channel|>analysis We need..."), the text after the name goes where
        that channel's text goes, so that reasoning does not leak into content; otherwise it all is content.
        Special tokens in it are dropped.
        """
        self._warn(reason)
        self._header = None
        channel_and_rest = self._split_channel_name(header)
        if channel_and_rest is None:
            destination, token_ids = CONTENT, header.text_ids()
        else:
            channel, token_ids = channel_and_rest
            destination = REASONING if channel == "analysis" else CONTENT
        body = self._body = _Body(destination, IncrementalText(self._decode, self._token_bytes), degraded=True)
        for token in token_ids:
            self._emit(body, body.text.add(token))
        return body

    def _split_channel_name(self, header: _Header) -> tuple[str, list[int]] | None:
        """(channel, the token ids after its name) for a header "[assistant]<|channel|>NAME text...", else None."""
        if [kind for kind, _ in header.parts] != ["role", "channel"]:
            return None
        if self._decode(header.parts[0][1]).split() not in ([], ["assistant"]):
            return None
        channel_ids = header.parts[1][1]
        for split in range(1, len(channel_ids)):
            # The name must end at a token boundary followed by whitespace ("final" of "finally" is no name).
            if self._decode(channel_ids[:split]).strip() in KNOWN_CHANNELS:
                if self._decode(channel_ids[split : split + 1])[:1].isspace():
                    return self._decode(channel_ids[:split]).strip(), channel_ids[split:]
                return None
        return None

    # Bodies and output --------------------------------------------------------------------------------------

    def _close_body(self, body: _Body) -> None:
        self._body = None
        self._emit(body, body.text.flush())
        if body.destination == TOOL_CALL:
            call = self._tool_calls[body.tool_index]
            try:
                json.loads(call.arguments)
            except ValueError:
                self._warn(f"tool call {call.name!r} has arguments that are not JSON")

    def _emit(self, body: _Body, text: str) -> None:
        if not text:
            return
        if body.destination == TOOL_CALL:
            self._tool_calls[body.tool_index].arguments += text
            self._out.add_tool_call(ToolCallDelta(body.tool_index, arguments=text))
        else:
            (self._reasoning if body.destination == REASONING else self._content).append(text)
            self._out.add_text(body.destination, text)

    def _take_delta(self) -> HarmonyDelta:
        delta, self._out = self._out.delta, _DeltaBuilder()
        return delta

    def _warn(self, message: str) -> None:
        if message not in self._warnings:  # once per output: a stuck model must not flood the log
            self._warnings.append(message)
            logger.log(logging.DEBUG if self._ended else logging.WARNING, "harmony output: %s", message)


def _looks_like_header(text: str) -> bool:
    """Whether `text` could be (the start of) a header: only recipients, channel names, roles, content types."""
    return all(
        word.startswith("to=") or "to=".startswith(word) or any(known.startswith(word) for known in HEADER_WORDS)
        for word in text.split()
    )
