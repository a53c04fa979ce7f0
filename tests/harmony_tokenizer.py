"""The real gpt-oss tokenizer (o200k_harmony), built offline from the shared o200k_base BPE file.

`make_gpt_oss_tokenizer(path)` turns `shared/tokenizers/o200k_base.tiktoken` into a `tokenizers` byte-level BPE
with o200k's pre-tokenizer regex, adds gpt-oss's special tokens at their real ids (from the model's
`tokenizer_config.json`) and the reserved tokens up to the model's vocabulary size, and saves it with the real
`chat_template.jinja`, so that `AutoTokenizer.from_pretrained(path)` works without the hub.

Building takes a few seconds (the BPE merges are derived from the tiktoken ranks); a directory that already
holds a tokenizer built from the same inputs is loaded instead of rebuilt, so callers may pass a persistent
cache directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SHARED_DIR = Path(__file__).resolve().parents[2] / "shared"
TIKTOKEN_DIR = SHARED_DIR / "tokenizers"
TIKTOKEN_FILE = TIKTOKEN_DIR / "o200k_base.tiktoken"
MODEL_DIR = SHARED_DIR / "models" / "gpt-oss-20b"

# gpt-oss's embedding size; o200k_harmony names every id past the configured special tokens <|reserved_N|>.
VOCAB_SIZE = 201_088
# o200k_base's pre-tokenizer pattern (tiktoken_ext.openai_public.o200k_base).
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# Written next to the tokenizer; a directory whose stamp matches is reused as it is. Bump the version when the
# build below changes.
STAMP_FILE = "brisk_harmony_tokenizer.stamp"
BUILD_VERSION = "1"


def make_gpt_oss_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Build the gpt-oss tokenizer into `path` (or load it from there if it was built already) and return it."""
    path = Path(path)
    stamp = _inputs_stamp()
    stamp_path = path / STAMP_FILE
    if stamp_path.is_file() and stamp_path.read_text() == stamp:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    tokenizer = _build(path)
    stamp_path.write_text(stamp)  # last, so an interrupted build is redone
    return tokenizer


def _build(path: Path) -> PreTrainedTokenizerFast:
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    special_tokens = {int(token_id): entry["content"] for token_id, entry in config["added_tokens_decoder"].items()}
    backend = _o200k_base_backend()
    first_special_id = backend.get_vocab_size()
    for token_id in range(first_special_id, VOCAB_SIZE):
        special_tokens.setdefault(token_id, f"<|reserved_{token_id}|>")
    # add_special_tokens appends in order, so adding them sorted by id puts each one at its real id.
    if sorted(special_tokens) != list(range(first_special_id, VOCAB_SIZE)):
        raise ValueError(f"special token ids do not continue the BPE vocabulary at {first_special_id}")
    backend.add_special_tokens(
        [AddedToken(special_tokens[token_id], normalized=False, special=True) for token_id in sorted(special_tokens)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=config["bos_token"],
        eos_token=config["eos_token"],
        pad_token=config["pad_token"],
        chat_template=(MODEL_DIR / "chat_template.jinja").read_text(),
        clean_up_tokenization_spaces=False,
        model_max_length=config["model_max_length"],
    )
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))  # writes chat_template.jinja beside tokenizer_config.json
    return tokenizer


def _o200k_base_backend() -> Tokenizer:
    """o200k_base as a `tokenizers` BPE, equivalent to tiktoken's encoding of ordinary text.

    The same vocabulary, merges (every split of a token into two tokens, ordered by the token's rank, then the
    halves' ranks) and pre-tokenizer as transformers' TikTokenConverter builds, in about a third of its time.
    """
    from tiktoken.load import load_tiktoken_bpe
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = load_tiktoken_bpe(str(TIKTOKEN_FILE))
    # Byte-level BPE vocabularies spell bytes as printable characters; str.translate does that in C.
    byte_to_char = {byte: char for byte, char in bytes_to_unicode().items()}
    spelled = {rank: token.decode("latin-1").translate(byte_to_char) for token, rank in ranks.items()}
    merges: list[tuple[int, int, int]] = []
    for token, rank in ranks.items():
        for split in range(1, len(token)):
            left, right = ranks.get(token[:split]), ranks.get(token[split:])
            if left is not None and right is not None:
                merges.append((rank, left, right))
    merges.sort()
    bpe = models.BPE(
        {text: rank for rank, text in spelled.items()},
        [(spelled[left], spelled[right]) for _, left, right in merges],
        fuse_unk=False,
        ignore_merges=True,  # a pre-token that is itself in the vocabulary is one token, as in tiktoken
    )
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _inputs_stamp() -> str:
    digest = hashlib.sha256(BUILD_VERSION.encode())
    for source in (TIKTOKEN_FILE, MODEL_DIR / "tokenizer_config.json", MODEL_DIR / "chat_template.jinja"):
        digest.update(source.read_bytes())
    return digest.hexdigest()
