"""Graceful shutdown on SIGTERM / SIGINT: drain, then stop.

uvicorn alone would close the listening socket at once and, after serving, re-raise the signal, so the
process died by SIGTERM (exit code -15) and never stopped the engine process. Here the first signal
starts a drain instead:
  1. new requests get 503 (`ServerState.draining`; /health turns 503, so load balancers move away),
  2. in-flight requests may finish for up to `shutdown_timeout` seconds,
  3. those still running are aborted (they end with finish_reason "abort"),
  4. uvicorn shuts down (closing connections once their last bytes are sent) and `serve` returns 0.
A second signal skips the drain.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from brisk.server.state import ServerState

logger = logging.getLogger("brisk.server")
ABORT_GRACE_S = 5.0  # after aborting, how long the engine gets to report the aborted requests


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        shutdown_timeout: float,
        on_listening: Callable[[], None] | None = None,
    ) -> None:
        """`on_listening` is called once the server accepts connections on its sockets (ready to serve)."""
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.on_listening = on_listening
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_listening is not None:
            self.on_listening()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in a signal handler: only set flags; on_tick (every 0.1 s, on the event loop) acts on them. New
        # requests are refused from now on, not from the next tick. Not recording the signal keeps uvicorn from
        # re-raising it after serving.
        if self._drain_requested:
            self.should_exit = True
            self.force_exit = True
        self._drain_requested = True
        self.state.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        client = self.state.client
        self.state.draining = True
        logger.info(
            "shutting down: refusing new requests, waiting up to %.1fs for %d in flight",
            self.shutdown_timeout,
            client.num_in_flight,
        )
        if not await client.wait_idle(self.shutdown_timeout):
            logger.warning("shutting down: aborting %d requests still in flight", client.num_in_flight)
            await client.abort_all()
            await client.wait_idle(ABORT_GRACE_S)
        self.should_exit = True
