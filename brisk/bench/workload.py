"""What the benchmark sends: prompts of an exact token length, a ShareGPT file's conversations, or multi-turn
conversations (each turn's new user message drawn here; the client resends the growing history).

Prompt lengths are counted the way the target server counts them (chat template and special tokens included),
by the server's own `/tokenize` where it has one (brisk, vLLM, SGLang), else by a local Hugging Face tokenizer,
else approximately, one token per word.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

# Random prompts are drawn from common words: real text tokenizes like real text (unlike random token ids,
# which decode to byte soup and re-encode to a different length).
WORDS = tuple(
    (
        "the of and to in is was for on are with as by at from this that be or have an not which but all were "
        "when we there can more if no out so said what up its about into than them only other new some time "
        "could these two may then first any like now my such make over our even most made after also did many "
        "before must through back years where much your way well down should because each just those people "
        "how too little state good very world still own see men work long here get both between life being "
        "under never day same another know while last might us great old year off come since against go came "
        "right used take three small large number place water system house light power music story river city"
    ).split()
)
PREPARE_THREADS = 16  # prompts are prepared concurrently: one /tokenize round trip each is slow over a network
LENGTH_FIX_ROUNDS = 8  # re-tokenizing a truncated text can shift its length by a token or two


class PromptTokenizer(Protocol):
    """Counts and cuts text in the target model's tokens. "Tokens" are opaque: ids, or words for `WordTokenizer`."""

    source: str  # "server", "local" or "words": recorded in the results

    def encode(self, text: str) -> list[Any]: ...

    def decode(self, tokens: list[Any]) -> str: ...

    def count(self, text: str) -> int:
        """Prompt tokens the server sees when `text` is the prompt (chat: the user message) on the endpoint."""
        ...


class ServerTokenizer:
    """The server's `/tokenize` and `/detokenize` (brisk and vLLM spelling; SGLang follows vLLM)."""

    source = "server"

    def __init__(self, http: httpx.Client, base_url: str, model: str, endpoint: str) -> None:
        self.http, self.base_url, self.model, self.endpoint = http, base_url, model, endpoint

    @classmethod
    def probe(cls, http: httpx.Client, base_url: str, model: str, endpoint: str) -> ServerTokenizer | None:
        """The server's tokenizer if it answers both calls this endpoint needs, else None."""
        tokenizer = cls(http, base_url, model, endpoint)
        try:
            tokenizer.decode(tokenizer.encode("hello world"))
            tokenizer.count("hello world")
        except (httpx.HTTPError, KeyError, TypeError, ValueError):
            return None
        return tokenizer

    def _post(self, path: str, body: dict) -> dict:
        response = self.http.post(f"{self.base_url}{path}", json={"model": self.model, **body})
        response.raise_for_status()
        return response.json()

    def encode(self, text: str) -> list[Any]:
        return list(self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"])

    def decode(self, tokens: list[Any]) -> str:
        return str(self._post("/detokenize", {"tokens": tokens})["prompt"])

    def count(self, text: str) -> int:
        if self.endpoint == "chat":
            return int(self._post("/tokenize", {"messages": [{"role": "user", "content": text}]})["count"])
        return int(self._post("/tokenize", {"prompt": text})["count"])


class LocalTokenizer:
    """A Hugging Face tokenizer from `--tokenizer PATH` (a directory or hub name already in the local cache)."""

    source = "local"

    def __init__(self, path: str, endpoint: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.endpoint = endpoint

    def encode(self, text: str) -> list[Any]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[Any]) -> str:
        text = self.tokenizer.decode(tokens)
        if not isinstance(text, str):  # a list of strings only comes back for a batch of sequences
            raise TypeError(f"tokenizer.decode returned {type(text).__name__}, expected str")
        return text

    def count(self, text: str) -> int:
        if self.endpoint == "chat" and getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
            )
            # a BatchEncoding (a mapping) in recent transformers, a plain list of ids in older ones
            return len(out["input_ids"] if isinstance(out, Mapping) else out)
        return len(self.tokenizer.encode(text))


class WordTokenizer:
    """No tokenizer at hand: one token per whitespace-separated word (lengths are then approximate)."""

    source = "words"

    def encode(self, text: str) -> list[Any]:
        return text.split()

    def decode(self, tokens: list[Any]) -> str:
        return " ".join(tokens)

    def count(self, text: str) -> int:
        return len(text.split())


@dataclass(frozen=True)
class RequestSpec:
    prompt: str  # the new user message: on a turn after the first, what follows the resent history
    prompt_tokens: int  # as the prompt tokenizer counts it for the endpoint (a later turn: its message alone)
    max_tokens: int  # the output length asked for (exact with ignore_eos)
    # the conversation so far, resent before `prompt`: (user message, the model's answer) of each earlier turn
    history: tuple[tuple[str, str], ...] = ()
    conversation: int | None = None  # multi-turn: which conversation and which turn (0-based) this request is
    turn: int | None = None


@dataclass(frozen=True)
class Workload:
    kind: str  # "fixed", "random", "sharegpt" or "multi-turn"
    input_len: int | None = None  # multi-turn: the first turn's prompt
    output_len: int | None = None  # multi-turn: every answer
    input_range: tuple[int, int] | None = None
    output_range: tuple[int, int] | None = None
    dataset: str | None = None
    turns: int = 1  # multi-turn: turns per conversation
    turn_input_len: int | None = None  # multi-turn: the new user message of each turn after the first

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "random_input_range": list(self.input_range) if self.input_range else None,
            "random_output_range": list(self.output_range) if self.output_range else None,
            "dataset": self.dataset,
            "turns": self.turns,
            "turn_input_len": self.turn_input_len,
        }


@dataclass(frozen=True)
class Conversation:
    """One multi-turn conversation's new user messages, turn by turn (turn 0's spec is a whole first prompt; a later
    one's prompt_tokens counts its message alone). The client adds the history as the answers come back."""

    index: int
    turns: tuple[RequestSpec, ...]


def exact_prompt(tokenizer: PromptTokenizer, rng: random.Random, target: int) -> tuple[str, int]:
    """Random words cut to `target` prompt tokens as the endpoint counts them; returns (text, actual count)."""
    overhead = tokenizer.count("")  # chat template or BOS around the content
    want = max(1, target - overhead)
    tokens: list[Any] = []
    words = want + 16  # a margin to grow into when re-tokenization comes up short
    while len(tokens) < want + 16:
        tokens = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(words)))
        words *= 2
    text = tokenizer.decode(tokens[:want])
    count = tokenizer.count(text)
    for _ in range(LENGTH_FIX_ROUNDS):
        if count == target or want + target - count < 1:
            break
        want += target - count
        text = tokenizer.decode(tokens[:want])
        count = tokenizer.count(text)
    return text, count


def exact_message(tokenizer: PromptTokenizer, rng: random.Random, target: int) -> tuple[str, int]:
    """Random words cut to `target` tokens of plain text (no chat template around it: a message added to a
    conversation); returns (text, its token count)."""
    tokens: list[Any] = []
    words = target + 16
    while len(tokens) < target:
        tokens = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(words)))
        words *= 2
    text = tokenizer.decode(tokens[:target])
    return text, len(tokenizer.encode(text))


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first human turn, the gpt turn answering it) of every conversation that has both."""
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for item in data:
        if not isinstance(item, dict):
            continue
        turns = item.get("conversations") or item.get("conversation") or []
        for i, turn in enumerate(turns[:-1]):
            if turn.get("from") in ("human", "user"):
                answer = turns[i + 1]
                if answer.get("from") in ("gpt", "assistant") and turn.get("value") and answer.get("value"):
                    pairs.append((turn["value"], answer["value"]))
                break
    return pairs


class RequestFactory:
    """Draws request specs for one benchmark point after another (fresh random prompts each time, so no point
    hits a prefix cache warmed by an earlier one; a ShareGPT file is walked through, wrapping around)."""

    # vLLM's ShareGPT filter, so that results compare: drop tiny turns and over-long conversations.
    SHAREGPT_MIN_TOKENS, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048

    def __init__(self, workload: Workload, tokenizer: PromptTokenizer, seed: int) -> None:
        self.workload, self.tokenizer = workload, tokenizer
        self.rng = random.Random(seed)
        self.conversations: list[tuple[str, str]] = []
        self.next_conversation = 0
        self.inexact_prompts = 0  # prompts that missed their length: e.g. shorter than the chat template alone
        if workload.kind == "sharegpt":
            self.conversations = load_sharegpt(workload.dataset or "")
            if not self.conversations:
                raise ValueError(f"{workload.dataset}: no conversation with a human turn and a gpt answer")
            self.rng.shuffle(self.conversations)

    def take(self, n: int) -> list[RequestSpec]:
        if self.workload.kind == "sharegpt":
            return self._take_sharegpt(n)
        w = self.workload
        jobs = []
        for _ in range(n):
            input_len = w.input_len if w.input_range is None else self.rng.randint(*w.input_range)
            output_len = w.output_len if w.output_range is None else self.rng.randint(*w.output_range)
            jobs.append((input_len, output_len, self.rng.getrandbits(64)))

        def build(job: tuple[int, int, int]) -> RequestSpec:
            text, count = exact_prompt(self.tokenizer, random.Random(job[2]), job[0])
            return RequestSpec(text, count, job[1])

        with ThreadPoolExecutor(PREPARE_THREADS) as pool:
            specs = list(pool.map(build, jobs))
        self.inexact_prompts += sum(spec.prompt_tokens != job[0] for spec, job in zip(specs, jobs))
        return specs

    def take_conversations(self, n: int) -> list[Conversation]:
        """`n` conversations of workload.turns turns: a first prompt of input_len tokens (as `take` draws one), then
        turn_input_len tokens of new user message a turn."""
        w = self.workload
        firsts = self.take(n)
        later = w.turns - 1
        seeds = [self.rng.getrandbits(64) for _ in range(n * later)]

        def build(seed: int) -> RequestSpec:
            text, count = exact_message(self.tokenizer, random.Random(seed), w.turn_input_len or 1)
            return RequestSpec(text, count, w.output_len or 1)

        with ThreadPoolExecutor(PREPARE_THREADS) as pool:
            messages = list(pool.map(build, seeds))
        return [Conversation(i, (first, *messages[i * later : (i + 1) * later])) for i, first in enumerate(firsts)]

    def _take_sharegpt(self, n: int) -> list[RequestSpec]:
        def build(pair: tuple[str, str]) -> RequestSpec:
            output_len = self.workload.output_len or len(self.tokenizer.encode(pair[1]))
            return RequestSpec(pair[0], self.tokenizer.count(pair[0]), output_len)

        def keep(spec: RequestSpec) -> bool:
            return (
                spec.prompt_tokens >= self.SHAREGPT_MIN_TOKENS
                and spec.max_tokens >= self.SHAREGPT_MIN_TOKENS
                and spec.prompt_tokens <= self.SHAREGPT_MAX_PROMPT
                and spec.prompt_tokens + spec.max_tokens <= self.SHAREGPT_MAX_TOTAL
            )

        specs: list[RequestSpec] = []
        tried = 0
        with ThreadPoolExecutor(PREPARE_THREADS) as pool:
            while len(specs) < n:
                if tried >= len(self.conversations) and not specs:
                    raise ValueError(f"{self.workload.dataset}: no conversation passes the length filter")
                batch = [
                    self.conversations[(self.next_conversation + i) % len(self.conversations)]
                    for i in range(n - len(specs))
                ]
                self.next_conversation += len(batch)  # wraps around: a long run reuses the file
                tried += len(batch)
                specs += [s for s in pool.map(build, batch) if keep(s)]
        return specs
