"""A tiny, deterministic byte-level BPE tokenizer for tests.

`make_tiny_tokenizer(path)` trains a GPT-2 style byte-level BPE on the small corpus below, saves it with
`save_pretrained` and returns the tokenizer loaded back from disk, so tests exercise the same loading path as
the server. The corpus mixes English with accented Latin, CJK and emoji so that multi-byte UTF-8 characters are
split across several tokens (the small vocabulary cannot afford merges for rare characters).
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"  # also the pad token
BOS_TOKEN = "<|bos|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Trained first, so they get ids 0, 1, 2, 3 in this order.
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
EOS_ID, BOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message, then an open assistant turn on request.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine keeps a batch of requests running at once:
every step it schedules the requests that fit in memory, runs the model on their newest tokens, samples one
token per request and streams the text back to the client as soon as it is complete.

Large language models read text as tokens. A tokenizer splits the text into pieces from a fixed vocabulary,
and the model predicts a probability for every piece of the vocabulary at each position. Sampling picks the
next token from that distribution: greedy decoding takes the most likely token, while temperature, top-k,
top-p and min-p sampling trade determinism for variety.

The key-value cache stores the attention keys and values of every token that was already processed, so that
the model does not recompute them for each new token. Paged attention splits the cache into fixed-size
blocks, which lets many requests share the memory of the accelerator without fragmentation. When the memory
runs out, the scheduler preempts the newest request and recomputes it later.

Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every morning he
went out with his boat, and every evening he came back with whatever the sea had given him. One day he caught
a golden fish that could speak, and the fish asked him to let it go back into the water.

Questions and answers: What is the capital of France? The capital of France is Paris. How many days are there
in a week? There are seven days in a week. What is two plus two? Two plus two is four. Why is the sky blue?
Because air scatters blue light more than red light.

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 (a, b) [x, y] {key: value} 50% $20 #1 @user

Café, naïve, façade, résumé, jalapeño, Straße, Ærø, smörgåsbord, crème brûlée, São Paulo, Zürich.
Добрый день! Как дела? Спасибо, хорошо. Привет, мир.
你好，世界！今天天气很好。我们一起去公园散步吧。机器学习和自然语言处理。
こんにちは、世界。ありがとうございます。東京は大きな都市です。
안녕하세요, 세계! 감사합니다.
مرحبا بالعالم. שלום עולם. नमस्ते दुनिया।
Emoji: 😀 😂 🎉 🚀 👍 ❤️ 🔥 🌍 🐍 🤖 👨‍👩‍👧 🇫🇷 ✨ ☕
Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ π α β γ λ μ σ Ω → ← ⇒ ∀ ∃ ∈
"""


def make_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train the tiny tokenizer, save it to `path` and return it loaded from there."""
    # Every id below 260 is taken by the 4 special tokens and the 256 byte tokens.
    min_vocab_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_vocab_size:
        raise ValueError(f"vocab_size must be at least {min_vocab_size}, got {vocab_size}")

    backend = _train_byte_level_bpe(CORPUS.splitlines(keepends=True), vocab_size)
    if backend.get_vocab_size() < vocab_size:
        # The built-in corpus runs out of merges around 1200 tokens; the stdlib's pydoc topics (~450 KB of
        # English) allow vocabularies of several thousand. Only used when needed, so the default vocabulary
        # does not depend on the Python version.
        from pydoc_data.topics import topics

        pydoc_texts = [topics[name] for name in sorted(topics)]
        backend = _train_byte_level_bpe([*CORPUS.splitlines(keepends=True), *pydoc_texts], vocab_size)
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the built-in corpora only support {backend.get_vocab_size()} tokens, {vocab_size} were asked for"
        )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json (one file fewer to load).
    tokenizer.save_pretrained(str(path), save_jinja_files=False)
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _train_byte_level_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """A GPT-2 style byte-level BPE trained on `texts`, with SPECIAL_TOKENS first; at most `vocab_size` tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend
