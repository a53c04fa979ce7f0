"""The naive baseline: an OpenAI-compatible server around `transformers`' `generate()`, one request at a time.

This is what "just wrap the model in FastAPI" gives: no batching, no paged KV cache, a lock around `generate()`.
It speaks enough of the API for `brisk bench serve` to measure it like any other server: `/v1/models`,
`/v1/completions` (streamed per token, or whole), `/tokenize` and `/detokenize` (brisk's spelling, so prompts are
token-exact), `/health` and `/version`.

    python benchmarks/hf_server.py MODEL_DIR --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)


class PerTokenStreamer(TextIteratorStreamer):
    """One queue item per generated token, its text delta (possibly empty).

    The stock streamer holds text back until a word ends, which would make every "token" look late to a
    benchmark; here only an incomplete UTF-8 character (decoded as U+FFFD) is held back.
    """

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1:
            value = value[0]
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.token_cache.extend(value.tolist())
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        ready = text[self.print_len :] if not text.endswith("\ufffd") else ""
        self.print_len += len(ready)
        self.on_finalized_text(ready)

    tail = ""  # text held back at the end (an incomplete character), sent with the final chunk

    def end(self) -> None:
        """Keep the held-back tail for the final chunk (every queue item stays one token), then stop."""
        if self.token_cache:
            self.tail = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)[self.print_len :]
        self.next_tokens_are_prompt = True
        self.text_queue.put(self.stop_signal, timeout=self.timeout)

    @property
    def num_tokens(self) -> int:
        return len(self.token_cache)


class StopOnEvent(StoppingCriteria):
    """Ends `generate()` early when the client went away, so the lock is not held for a dead request."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI/vLLM fields are accepted and ignored

    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tokens: list[int]


@dataclass
class Server:
    """The loaded model and the lock that makes it serve one request at a time."""

    model_dir: str
    name: str
    tokenizer: Any = field(init=False)
    model: Any = field(init=False)
    lock: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        # dtype="auto": the checkpoint's own dtype (bf16 or fp32), as the other servers are run.
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype="auto").eval()

    def encode(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model.config.vocab_size
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise HTTPException(400, "empty prompt or token id outside the vocabulary")
        return ids

    def generate_kwargs(self, req: CompletionRequest, prompt_ids: list[int]) -> dict[str, Any]:
        # ignore_eos and min_tokens both become min_new_tokens: HF then masks every EOS id until that length.
        min_new = req.max_tokens if req.ignore_eos else min(req.min_tokens, req.max_tokens)
        sampling: dict[str, Any] = {"do_sample": False}
        if req.temperature > 0:
            sampling = {"do_sample": True, "temperature": req.temperature, "top_p": req.top_p, "top_k": None}
        return {
            "input_ids": torch.tensor([prompt_ids]),
            "attention_mask": torch.ones(1, len(prompt_ids), dtype=torch.long),
            "max_new_tokens": req.max_tokens,
            "min_new_tokens": min_new,
            "pad_token_id": self.tokenizer.pad_token_id,
            **sampling,
        }


def build_app(server: Server) -> FastAPI:
    app = FastAPI(title="hf_server: transformers generate() baseline")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": transformers.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        # owned_by names the server in `brisk bench serve` results.
        return {
            "object": "list",
            "data": [{"id": server.name, "object": "model", "created": 0, "owned_by": "transformers"}],
        }

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        tokens = server.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens)}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        return {"prompt": server.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        if req.max_tokens < 1:
            raise HTTPException(400, "max_tokens must be >= 1")
        prompt_ids = server.encode(req.prompt)
        kwargs = server.generate_kwargs(req, prompt_ids)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def body(choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": server.name,
                "choices": choices,
                "usage": usage,
            }

        def usage(completion_tokens: int) -> dict[str, int]:
            return {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            }

        def finish_reason(n: int) -> str:
            return "length" if n >= req.max_tokens else "stop"

        if not req.stream:
            async with server.lock:
                seed_everything(req.seed)
                out = await asyncio.to_thread(server.model.generate, **kwargs)
            new = out[0, len(prompt_ids) :].tolist()
            text = server.tokenizer.decode(new, skip_special_tokens=True)
            return body(
                [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(len(new))}],
                usage(len(new)),
            )

        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def events() -> AsyncIterator[str]:
            stop = threading.Event()
            streamer = PerTokenStreamer(server.tokenizer, skip_prompt=True, skip_special_tokens=True)
            async with server.lock:
                seed_everything(req.seed)
                thread = threading.Thread(
                    target=generate_into,
                    daemon=True,
                    args=(server.model, streamer),
                    kwargs={**kwargs, "stopping_criteria": StoppingCriteriaList([StopOnEvent(stop)])},
                )
                thread.start()
                try:
                    while (piece := await asyncio.to_thread(next, streamer, None)) is not None:
                        chunk = body([{"index": 0, "text": piece, "logprobs": None, "finish_reason": None}])
                        yield f"data: {json.dumps(chunk)}\n\n"
                    last = {
                        "index": 0,
                        "text": streamer.tail,
                        "logprobs": None,
                        "finish_reason": finish_reason(streamer.num_tokens),
                    }
                    yield f"data: {json.dumps(body([last]))}\n\n"
                    if include_usage:
                        yield f"data: {json.dumps(body([], usage(streamer.num_tokens)))}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    # Client gone or done: stop generate() and wait for it before the next request may start.
                    stop.set()
                    await asyncio.to_thread(thread.join)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def generate_into(model: Any, streamer: PerTokenStreamer, **kwargs: Any) -> None:
    """`generate()` in a thread; a failure still ends the stream (the reader would otherwise wait forever)."""
    try:
        model.generate(streamer=streamer, **kwargs)
    except Exception:
        streamer.end()
        raise


def seed_everything(seed: int | None) -> None:
    if seed is not None:
        torch.manual_seed(seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--served-model-name", help="default: the model directory")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    server = Server(args.model_dir, args.served_model_name or args.model_dir)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
