"""Tests for incremental detokenization: deltas must add up to the full decode, and stop strings must cut it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

import brisk
from brisk.detokenizer import IncrementalDetokenizer, TokenDecoder
from brisk.sampling_params import SamplingParams
from tests.tiny_tokenizer import IM_END_ID, IM_START_ID, make_tiny_tokenizer

VOCAB_SIZE = 512
MULTI_BYTE_TEXT = "你好，世界！😀🎉 café 👨‍👩‍👧 Straße ∑√∞"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"), vocab_size=VOCAB_SIZE)


def stream(
    detokenizer: IncrementalDetokenizer, token_ids: Sequence[int], chunk_size: int = 1
) -> tuple[list[str], str | None]:
    """Feed `token_ids` `chunk_size` at a time until a stop string hits; the deltas (flush last) and the stop."""
    deltas = []
    for start in range(0, len(token_ids), chunk_size):
        update = detokenizer.update(token_ids[start : start + chunk_size])
        deltas.append(update.text_delta)
        if update.stop_reason is not None:
            return deltas, update.stop_reason
    deltas.append(detokenizer.flush())
    return deltas, None


def test_tiny_tokenizer_splits_multi_byte_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    # The tests below only prove something if characters really are split across tokens.
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(MULTI_BYTE_TEXT)]
    assert any("\ufffd" in piece for piece in pieces)
    assert len(tokenizer) == VOCAB_SIZE


@pytest.mark.parametrize("chunk_size", [1, 2, 5])
def test_multi_byte_text_never_emits_half_characters(tokenizer: PreTrainedTokenizerFast, chunk_size: int) -> None:
    token_ids = tokenizer.encode(MULTI_BYTE_TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say hi:"), SamplingParams())
    deltas, stop = stream(detokenizer, token_ids, chunk_size)
    assert stop is None
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == detokenizer.output_text == MULTI_BYTE_TEXT
    if chunk_size == 1:
        assert "" in deltas  # some tokens only carried part of a character


def test_spaces_and_newlines_are_kept(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "Hello  world,\n\n  two   spaces\tand a tab "
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas, _ = stream(detokenizer, tokenizer.encode(text))
    assert "".join(deltas) == text


@settings(max_examples=200, deadline=None)
@given(
    token_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40),
    chunk_size=st.integers(1, 4),
    skip_special_tokens=st.booleans(),
    prompt=st.sampled_from(["", "Hello", "<|im_start|>assistant\n", "你好"]),
)
def test_deltas_add_up_to_decode_of_random_tokens(
    tokenizer: PreTrainedTokenizerFast, token_ids: list[int], chunk_size: int, skip_special_tokens: bool, prompt: str
) -> None:
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    deltas, _ = stream(detokenizer, token_ids, chunk_size)
    expected = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == detokenizer.output_text == expected


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=30))
def test_valid_text_streams_without_replacement_characters(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas, _ = stream(detokenizer, tokenizer.encode(text))
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas) or "\ufffd" in text


def test_skip_special_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = [*tokenizer.encode("Hi"), IM_END_ID, *tokenizer.encode(" there")]
    kept = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    assert "".join(stream(kept, token_ids)[0]) == "Hi<|im_end|> there"
    skipped = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=True))
    assert "".join(stream(skipped, token_ids)[0]) == "Hi there"


def test_incomplete_character_at_the_end_is_flushed(tokenizer: PreTrainedTokenizerFast) -> None:
    first_byte_of_cjk = tokenizer.encode("你")[0]
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert detokenizer.update([first_byte_of_cjk]).text_delta == ""
    assert detokenizer.flush() == tokenizer.decode([first_byte_of_cjk]) == "\ufffd"


TEXT = "The capital of France is Paris. How many"


@pytest.mark.parametrize("stop", ["Paris.", "is Paris", "France is P", "al of"])
def test_stop_string_spanning_tokens_truncates_output(tokenizer: PreTrainedTokenizerFast, stop: str) -> None:
    token_ids = tokenizer.encode(TEXT)
    pieces = [tokenizer.decode([t]) for t in token_ids]
    assert not any(stop in piece for piece in pieces)  # the stop string really spans several tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    deltas, stop_reason = stream(detokenizer, token_ids)
    assert stop_reason == stop == detokenizer.stop_reason
    assert "".join(deltas) == detokenizer.output_text == TEXT[: TEXT.index(stop)]
    # Once stopped, further tokens are ignored.
    assert detokenizer.update(token_ids[:3]).text_delta == "" and detokenizer.flush() == ""
    assert detokenizer.output_text == TEXT[: TEXT.index(stop)]


def test_include_stop_str_in_output(tokenizer: PreTrainedTokenizerFast) -> None:
    params = SamplingParams(stop=["Paris."], include_stop_str_in_output=True)
    detokenizer = IncrementalDetokenizer(tokenizer, [], params)
    deltas, stop_reason = stream(detokenizer, tokenizer.encode(TEXT))
    assert stop_reason == "Paris."
    assert "".join(deltas) == detokenizer.output_text == "The capital of France is Paris."


def test_earliest_stop_string_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["How", "France"]))
    deltas, stop_reason = stream(detokenizer, tokenizer.encode(TEXT), chunk_size=len(TEXT))  # all in one update
    assert stop_reason == "France"
    assert "".join(deltas) == "The capital of "


def test_stop_string_in_the_first_token(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = tokenizer.encode(" the quick")
    assert tokenizer.decode(token_ids[:1]) == " the"
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"), SamplingParams(stop=["he"]))
    update = detokenizer.update(token_ids[:1])
    assert (update.text_delta, update.stop_reason, detokenizer.output_text) == (" t", "he", " t")


def test_stop_strings_are_ignored_within_min_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    token_ids = tokenizer.encode(" the the")  # [" the", " the"]
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["the"], min_tokens=1))
    deltas, stop_reason = stream(detokenizer, token_ids)
    assert stop_reason == "the"
    assert "".join(deltas) == " the "


def test_possible_stop_string_start_is_held_back_then_released(tokenizer: PreTrainedTokenizerFast) -> None:
    stop = "Paris!"
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    emitted = ""
    held_back_texts = []
    for token_id in tokenizer.encode(TEXT):
        emitted += detokenizer.update([token_id]).text_delta
        text = detokenizer.output_text
        assert text.startswith(emitted)
        # Exactly the longest end of the text that could still grow into the stop string is held back.
        held_back = next((stop[:n] for n in range(len(stop) - 1, 0, -1) if text.endswith(stop[:n])), "")
        assert text[len(emitted) :] == held_back
        held_back_texts.append(held_back)
    assert "Paris" in held_back_texts
    assert "Paris." in emitted  # released once "." ruled "Paris!" out
    assert emitted + detokenizer.flush() == TEXT


def test_held_back_stop_prefix_is_flushed_at_the_end(tokenizer: PreTrainedTokenizerFast) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["Paris!"]))
    token_ids = tokenizer.encode("The capital is Par")
    emitted = "".join(detokenizer.update([t]).text_delta for t in token_ids)
    assert emitted == "The capital is "
    assert detokenizer.output_text == "The capital is Par"
    assert detokenizer.flush() == "Par"
    assert detokenizer.stop_reason is None


def test_prompt_tokens_are_not_part_of_the_output(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "hi"}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert prompt_ids[0] == IM_START_ID and prompt_ids.count(IM_START_ID) == 2
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    deltas, _ = stream(detokenizer, tokenizer.encode("Hello!"))
    assert "".join(deltas) == "Hello!"


def test_prompt_context_keeps_sentencepiece_leading_space() -> None:
    # Metaspace decoders drop the "▁" (space) of the text's first token: decoded alone, the first output token
    # would lose its space, so the last prompt tokens must be decoded along with it.
    backend = Tokenizer(models.WordLevel({"▁Hi": 0, "▁there": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tokenizer.decode([1]) == "there" and tokenizer.decode([0, 1]) == "Hi there"
    detokenizer = IncrementalDetokenizer(tokenizer, [0], SamplingParams())
    deltas, _ = stream(detokenizer, [1, 1])
    assert "".join(deltas) == " there there"


# ---- several tokens at once (stream_interval, speculative decoding) ------------------------------------------------
def chunked_updates(
    detokenizer: IncrementalDetokenizer, token_ids: Sequence[int], chunk_sizes: Sequence[int]
) -> list[tuple[str, str | None, int]]:
    """(delta, stop, tokens output so far) per chunk, the flush last."""
    out, start, i = [], 0, 0
    while start < len(token_ids) and not detokenizer.finished:
        size = chunk_sizes[i % len(chunk_sizes)]
        update = detokenizer.update(token_ids[start : start + size])
        out.append((update.text_delta, update.stop_reason, len(detokenizer.output_token_ids)))
        start, i = start + size, i + 1
    out.append((detokenizer.flush(), detokenizer.stop_reason, len(detokenizer.output_token_ids)))
    return out


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    token_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=60),
    chunk_sizes=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    skip_special_tokens=st.booleans(),
    include_stop=st.booleans(),
    min_tokens=st.integers(0, 8),
)
def test_byte_path_gives_the_text_of_the_window_path(
    tokenizer: PreTrainedTokenizerFast,
    data: st.DataObject,
    token_ids: list[int],
    chunk_sizes: list[int],
    skip_special_tokens: bool,
    include_stop: bool,
    min_tokens: int,
) -> None:
    # A byte-level tokenizer's tokens are decoded by their bytes, one incremental UTF-8 decode each; the window
    # algorithm (every other tokenizer's) is the reference. Random ids split multi-byte characters and make invalid
    # UTF-8 too.
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    stops = []
    if text and data.draw(st.booleans()):  # stop strings that occur in the output (and one that may not)
        start = data.draw(st.integers(0, len(text) - 1))
        stops.append(text[start : start + data.draw(st.integers(1, 4))])
        stops.append(data.draw(st.sampled_from(["the", "é", "\n"])))
    params = SamplingParams(
        stop=stops,
        include_stop_str_in_output=include_stop,
        min_tokens=min_tokens,
        skip_special_tokens=skip_special_tokens,
    )
    by_bytes = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), params)
    assert by_bytes.decoder.token_bytes is not None
    window_decoder = TokenDecoder(tokenizer, skip_special_tokens)
    window_decoder.token_bytes = None  # as for a tokenizer that is not byte-level
    by_window = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), params, window_decoder)
    bytes_updates = chunked_updates(by_bytes, token_ids, chunk_sizes)
    window_updates = chunked_updates(by_window, token_ids, chunk_sizes)
    assert "".join(delta for delta, _, _ in bytes_updates) == by_bytes.output_text
    if not stops:
        # The same text, never later: the bytes path releases a token's whole characters at once, where the window
        # holds a token's text back until the character it ends inside is complete (" " + half of "∯").
        assert by_bytes.output_text == by_window.output_text == text
        assert by_bytes.output_token_ids == by_window.output_token_ids == token_ids
        bytes_text = window_text = ""
        for (bytes_delta, _, _), (window_delta, _, _) in zip(bytes_updates, window_updates):
            bytes_text, window_text = bytes_text + bytes_delta, window_text + window_delta
            assert bytes_text.startswith(window_text)
    else:
        # A stop string is found at the token whose text completes it (which the window may only show later).
        decoded = tokenizer.decode(by_bytes.output_token_ids, skip_special_tokens=skip_special_tokens)
        assert decoded.startswith(by_bytes.output_text)
        if by_bytes.stop_reason is not None:
            stop = by_bytes.stop_reason
            kept = by_bytes.output_text.removesuffix(stop) if include_stop else by_bytes.output_text
            assert not include_stop or by_bytes.output_text.endswith(stop)
            assert decoded.startswith(kept + stop)


def _gpt_oss_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    from tests.harmony_tokenizer import make_gpt_oss_tokenizer

    return make_gpt_oss_tokenizer(tmp_path_factory.mktemp("o200k"))


@pytest.mark.parametrize("name", ["tiny", "demo_model", "o200k_harmony"])
def test_token_bytes_are_what_decode_gives_for_every_id(
    name: str, tokenizer: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The byte path rests on each id standing for fixed bytes: check the table against the Rust decoder for every id
    # of the tokenizers brisk ships or serves (o200k: gpt-oss's 201,088 ids, special tokens included), one id
    # alone and in random runs where multi-byte characters span ids.
    import random

    from transformers import AutoTokenizer

    if name == "demo_model":
        tokenizer = AutoTokenizer.from_pretrained(str(Path(brisk.__file__).parent / "demo_model"))
    elif name == "o200k_harmony":
        tokenizer = _gpt_oss_tokenizer(tmp_path_factory)
    backend = tokenizer.backend_tokenizer
    rng = random.Random(0)
    for skip in (False, True):
        token_bytes = TokenDecoder(tokenizer, skip).token_bytes
        assert token_bytes is not None
        ids = range(backend.get_vocab_size(with_added_tokens=True))
        wrong = [
            i for i in ids if backend.decode([i], skip_special_tokens=skip) != token_bytes(i).decode("utf-8", "replace")
        ]
        assert wrong == []
        for _ in range(200):
            run = [rng.randrange(len(ids)) for _ in range(rng.randint(1, 12))]
            expected = backend.decode(run, skip_special_tokens=skip)
            assert b"".join(map(token_bytes, run)).decode("utf-8", "replace") == expected


def test_a_shared_decoder_decodes_each_single_token_once(tokenizer: PreTrainedTokenizerFast) -> None:
    decoder = TokenDecoder(tokenizer, skip_special_tokens=True)
    calls = []
    decode = decoder.decode
    decoder.decode = lambda ids: calls.append(list(ids)) or decode(ids)
    token_ids = tokenizer.encode("Hello world, 你好")
    for _ in range(2):
        assert [decoder.decode_window([t]) for t in token_ids] == [tokenizer.decode([t]) for t in token_ids]
    assert decoder.decode_window(token_ids) == tokenizer.decode(token_ids)
    assert sorted(calls) == sorted([[t] for t in set(token_ids)] + [token_ids])
    # Requests share it: the text of two streams through one decoder is each stream's own.
    for _ in range(2):
        detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(), decoder)
        assert "".join(stream(detokenizer, token_ids)[0]) == "Hello world, 你好"
