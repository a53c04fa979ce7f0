"""Sending the requests: one streamed OpenAI request, timed per chunk, and one benchmark point of many: single
requests, or multi-turn conversations that resend their growing history."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from tqdm import tqdm

from brisk.bench.workload import Conversation, RequestSpec

ERROR_TEXT_LIMIT = 300  # characters of a server's error body kept per failed request
TURN_SEPARATOR = "\n"  # completions endpoint, multi-turn: between an answer and the next user message


@dataclass(frozen=True)
class Target:
    """The server under test and how to ask it for a generation."""

    base_url: str
    endpoint: str  # "chat" or "completions"
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    extensions: bool = True  # vLLM-style extra fields (ignore_eos, min_tokens); off for strict servers
    temperature: float | None = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/chat/completions" if self.endpoint == "chat" else f"{self.base_url}/v1/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            messages = []
            for user, answer in spec.history:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            body["messages"] = [*messages, {"role": "user", "content": spec.prompt}]
        else:  # the transcript as one text: each turn's prompt, the model's continuation, the next message
            body["prompt"] = "".join(user + answer + TURN_SEPARATOR for user, answer in spec.history) + spec.prompt
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.extensions and self.ignore_eos:
            body.update(ignore_eos=True, min_tokens=spec.max_tokens)
        body.update(self.extra_body)
        return body


@dataclass
class RequestResult:
    prompt_tokens: int  # the server's usage.prompt_tokens, else the expected count
    output_tokens: int  # the server's usage.completion_tokens, else the number of chunks with output
    output_tokens_from_usage: int | None
    ttft_s: float | None  # None for a failed request
    e2e_s: float | None
    itl_s: list[float]  # gaps between chunks that carry output (a chunk may carry several tokens)
    error: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    text: str = ""  # the answer (chat: its content), which a multi-turn conversation resends
    conversation: int | None = None
    turn: int | None = None


def _carries_output(chunk: dict) -> bool:
    """Whether a stream chunk stands for generated tokens (and so stops the TTFT clock or ends an ITL gap)."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
            return True
        # An empty chunk mid-stream is a token whose text is held back (part of a UTF-8 character); but the chat
        # role chunk that opens a stream, sent before any token, and a finish-only chunk that closes it are not.
        if choice.get("finish_reason") is None and not delta.get("role"):
            return True
    return False


async def stream_request(http: httpx.AsyncClient, target: Target, spec: RequestSpec) -> RequestResult:
    """Send one streamed request; times the first output chunk, every later one, and the end of the stream."""
    start = time.perf_counter()
    first: float | None = None
    last = start
    itl: list[float] = []
    chunks_with_output = 0
    usage: dict | None = None
    text: list[str] = []

    def failed(message: str) -> RequestResult:
        return failed_result(spec, message[:ERROR_TEXT_LIMIT])

    try:
        async with http.stream("POST", target.url, json=target.payload(spec), headers=target.headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return failed(f"HTTP {response.status_code}: {body}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, keep-alives
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    return failed(f"in-stream error: {message}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text.append(_answer_text(chunk))
                if _carries_output(chunk):
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
                    chunks_with_output += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    from_usage = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else None
    prompt_tokens = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else spec.prompt_tokens
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = int(details["cached_tokens"]) if details.get("cached_tokens") is not None else None
    ttft = (first if first is not None else end) - start  # no output at all: the whole request was the wait
    output_tokens = from_usage if from_usage is not None else chunks_with_output
    return RequestResult(
        prompt_tokens,
        output_tokens,
        from_usage,
        ttft,
        end - start,
        itl,
        cached_tokens=cached,
        text="".join(text),
        conversation=spec.conversation,
        turn=spec.turn,
    )


def failed_result(spec: RequestSpec, error: str) -> RequestResult:
    return RequestResult(
        spec.prompt_tokens, 0, None, None, None, [], error, conversation=spec.conversation, turn=spec.turn
    )


def _answer_text(chunk: dict) -> str:
    """The answer text a stream chunk adds: completions' text, chat's content (reasoning is not resent)."""
    out = ""
    for choice in chunk.get("choices") or []:
        out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return out


Job = Callable[[httpx.AsyncClient, asyncio.Semaphore], Coroutine[Any, Any, list[RequestResult]]]


async def _run_jobs(
    target: Target, jobs: list[Job], limit: int, request_rate: float | None, seed: int
) -> tuple[list[RequestResult], float]:
    """Start the jobs (a request, or a conversation of requests one after another) all at once or at
    `request_rate` a second; at most `limit` requests in flight. Results in job order, and the wall time."""
    slots = asyncio.Semaphore(limit)
    arrivals = random.Random(seed)
    timeout = httpx.Timeout(target.timeout_s, connect=min(target.timeout_s, 30.0))
    # One connection per in-flight request: httpx's default pool of 100 would cap concurrency silently.
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        start = time.perf_counter()
        tasks = []
        for i, job in enumerate(jobs):
            tasks.append(asyncio.create_task(job(http, slots)))
            if request_rate is not None and i + 1 < len(jobs):
                await asyncio.sleep(arrivals.expovariate(request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return [r for job_results in results for r in job_results], time.perf_counter() - start


def _request_job(target: Target, spec: RequestSpec, progress: tqdm | None) -> Job:
    async def job(http: httpx.AsyncClient, slots: asyncio.Semaphore) -> list[RequestResult]:
        async with slots:
            result = await stream_request(http, target, spec)
        if progress is not None:
            progress.update(1)
        return [result]

    return job


def _conversation_job(target: Target, conversation: Conversation, progress: tqdm | None) -> Job:
    """Turn after turn: each resends the conversation so far (its earlier messages and the model's answers) and a
    new message, once the previous answer is complete. A failed turn ends the conversation (the rest: failed)."""

    async def job(http: httpx.AsyncClient, slots: asyncio.Semaphore) -> list[RequestResult]:
        history: list[tuple[str, str]] = []
        results: list[RequestResult] = []
        for turn, message in enumerate(conversation.turns):
            spec = replace(message, history=tuple(history), conversation=conversation.index, turn=turn)
            if results and results[-1].error is not None:
                result = failed_result(spec, f"not sent: turn {turn - 1} of the conversation failed")
            else:
                async with slots:
                    result = await stream_request(http, target, spec)
                history.append((spec.prompt, result.text))
            results.append(result)
            if progress is not None:
                progress.update(1)
        return results

    return job


def _with_progress(total: int, description: str | None, run: Callable[[tqdm | None], Any]) -> Any:
    progress = tqdm(total=total, desc=description, unit="req", leave=False) if description else None
    try:
        return run(progress)
    finally:
        if progress is not None:
            progress.close()


def run_point(
    target: Target,
    specs: list[RequestSpec],
    concurrency: int | None,
    request_rate: float | None,
    seed: int = 0,
    description: str | None = None,
) -> tuple[list[RequestResult], float]:
    """Run `specs` against the target at most `concurrency` at a time (None: no limit), sent all at once or at
    `request_rate` requests/s; returns the results in spec order and the wall time from first send to last end."""

    def run(progress: tqdm | None) -> tuple[list[RequestResult], float]:
        jobs = [_request_job(target, spec, progress) for spec in specs]
        return asyncio.run(_run_jobs(target, jobs, concurrency or len(specs), request_rate, seed))

    return _with_progress(len(specs), description, run)


def run_conversations(
    target: Target,
    conversations: list[Conversation],
    concurrency: int | None,
    request_rate: float | None,
    seed: int = 0,
    description: str | None = None,
) -> tuple[list[RequestResult], float]:
    """Run multi-turn conversations, all of them active at once (or started at `request_rate` conversations/s),
    each sending its next turn when its previous answer is complete; at most `concurrency` requests in flight
    (None: one per conversation). Results conversation by conversation, turn by turn, and the wall time."""
    total = sum(len(c.turns) for c in conversations)

    def run(progress: tqdm | None) -> tuple[list[RequestResult], float]:
        jobs = [_conversation_job(target, conversation, progress) for conversation in conversations]
        return asyncio.run(_run_jobs(target, jobs, concurrency or len(conversations), request_rate, seed))

    return _with_progress(total, description, run)
