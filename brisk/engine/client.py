"""API-server side of the engine: starts the engine-core process, talks to it over ZMQ, routes outputs.

Tokenization and detokenization stay in this process (the `OutputProcessor`), so the engine loop
never waits on text work. One API server starts the engine process itself; with several
(--api-server-count) the supervisor starts it and each API-server process attaches to it (`EngineLink`). Each in-flight request has a `DeltaBuffer` of `CompletionDelta`s; a
request whose consumer goes away (client disconnect) or runs past its deadline is aborted in the
core, freeing its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from brisk.config import ConfigError, EngineConfig
from brisk.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreRequest,
    EngineInfo,
    EngineOutputs,
    EngineStartupError,
    FromEngine,
    ProfileRequest,
    SchedulerStats,
    StopEngine,
)
from brisk.engine.output_processor import CompletionDelta, OutputProcessor
from brisk.engine.process import encode_config, run_engine_process
from brisk.errors import InvalidRequest
from brisk.sampling_params import SamplingParams

logger = logging.getLogger("brisk.server")
LIVENESS_POLL_S = 0.5  # how often a quiet output loop checks that the engine process is alive
STOP_TIMEOUT_S = 30.0  # an engine with other ranks: the time it has to stop them and end, before a SIGKILL
# A consumer this many deltas behind (a slow SSE reader) gets its pending deltas merged (see DeltaBuffer).
MAX_PENDING_DELTAS = 64
STATS_FRESH_S = 1.0  # scheduler stats older than this say nothing about the engine's load now


@dataclass(frozen=True)
class EngineLink:
    """How an API-server process reaches an engine process someone else started (brisk/server/api_servers.py)."""

    ipc_dir: str  # the private directory of the IPC sockets
    client_index: int  # this process's place among the API-server processes (its outputs' address)
    engine_pid: int


def make_ipc_dir() -> str:
    """A private directory for the IPC sockets: reachable only by this user (never TCP on 0.0.0.0)."""
    path = tempfile.mkdtemp(prefix="brisk-ipc-")
    os.chmod(path, 0o700)
    return path


def engine_endpoints(ipc_dir: str, client_index: int) -> tuple[str, str]:
    """The (to engine, from engine) addresses of one API-server process; that process binds them."""
    return f"ipc://{ipc_dir}/to_engine_{client_index}", f"ipc://{ipc_dir}/from_engine_{client_index}"


def engine_process(config: EngineConfig, ipc_dir: str, num_clients: int) -> multiprocessing.process.BaseProcess:
    """The engine-core process (not started) serving `num_clients` API-server processes."""
    return multiprocessing.get_context("spawn").Process(
        target=run_engine_process,
        args=(encode_config(config), [engine_endpoints(ipc_dir, i) for i in range(num_clients)], os.getpid()),
        name="brisk-engine-core",
        daemon=True,
    )


def stop_engine_process(engine: multiprocessing.process.BaseProcess, ipc_dir: str, has_other_ranks: bool) -> None:
    """Stop an engine process whose API-server processes have all exited (the supervisor of several): where it has
    other ranks it is told to stop them and end (a SIGKILL would leave launcher-started ranks waiting for its next
    step for ever), through the first API-server process's address, bound again; else, or when it does not end in
    STOP_TIMEOUT_S, SIGKILL (it ignores SIGTERM, and holds nothing to flush)."""
    if engine.is_alive() and has_other_ranks:
        ctx = zmq.Context()
        try:
            to_engine = ctx.socket(zmq.PUSH)
            to_engine.setsockopt(zmq.SNDTIMEO, int(STOP_TIMEOUT_S * 1000))  # the engine reconnects within 0.1 s
            to_engine.bind(engine_endpoints(ipc_dir, 0)[0])
            to_engine.send(msgspec.msgpack.encode(StopEngine()))
            engine.join(STOP_TIMEOUT_S)
        except zmq.ZMQError as exc:  # zmq.Again: it never connected (busy, or wedged): killed below
            logger.warning("could not tell the engine process to stop (%s); killing it", exc)
        finally:
            ctx.destroy(linger=0)
    if engine.is_alive():
        engine.kill()
    engine.join(10)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 tells whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing can be served until the server is restarted."""


class DeltaBuffer:
    """The deltas of one request that its consumer has not taken yet, bounded.

    The engine never waits for a consumer, so a client that stops reading its stream would otherwise
    queue one delta per token. Past `max_pending` deltas the pending ones are coalesced, one per
    completion: the client still receives every token, in fewer, larger chunks. Coalescing rather
    than aborting because a slow network is not a fault; and what a coalesced delta holds is at most
    the completion's output, which the request keeps anyway (bounded by max_tokens).
    """

    def __init__(self, max_pending: int = MAX_PENDING_DELTAS) -> None:
        self.max_pending = max_pending
        self._items: deque[CompletionDelta | Exception] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the consumer's, while it waits for an item
        self.num_coalesced = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: CompletionDelta | Exception) -> None:
        if isinstance(item, CompletionDelta) and len(self._items) >= self.max_pending:
            self._coalesce()
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> CompletionDelta | Exception:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def _coalesce(self) -> None:
        deltas = [item for item in self._items if isinstance(item, CompletionDelta)]
        if len(deltas) < len(self._items):
            return  # an error is pending: the consumer stops there anyway
        merged: dict[int, CompletionDelta] = {}  # per completion index, in order of first appearance
        for delta in deltas:
            merged[delta.index] = merged[delta.index].merged(delta) if delta.index in merged else delta
        self.num_coalesced += len(self._items) - len(merged)
        self._items = deque(merged.values())


class AsyncEngineClient:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        on_engine_death: Callable[[], None] | None = None,
        link: EngineLink | None = None,
    ) -> None:
        """Starts its own engine process, or with `link` attaches to one that runs already."""
        self.config = config
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        self.info: EngineInfo | None = None
        self.stats = SchedulerStats()
        self._stats_at = -STATS_FRESH_S  # time.monotonic() of the last stats
        self.stats_listeners: list[Callable[[SchedulerStats], None]] = []  # called with every stats message
        # called with (requests in flight, deltas coalesced so far) whenever a request starts or ends
        self.in_flight_listeners: list[Callable[[int, int], None]] = []
        self.dead = False
        self.on_engine_death = on_engine_death
        self._queues: dict[str, DeltaBuffer] = {}
        self._idle = asyncio.Event()  # set while no request is in flight (graceful shutdown waits on it)
        self._idle.set()
        self.num_coalesced_deltas = 0
        self.link = link
        self.client_index = 0 if link is None else link.client_index
        self._ipc_dir = make_ipc_dir() if link is None else link.ipc_dir
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._from_engine = self._ctx.socket(zmq.PULL)
        to_addr, from_addr = engine_endpoints(self._ipc_dir, self.client_index)
        self._to_engine.bind(to_addr)
        self._from_engine.bind(from_addr)
        self._from_engine_now = zmq.Socket.shadow(self._from_engine.underlying)  # the same socket, non-async reads
        for addr in (to_addr, from_addr):  # the directory already shuts others out; belt and braces
            os.chmod(addr.removeprefix("ipc://"), 0o600)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._proc = engine_process(config, self._ipc_dir, 1) if link is None else None
        self._output_task: asyncio.Task | None = None

    def _engine_alive(self) -> bool:
        if self.link is not None:
            return process_alive(self.link.engine_pid)
        return self._proc is not None and self._proc.is_alive()

    def _engine_exit_code(self) -> int | None:
        return self._proc.exitcode if self._proc is not None else None

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        if self._proc is not None:
            self._proc.start()
        while True:
            if await self._from_engine.poll(int(LIVENESS_POLL_S * 1000)):
                msg = self._decoder.decode(await self._from_engine.recv())
                if isinstance(msg, EngineInfo):
                    self.info = msg
                    break
                if isinstance(msg, EngineStartupError):
                    raise ConfigError(msg.message)
            elif not self._engine_alive():
                raise EngineDeadError(f"the engine process exited with code {self._engine_exit_code()} while starting")
        self._output_task = asyncio.create_task(self._output_loop(), name="brisk-engine-outputs")
        return self.info

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        if self._proc is not None and self._proc.is_alive() and self.config.tp_size > 1:
            # Ranks on other processes wait for the engine's next step: it tells them to stop, then ends.
            await self._to_engine.send(self._encoder.encode(StopEngine()))
            await asyncio.to_thread(self._proc.join, STOP_TIMEOUT_S)
        if self._proc is not None and self._proc.is_alive():
            # The engine ignores SIGTERM/SIGINT (a signal to the whole process group must not kill it
            # before the server has drained), so it is stopped with SIGKILL; it holds nothing to flush.
            self._proc.kill()
            self._proc.join(timeout=10)
        self._ctx.destroy(linger=0)
        if self.link is None:  # an attached process's directory is its supervisor's to remove
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def engine_load(self) -> int:
        """Requests in the engine (running and waiting, every API-server process's), as its last stats said; 0
        when they are stale (an API-server process hears from the engine only about its own requests)."""
        if time.monotonic() - self._stats_at > STATS_FRESH_S:
            return 0
        return self.stats.num_running + self.stats.num_waiting

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if some still are after `timeout` seconds."""
        if self._idle.is_set():  # (asyncio.wait_for with 0 seconds times out before the wait starts)
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def abort_all(self) -> None:
        """Abort every in-flight request: each ends with finish_reason "abort" (used at shutdown)."""
        if self._queues and not self.dead:
            await self._to_engine.send(self._encoder.encode(AbortRequests([(rid, -1) for rid in self._queues])))

    async def send_profile_request(self, request: ProfileRequest) -> None:
        """Start or stop the torch profiler in the engine process (POST /start_profile, /stop_profile)."""
        await self._to_engine.send(self._encoder.encode(request))

    # ---- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        timeout: float | None = None,
        detokenize: bool = True,
        cache_salt: str | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Yields each completion delta until all n completions are finished; aborts if abandoned.

        After `timeout` seconds the request is aborted in the core; the completions still running then
        end with finish_reason "abort" (their output so far is kept). `detokenize` False: deltas without text.
        """
        if self.dead:
            raise EngineDeadError("the engine core is not running")
        buffer = DeltaBuffer()
        self._queues[request_id] = buffer
        self._idle.clear()
        self._in_flight_changed()
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, detokenize)
        deadline = None if timeout is None else time.monotonic() + timeout
        num_unfinished = params.n  # completions whose final delta the consumer has not taken yet
        finished = False
        try:
            await self._to_engine.send(
                self._encoder.encode(
                    AddRequest(EngineCoreRequest(request_id, prompt_token_ids, params, cache_salt), self.client_index)
                )
            )
            while True:
                if deadline is None:
                    item = await buffer.get()
                else:
                    try:
                        item = await asyncio.wait_for(buffer.get(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        deadline = None  # abort once; the core answers with the final "abort" outputs
                        await self._to_engine.send(self._encoder.encode(AbortRequests([(request_id, -1)])))
                        continue
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                # Not `item.output.finished`: the cumulative output is shared by all deltas and is finished
                # as soon as the engine is, while a slow consumer may still have deltas to take.
                num_unfinished -= item.finish_reason is not None
                if num_unfinished == 0:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            self.num_coalesced_deltas += buffer.num_coalesced
            if not self._queues:
                self._idle.set()
            self._in_flight_changed()
            if not finished:  # client went away or the consumer stopped early
                self.output_processor.abort(request_id)
                if not self.dead:
                    await self._to_engine.send(self._encoder.encode(AbortRequests([(request_id, -1)])))

    def _in_flight_changed(self) -> None:
        for listener in self.in_flight_listeners:
            listener(len(self._queues), self.num_coalesced_deltas)

    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._from_engine.poll(int(LIVENESS_POLL_S * 1000)):
                    if not self._engine_alive():
                        self._engine_died()
                        return
                    continue
                # Every message that is there now, read without awaiting again (the engine may have sent several).
                while True:
                    try:
                        frame = self._from_engine_now.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msg = self._decoder.decode(frame)
                    if isinstance(msg, EngineOutputs):
                        await self._dispatch(msg)
                        # The requests' tasks take this message's deltas before the next is read: a delta each,
                        # rather than deltas piling up and being coalesced as if every client read slowly.
                        await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("engine output loop failed")
            self._engine_died()

    async def _dispatch(self, msg: EngineOutputs) -> None:
        self.stats = msg.stats
        self._stats_at = time.monotonic()
        for listener in self.stats_listeners:
            listener(msg.stats)
        for rid, param, message in msg.refused:
            self.output_processor.abort(rid)
            buffer = self._queues.get(rid)
            if buffer is not None:
                buffer.put(InvalidRequest(param, message))
        processed = self.output_processor.process(msg.outputs)
        for delta in processed.deltas:
            buffer = self._queues.get(delta.request_id)
            if buffer is not None:
                buffer.put(delta)
        if processed.aborts:  # stop strings: the core stops generating those completions
            await self._to_engine.send(self._encoder.encode(AbortRequests(processed.aborts)))

    def _engine_died(self) -> None:
        if self.dead:
            return
        self.dead = True
        logger.error("the engine core process died (exit code %s)", self._engine_exit_code())
        for buffer in self._queues.values():
            buffer.put(EngineDeadError("the engine core died while serving this request"))
        if self.on_engine_death is not None:
            self.on_engine_death()
