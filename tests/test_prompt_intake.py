"""Prompt intake (issue 29): a text that cannot fit the context is refused from its length before the tokenizer
sees it, and a large one is tokenized (chat: rendered) on a worker thread while the event loop keeps serving."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest

from brisk.engine.output_processor import CompletionDelta
from brisk.outputs import CompletionOutput, RequestOutput
from brisk.server.app import build_app
from brisk.server.state import OFF_LOOP_CHARS
from tests.test_security import fake_state

MAX_TOKEN_CHARS = 4  # the fake vocabulary's longest token
WAIT_S = 60  # how long a test waits for the other side of an event before failing


class BlockingBackend:
    """A Rust-tokenizer stand-in: one id per character; `encode_batch` (the call made on a worker thread) waits
    until the test releases it, so the test controls exactly when the tokenizer is busy."""

    normalizer = None

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[str] = []

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return {"a": 0, "ab": 1, "abcd": 2}

    def encode(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        self.calls.append("encode")
        return SimpleNamespace(ids=[1] * len(text))

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[SimpleNamespace]:
        self.calls.append("encode_batch")
        self._busy()
        return [SimpleNamespace(ids=[1] * 8) for _ in texts]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=True, **_) -> list[int]:
        self.calls.append(
            f"render on {'the loop' if threading.current_thread() is threading.main_thread() else 'a worker'}"
        )
        self._busy()
        return [1] * 8

    def _busy(self) -> None:
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never released the tokenizer"


def served_state(backend: BlockingBackend, max_seq_len: int = 64):
    state = fake_state()
    state.tokenizer = SimpleNamespace(backend_tokenizer=backend, apply_chat_template=backend.apply_chat_template)
    state.client.info.max_seq_len = max_seq_len

    async def generate(request_id, prompt_ids, params, *_args, **_kwargs):
        output = RequestOutput(request_id, None, prompt_ids, [CompletionOutput(index=0)])
        output.outputs[0].text, output.outputs[0].token_ids, output.outputs[0].finish_reason = "x", [6], "length"
        yield CompletionDelta(request_id, 0, "x", [6], None, "length", None, output)

    state.client.generate = generate
    return state


LARGE = "a" * OFF_LOOP_CHARS
LARGE_REQUESTS = {
    "completion": ("/v1/completions", {"prompt": LARGE, "max_tokens": 1}, ["encode_batch"]),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LARGE}]}, ["render on a worker"]),
}


@pytest.mark.parametrize("path, body, calls", LARGE_REQUESTS.values(), ids=LARGE_REQUESTS.keys())
def test_a_large_prompt_is_tokenized_off_the_event_loop_while_health_answers(path, body, calls):
    backend = BlockingBackend()
    app = build_app(served_state(backend, max_seq_len=1 << 20))

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://brisk", timeout=WAIT_S) as http:
            completion = asyncio.create_task(http.post(path, json=body))
            assert await asyncio.to_thread(backend.entered.wait, WAIT_S)  # the tokenizer is busy with it now
            health = await http.get("/health")
            assert health.status_code == 200
            assert not backend.release.is_set() and not completion.done()  # ... and still is
            backend.release.set()
            response = await completion
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == 8  # what the worker thread's tokenizer returned

    asyncio.run(scenario())
    assert backend.calls == calls


def test_a_small_prompt_is_tokenized_in_place():
    backend = BlockingBackend()
    app = build_app(served_state(backend))

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://brisk", timeout=WAIT_S) as http:
            r = await http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3

    asyncio.run(scenario())
    assert backend.calls == ["encode"]


@pytest.mark.parametrize(
    "path, field, body",
    [
        ("/v1/completions", "prompt", lambda text: {"prompt": text}),
        ("/v1/completions", "prompt", lambda text: {"prompt": ["ok", text]}),
        ("/v1/chat/completions", "messages", lambda text: {"messages": [{"role": "user", "content": text}]}),
        (
            "/v1/chat/completions",
            "messages",
            lambda text: {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
        ),
        ("/tokenize", "prompt", lambda text: {"prompt": text}),
    ],
)
def test_a_text_that_cannot_fit_is_refused_before_tokenizing(path, field, body):
    # 64 tokens of context and no token longer than 4 characters: 257 characters are at least 65 tokens.
    backend = BlockingBackend()
    state = served_state(backend, max_seq_len=64)
    app = build_app(state)

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://brisk", timeout=WAIT_S) as http:
            r = await http.post(path, json=body("a" * (MAX_TOKEN_CHARS * 64 + 1)))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == field and error["code"] == "context_length_exceeded"
            assert "at least 65 tokens" in error["message"]

    asyncio.run(scenario())
    assert backend.calls == []  # refused from its length alone
    assert state.max_token_chars == MAX_TOKEN_CHARS


def test_no_bound_is_assumed_for_a_normalizing_tokenizer():
    # A normalizer may shrink the text before it is split (NFKC, stripping accents): no character bound holds.
    backend = BlockingBackend()
    backend.normalizer = object()
    state = served_state(backend)
    assert state.max_token_chars is None
    state.check_text_fits(10**9, "prompt")  # not refused on length
