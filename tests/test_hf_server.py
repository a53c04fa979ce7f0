"""benchmarks/hf_server.py, the transformers baseline of the CPU comparison, on a tiny Llama.

What `brisk bench serve` relies on: exact output lengths with ignore_eos (streamed and whole), usage in the last
stream chunk, and /tokenize + /detokenize round trips. No timings are asserted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.server_utils import RunningServer
from tests.tiny_models import make_tiny_llama_with_tokenizer

HF_SERVER = Path(__file__).resolve().parent.parent / "benchmarks" / "hf_server.py"
MODEL = "tiny"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory) -> Iterator[str]:
    path = make_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("hf_server_llama"))
    srv = RunningServer(path, "--served-model-name", MODEL, script=str(HF_SERVER))
    yield srv.url
    srv.stop()


def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused")


def test_models_names_the_server(base_url: str) -> None:
    models = httpx.get(f"{base_url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    assert models[0]["owned_by"] == "transformers"


@pytest.mark.parametrize("max_tokens", [1, 12])
def test_non_streaming_exact_length(base_url: str, max_tokens: int) -> None:
    out = client(base_url).completions.create(
        model=MODEL, prompt="Hello there", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == max_tokens
    assert out.choices[0].finish_reason == "length"


def test_streaming_exact_length_and_usage(base_url: str) -> None:
    max_tokens = 16
    stream = client(base_url).completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=max_tokens,
        temperature=0.8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": max_tokens},
    )
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(token_chunks) == max_tokens  # one chunk per token: the benchmark times each
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == max_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streaming_matches_non_streaming_greedy(base_url: str) -> None:
    kwargs = dict(
        model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client(base_url).completions.create(**kwargs).choices[0].text
    streamed = "".join(
        c.choices[0].text for c in client(base_url).completions.create(**kwargs, stream=True) if c.choices
    )
    assert streamed == whole


def test_tokenize_round_trip(base_url: str) -> None:
    text = "hello world, tokens and more tokens"
    body = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
    assert body["count"] == len(body["tokens"]) > 0
    back = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back["prompt"] == text
    # The count of a completion prompt is what usage.prompt_tokens reports for it (special tokens included).
    counted = httpx.post(f"{base_url}/tokenize", json={"prompt": text}).json()["count"]
    out = client(base_url).completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens == counted
