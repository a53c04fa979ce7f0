"""The engine-core process: a busy loop that owns the model, fed and drained over ZMQ.

Each API-server process binds two IPC sockets in a private directory; this process connects to every pair, loads
the model, announces `EngineInfo` to each, then alternates between draining requests (blocking only when idle)
and running one `EngineCore.step()`. With several API-server processes (--api-server-count) every request's
outputs go back to the process that sent it (`OutputRouter`).

Its lifetime belongs to the API server: it ignores SIGINT/SIGTERM (a Ctrl-C or a SIGTERM sent to the
whole process group must not kill it while the server drains in-flight requests), the server stops it
with SIGKILL, and it exits by itself if the server disappears (so it is never left orphaned).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Container

import msgspec
import torch
import zmq
from tqdm import tqdm

from brisk.config import ConfigError, EngineConfig
from brisk.engine.core import EngineCore
from brisk.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineInfo,
    EngineOutputs,
    EngineStartupError,
    ProfileRequest,
    StopEngine,
    ToEngine,
)
from brisk.engine.output_batcher import StreamIntervalBatcher
from brisk.engine.profiler import EngineProfiler
from brisk.errors import InvalidRequest
from brisk.host import cpu_threads_per_rank, freeze_startup_heap, resolve_device

logger = logging.getLogger("brisk.engine")
IDLE_POLL_MS = 1000  # how long an idle loop blocks waiting for work
STARTUP_ERROR_EXIT = 2  # the engine could not start for a reason it reported (EngineStartupError)
OUT_OF_MEMORY = (
    "the model does not fit in GPU memory (out of memory while loading it and sizing the KV cache): use more GPUs "
    "(--tp_size {config.tp_size} -> more), or lower max_num_tokens ({config.max_num_tokens}) / max_batch_size "
    "({config.max_batch_size})"
)
PR_SET_PDEATHSIG = 1  # prctl option: the signal this process gets when its parent ends


def encode_config(config: EngineConfig) -> bytes:
    """The config as the engine process gets it: only the fields that were given (with the values in effect), so that
    the process's `model_fields_set` is the server's. Dumped whole, every field would count as given: on a CPU the
    default cuda_graph_config would then run served decode steps on the padded static buffers (padding rows cost
    real compute; the offline engine does not pad)."""
    return config.model_dump_json(exclude_unset=True).encode()


def end_with_parent(parent_pid: int) -> None:
    """On Linux, have the kernel SIGKILL this process when its parent (the API server, or the supervisor of several)
    ends, however it ends: a parent killed outright runs no cleanup, and an engine blocked sending to an API server
    would never see getppid() change. `parent_pid`: the parent that started this process, as it said: one that died
    before this call (a spawned child imports for seconds first) has left this process to init, where it would run
    on alone holding its GPU; it ends now instead."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the getppid() checks remain
    if os.getppid() != parent_pid:
        os._exit(1)


def run_engine_process(config_json: bytes, endpoints: list[tuple[str, str]], parent_pid: int) -> None:
    """The engine-core process's main: `endpoints` are the (to engine, from engine) addresses of each API-server
    process, in the order of their `client_index`; `parent_pid`, the process that started it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    # tqdm's default lock (the weight loader's progress bar) is a multiprocessing semaphore: this process ends by
    # SIGKILL or a start-up error, and the parent's resource tracker then warns about it on the user's terminal.
    tqdm.set_lock(threading.RLock())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end_with_parent(parent_pid)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)  # fair-queued from every API-server process
    outboxes = []
    for to_engine_addr, from_engine_addr in endpoints:
        inbox.connect(to_engine_addr)
        outboxes.append(ctx.socket(zmq.PUSH))
        outboxes[-1].connect(from_engine_addr)
    try:
        config = EngineConfig.model_validate_json(config_json)
        try:
            if resolve_device(config.device).type == "cpu":  # (a GPU that does not exist: a ConfigError)
                torch.set_num_threads(cpu_threads_per_rank(config.tp_size, config.num_cpu_threads))
            core = EngineCore(config)
        except (ConfigError, torch.cuda.OutOfMemoryError) as exc:
            message = str(exc) if isinstance(exc, ConfigError) else OUT_OF_MEMORY.format(config=config)
            logger.debug("engine start-up failed:\n%s", traceback.format_exc())
            for outbox in outboxes:
                outbox.send(msgspec.msgpack.encode(EngineStartupError(message)))
                outbox.close(linger=10_000)  # delivered before the process goes
            sys.exit(STARTUP_ERROR_EXIT)
        freeze_startup_heap()
        _serve(core, inbox, OutputRouter(outboxes), parent_pid)
    except Exception:
        logger.error("engine core failed:\n%s", traceback.format_exc())
        sys.exit(1)


class OutputRouter:
    """Sends each output to the API-server process that owns its request. Process 0 gets the scheduler stats with
    every message (its /metrics reports the engine's side for all of them), so it gets one whenever any is sent."""

    def __init__(self, outboxes: list[zmq.Socket]) -> None:
        self.outboxes = outboxes
        self.encoder = msgspec.msgpack.Encoder()
        self._owners: dict[str, int] = {}  # request id -> its API-server process (with several of them)

    def broadcast(self, message: EngineInfo) -> None:
        for outbox in self.outboxes:
            outbox.send(self.encoder.encode(message))

    def added(self, request_id: str, client_index: int) -> None:
        if len(self.outboxes) > 1:
            self._owners[request_id] = client_index

    def send(self, batch: EngineOutputs, in_flight: Container[str]) -> None:
        """Send `batch`; `in_flight` (the core's requests) says which requests are over, so forgotten here."""
        if len(self.outboxes) == 1:
            self.outboxes[0].send(self.encoder.encode(batch))
            return
        parts = [EngineOutputs([], [], batch.stats)]
        others = msgspec.structs.replace(batch.stats, iteration_tokens=())  # steps are counted once, by process 0
        parts += [EngineOutputs([], [], others) for _ in self.outboxes[1:]]
        owners = self._owners
        for out in batch.outputs:
            parts[owners.get(out.request_id, 0)].outputs.append(out)
        for refusal in batch.refused:
            parts[owners.get(refusal[0], 0)].refused.append(refusal)
        for rid in {out.request_id for out in batch.outputs}.union(r[0] for r in batch.refused):
            if rid not in in_flight:
                owners.pop(rid, None)
        for index, part in enumerate(parts):
            if index == 0 or part.outputs or part.refused:
                self.outboxes[index].send(self.encoder.encode(part))


def _serve(core: EngineCore, inbox: zmq.Socket, router: OutputRouter, parent_pid: int) -> None:
    decoder = msgspec.msgpack.Decoder(ToEngine)
    mc = core.model_config
    router.broadcast(
        EngineInfo(
            mc.architecture,
            mc.vocab_size,
            core.max_seq_len,
            core.num_kv_blocks,
            list(core.executor.kv_cache_spec.block_sizes),
        )
    )
    profiler = EngineProfiler()
    iteration_tokens: list[int] = []  # tokens of each step since stats were last sent (a step may send nothing)
    batcher = StreamIntervalBatcher(core.config.stream_interval)  # outputs held as the API's stream would hold them
    while os.getppid() == parent_pid:  # re-parented: the API server is gone
        timeout = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
        batch = EngineOutputs([])
        while inbox.poll(timeout):
            timeout = 0
            msg = decoder.decode(inbox.recv())
            if isinstance(msg, AddRequest):
                rid = msg.request.request_id
                router.added(rid, msg.client_index)
                try:
                    core.add_request(msg.request)
                except InvalidRequest as exc:
                    batch.refused.append((rid, exc.param, exc.message))
                except Exception:
                    logger.exception("cannot add request %s", rid)
                    batch.refused.append((rid, "request", "the engine could not accept this request"))
            elif isinstance(msg, AbortRequests):
                for rid, index in msg.targets:
                    batch.outputs.extend(batcher.add(core.abort_request(rid, None if index < 0 else index)))
            elif isinstance(msg, ProfileRequest) and msg.action == "start":
                profiler.start()
            elif isinstance(msg, ProfileRequest):
                profiler.stop(msg.trace_path)
            elif isinstance(msg, StopEngine):
                core.shutdown()  # the other ranks stop too
                logger.info("the engine core stopped")
                return
        if core.has_unfinished_requests():
            step = core.step()
            batch.outputs.extend(batcher.add(step.outputs))
            for rid, refusal in step.refused:
                batcher.forget(rid)
                batch.refused.append((rid, refusal.param, refusal.message))
            if step.num_tokens:  # a step that could schedule nothing (waiting for KV) is no iteration
                iteration_tokens.append(step.num_tokens)
        if batch.outputs or batch.refused:
            batch.stats = core.stats(tuple(iteration_tokens))
            iteration_tokens.clear()
            router.send(batch, core.requests)
    logger.error("the API server process is gone; the engine core exits")
