"""API-server side of the engine: starts the engine-core process, talks to it over ZMQ, routes outputs.

Tokenization and detokenization stay in this process (the `OutputProcessor`), so the engine loop
never waits on text work. Each in-flight request has an asyncio queue of `CompletionDelta`s; a
request whose consumer goes away (client disconnect) is aborted in the core, freeing its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from brisk.config import EngineConfig
from brisk.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreRequest,
    EngineInfo,
    EngineOutputs,
    FromEngine,
)
from brisk.engine.output_processor import CompletionDelta, OutputProcessor
from brisk.engine.process import run_engine_process
from brisk.sampling_params import SamplingParams

logger = logging.getLogger("brisk.server")
LIVENESS_POLL_S = 0.5  # how often a quiet output loop checks that the engine process is alive


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing can be served until the server is restarted."""


class RequestFailedError(ValueError):
    """The engine core refused the request (e.g. it can never fit the KV cache)."""


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, tokenizer, on_engine_death: Callable[[], None] | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        self.info: EngineInfo | None = None
        self.stats = EngineStats()
        self.dead = False
        self.on_engine_death = on_engine_death
        self._queues: dict[str, asyncio.Queue] = {}
        # Private directory: the IPC sockets are reachable only by this user (never TCP on 0.0.0.0).
        self._ipc_dir = tempfile.mkdtemp(prefix="brisk-ipc-")
        os.chmod(self._ipc_dir, 0o700)
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._from_engine = self._ctx.socket(zmq.PULL)
        to_addr, from_addr = f"ipc://{self._ipc_dir}/to_engine", f"ipc://{self._ipc_dir}/from_engine"
        self._to_engine.bind(to_addr)
        self._from_engine.bind(from_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(config.model_dump_json().encode(), to_addr, from_addr),
            name="brisk-engine-core", daemon=True,
        )
        self._output_task: asyncio.Task | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        self._proc.start()
        while True:
            if await self._from_engine.poll(int(LIVENESS_POLL_S * 1000)):
                msg = self._decoder.decode(await self._from_engine.recv())
                if isinstance(msg, EngineInfo):
                    self.info = msg
                    break
            elif not self._proc.is_alive():
                raise EngineDeadError(f"the engine process exited with code {self._proc.exitcode} while starting")
        self._output_task = asyncio.create_task(self._output_loop(), name="brisk-engine-outputs")
        return self.info

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None) -> AsyncIterator[CompletionDelta]:
        """Yields each completion delta until all n completions are finished; aborts if abandoned."""
        if self.dead:
            raise EngineDeadError("the engine core is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        finished = False
        try:
            await self._to_engine.send(self._encoder.encode(AddRequest(EngineCoreRequest(request_id, prompt_token_ids, params))))
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                if item.output.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # client went away or the consumer stopped early
                self.output_processor.abort(request_id)
                if not self.dead:
                    await self._to_engine.send(self._encoder.encode(AbortRequests([(request_id, -1)])))

    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._from_engine.poll(int(LIVENESS_POLL_S * 1000)):
                    if not self._proc.is_alive():
                        self._engine_died()
                        return
                    continue
                msg = self._decoder.decode(await self._from_engine.recv())
                if isinstance(msg, EngineOutputs):
                    await self._dispatch(msg)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug here must not leave requests hanging
            logger.exception("engine output loop failed")
            self._engine_died()

    async def _dispatch(self, msg: EngineOutputs) -> None:
        self.stats = EngineStats(msg.num_running, msg.num_waiting, msg.kv_usage, msg.prefix_queries, msg.prefix_hits)
        for failure in msg.failures:
            self.output_processor.abort(failure.request_id)
            queue = self._queues.get(failure.request_id)
            if queue is not None:
                queue.put_nowait(RequestFailedError(failure.message))
        processed = self.output_processor.process(msg.outputs)
        for delta in processed.deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
        if processed.aborts:  # stop strings: the core stops generating those completions
            await self._to_engine.send(self._encoder.encode(AbortRequests(processed.aborts)))

    def _engine_died(self) -> None:
        if self.dead:
            return
        self.dead = True
        logger.error("the engine core process died (exit code %s)", self._proc.exitcode)
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError("the engine core died while serving this request"))
        if self.on_engine_death is not None:
            self.on_engine_death()
