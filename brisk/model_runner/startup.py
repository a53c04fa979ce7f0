"""How long each stage of a ModelRunner's start-up took: the cold start users wait for, stage by stage.

The runner marks the end of each stage (weights built and filled, the rest of its set-up, KV sizing by profiling,
the KV allocation, CUDA graph capture); a stage is the time since the previous mark, with the device synchronised
at each mark so that asynchronous GPU work is charged to the stage that launched it. `benchmarks/gpu_suite.py`
reports the stages as rows; the runner logs them once.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


class StartupTimes:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}  # stage -> seconds, in the order the stages ran
        self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        """The stage that ends now: the time since the previous mark (or since this record was made)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[stage] = now - self._last
        self._last = now

    def log(self) -> None:
        stages = ", ".join(f"{name} {s:.1f}" for name, s in self.seconds.items())
        logger.info("start-up (s): %s; total %.1f", stages, sum(self.seconds.values()))
