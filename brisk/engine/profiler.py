"""torch profiler in the engine-core process (where the model runs), driven by POST /start_profile and
/stop_profile through `ProfileRequest` messages."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("brisk.engine")


class EngineProfiler:
    def __init__(self) -> None:
        self._profiler: torch.profiler.profile | None = None

    def start(self) -> None:
        if self._profiler is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()
        logger.info("profiler started")

    def stop(self, path: str) -> None:
        """Stop and write the Chrome trace JSON to `path`; it appears there whole (written aside, then renamed)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        partial = f"{path}.partial"
        profiler.export_chrome_trace(partial)
        os.replace(partial, path)
        logger.info("profiler trace written to %s", path)
