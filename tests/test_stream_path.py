"""The streaming path's shortcuts give what the long way gave: the engine's stream_interval batching releases the
chunks the API's accumulator releases, chunk templates write the bytes pydantic writes, `interleave` reads several
generations as one stream, and a histogram observed in bulk equals one observed value by value."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from brisk.engine.messages import EngineCoreOutput, TokenLogprob
from brisk.engine.output_batcher import StreamIntervalBatcher
from brisk.engine.output_processor import CompletionDelta
from brisk.server.metrics import TOKEN_LATENCY_BUCKETS, observe_all
from brisk.server.schemas import ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice, CompletionChunk
from brisk.server.streaming import TEXT_PLACEHOLDER, StreamAccumulator, TextChunkTemplate, interleave, sse


# ---- stream_interval in the engine -------------------------------------------------------------------------------
def random_steps(rng: random.Random, num_completions: int) -> list[list[EngineCoreOutput]]:
    """Per engine step, the outputs of the completions still running: 1-4 tokens each (speculative decoding),
    some with logprobs, every completion finishing at a random step (some aborted between steps)."""
    lengths = {i: rng.randint(1, 40) for i in range(num_completions)}
    made = dict.fromkeys(lengths, 0)
    steps, token = [], 0
    while any(made[i] < lengths[i] for i in lengths):
        step = []
        for i in lengths:
            if made[i] >= lengths[i] or rng.random() < 0.2:  # finished, or not scheduled this step
                continue
            k = min(rng.randint(1, 4), lengths[i] - made[i])
            ids = list(range(token, token + k))
            token += k
            made[i] += k
            done = made[i] == lengths[i]
            logprobs = [TokenLogprob(t, -0.5, []) for t in ids] if i % 2 else None
            step.append(EngineCoreOutput(f"r{i // 2}", i % 2, ids, logprobs, finish_reason="length" if done else None))
        steps.append(step)
    return steps


def accumulated(outputs_per_message: list[list[EngineCoreOutput]], interval: int) -> list[tuple]:
    """What the API's accumulator releases for these messages, in order."""
    accumulator = StreamAccumulator(interval)
    released = []
    for outputs in outputs_per_message:
        for out in outputs:
            logprobs = [{lp.token_id: lp.logprob} for lp in out.logprobs] if out.logprobs is not None else None
            delta = CompletionDelta(out.request_id, out.index, "", list(out.new_token_ids), logprobs, out.finish_reason,
                                    None, None, out.num_steps)  # fmt: skip
            chunk = accumulator.add((out.request_id, out.index), delta)
            if chunk is not None:
                released.append((chunk.request_id, chunk.index, chunk.token_ids, chunk.logprobs, chunk.finish_reason))
    return released


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), interval=st.integers(1, 12), num_completions=st.integers(1, 6))
def test_engine_batching_releases_the_chunks_of_per_step_messages(seed, interval, num_completions):
    steps = random_steps(random.Random(seed), num_completions)
    batcher = StreamIntervalBatcher(interval)
    # what crosses the process boundary: copies (the batcher extends the outputs it holds)
    wire = msgspec.msgpack.Decoder(list[EngineCoreOutput])
    messages = [batcher.add(wire.decode(msgspec.msgpack.encode(step))) for step in steps]
    assert accumulated(messages, interval) == accumulated(steps, interval)
    assert not batcher._held and not batcher._num_held and not batcher._started  # nothing left once all finished
    sent = [out for message in messages for out in message]
    assert len(sent) <= sum(map(len, steps))  # fewer outputs cross the process boundary (with long enough outputs)
    # Each completion's first token went out in the step that made it (the time-to-first-token clock).
    first_step = {}
    for n, step in enumerate(steps):
        for out in step:
            first_step.setdefault((out.request_id, out.index), n)
    for key, n in first_step.items():
        assert any((o.request_id, o.index) == key for o in messages[n])
    # Every engine step's tokens are counted once (for the per-step inter-token latency).
    assert sum(o.num_steps for o in sent) == sum(map(len, steps))


def test_engine_batching_sends_an_output_per_interval():
    batcher = StreamIntervalBatcher(10)
    sent = [
        batcher.add([EngineCoreOutput("a", 0, [t], finish_reason="length" if t == 29 else None)]) for t in range(30)
    ]
    # the first token at once, then tokens 2-10 (the accumulator's first chunk), 11-20, and 21-30 with the finish
    assert [[o.new_token_ids for o in message] for message in sent if message] == [
        [[0]],
        [list(range(1, 10))],
        [list(range(10, 20))],
        [list(range(20, 30))],
    ]
    assert [o.num_steps for message in sent for o in message] == [1, 9, 10, 10]


def test_engine_batching_forgets_a_failed_request():
    batcher = StreamIntervalBatcher(8)
    assert batcher.add([EngineCoreOutput("a", 0, [1]), EngineCoreOutput("b", 0, [2])]) != []  # first tokens
    assert batcher.add([EngineCoreOutput("a", 0, [3]), EngineCoreOutput("b", 0, [4])]) == []  # held
    batcher.forget("a")
    assert [k for k in batcher._held] == [("b", 0)]


# ---- chunk templates ---------------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(text=st.text(), index=st.integers(0, 5), with_usage=st.booleans())
def test_chunk_templates_write_what_pydantic_writes(text, index, with_usage):
    def completion(value: str) -> CompletionChunk:
        choice = CompletionChoice(index=index, text=value, logprobs=None, finish_reason=None, stop_reason=None)
        body = CompletionChunk(id="cmpl-1", created=7, model="m", choices=[choice])
        if with_usage:
            body.usage = None
        return body

    def chat(value: str) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=ChatDelta(reasoning_content=value), logprobs=None)
        return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[choice])

    for model in (completion, chat):
        assert TextChunkTemplate(model(TEXT_PLACEHOLDER)).render(text) == sse(model(text)).encode()
        assert json.loads(TextChunkTemplate(model(TEXT_PLACEHOLDER)).render(text)[len("data: ") :]) == json.loads(
            model(text).model_dump_json(exclude_unset=True)
        )


def test_a_template_needs_the_placeholder_once():
    choice = CompletionChoice(index=0, text="no placeholder")
    with pytest.raises(ValueError):
        TextChunkTemplate(CompletionChunk(id="x", created=0, model="m", choices=[choice]))


# ---- several generations as one stream -----------------------------------------------------------------------------
def test_interleave_reads_all_items_and_closes_what_it_read():
    closed: list[int] = []

    async def generation(i: int, n: int):
        try:
            for k in range(n):
                await asyncio.sleep(0)
                yield (i, k)
        finally:
            closed.append(i)

    async def run():
        many = [item async for item in interleave([generation(i, 3 + i) for i in range(3)])]
        assert sorted(many) == sorted((i, (i, k)) for i in range(3) for k in range(3 + i))
        for i in range(3):  # each generation's own order is kept
            assert [k for p, (_, k) in many if p == i] == list(range(3 + i))
        one = interleave([generation(9, 5)])
        assert await one.__anext__() == (0, (9, 0))
        await one.aclose()  # the consumer leaves early: the generation is closed (the engine request aborted)
        assert 9 in closed

    asyncio.run(run())


def test_interleave_raises_a_generations_error():
    async def failing():
        yield 1
        raise ValueError("engine gone")

    async def fine():
        for _ in range(100):
            await asyncio.sleep(0)
            yield 2

    async def run():
        with pytest.raises(ValueError, match="engine gone"):
            async for _ in interleave([failing(), fine()]):
                pass

    asyncio.run(run())


# ---- metrics ----------------------------------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.floats(0, 20, allow_nan=False), max_size=200))
def test_a_histogram_observed_in_bulk_equals_one_observed_value_by_value(values):
    one, bulk = CollectorRegistry(), CollectorRegistry()
    for registry in (one, bulk):
        Histogram("itl", "d", ["m"], buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
    one_child = one._names_to_collectors["itl"].labels("x")  # type: ignore[attr-defined]
    for v in values:
        one_child.observe(v)
    observe_all(bulk._names_to_collectors["itl"].labels("x"), values)  # type: ignore[attr-defined]

    def samples(registry):
        lines = generate_latest(registry).decode().splitlines()
        return [line for line in lines if not line.startswith("#") and "_created" not in line]

    lines_one, lines_bulk = samples(one), samples(bulk)
    assert [line.rsplit(" ", 1)[0] for line in lines_one] == [line.rsplit(" ", 1)[0] for line in lines_bulk]
    assert [float(line.rsplit(" ", 1)[1]) for line in lines_one] == pytest.approx(
        [float(line.rsplit(" ", 1)[1]) for line in lines_bulk]
    )


def test_keep_alive_comments_fill_a_silent_stream_and_a_hang_up_closes_it():
    """--sse-keep-alive-interval: while the next event is awaited (a queue, a long prefill), an SSE comment goes out
    every interval, without disturbing that await; a client that hangs up meanwhile closes the route's generator
    (which aborts its requests in the engine)."""
    import asyncio

    from brisk.server.streaming import DONE_EVENT, KEEP_ALIVE_EVENT, EventStreamResponse

    async def run(hang_up: bool) -> tuple[list[bytes], bool]:
        release, closed, kept_alive = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def chunks():
            try:
                yield "data: 1\n\n"
                await release.wait()  # the engine's next token, held until a keep-alive went out
                yield "data: 2\n\n"
            finally:
                closed.set()

        sent: list[bytes] = []

        async def send(message):
            sent.append(message.get("body", b""))
            if message.get("body") == KEEP_ALIVE_EVENT:
                kept_alive.set()
                if not hang_up:
                    release.set()

        streaming = asyncio.create_task(EventStreamResponse(chunks(), keep_alive_s=0.01).stream_response(send))
        if hang_up:
            await asyncio.wait_for(kept_alive.wait(), 30)
            streaming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(streaming, 30)
        return [b for b in sent if b], closed.is_set()

    bodies, closed = asyncio.run(run(hang_up=False))
    assert bodies[0] == b"data: 1\n\n" and bodies[1] == KEEP_ALIVE_EVENT and closed
    assert bodies[-2:] == [b"data: 2\n\n", DONE_EVENT.encode()]
    bodies, closed = asyncio.run(run(hang_up=True))
    assert closed and b"data: 2\n\n" not in bodies
