"""POST /start_profile and /stop_profile (as vLLM and trtllm-serve offer): a torch profiler trace of the engine
process, where the model runs, written as Chrome trace JSON (chrome://tracing, Perfetto) to `--profile-dir`.

Off unless `--profile-dir` is set (404). Like every route but /health and /ping, both need the API key when one is set,
so only whoever holds the key can profile. A trace is for one server at a time: a second start is refused (409).
With several API-server processes (--api-server-count) the one engine's profile is theirs together: a file in the
server's private folder says one is running (created and claimed atomically), so a stop reaches it whichever process
the port hands the request to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

from fastapi import APIRouter, Request

from brisk.engine.messages import ProfileRequest
from brisk.server.errors import APIError

logger = logging.getLogger("brisk.server")
# Admin endpoints without input: left out of the OpenAPI schema (and so of /docs and the schema fuzzer).
router = APIRouter(include_in_schema=False)
TRACE_WRITE_TIMEOUT_S = 120.0  # writing a long trace of a busy engine takes a while


def _profile_dir(request: Request) -> str:
    state = request.app.state.brisk
    if state.observability.profile_dir is None:
        raise APIError(404, "Profiling is off; start the server with --profile-dir.", code="profiling_disabled")
    if state.client.dead:
        raise APIError(503, "The engine is not running.", code="engine_dead")
    return state.observability.profile_dir


def _marker(request: Request) -> str | None:
    """The file that says a profile runs, shared by the API-server processes; None: this process alone serves."""
    peers = request.app.state.brisk.peers
    return None if peers is None else os.path.join(peers.ipc_dir, "profiling")


def _begin(request: Request) -> bool:
    """Mark a profile as running from now; False when one already is."""
    marker = _marker(request)
    if marker is None:
        if getattr(request.app.state, "profiling_since", None) is not None:
            return False
        request.app.state.profiling_since = time.time()
        return True
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(repr(time.time()))
    return True


def _end(request: Request) -> float | None:
    """Claim the running profile (one caller wins): when it started; None when none runs."""
    marker = _marker(request)
    if marker is None:
        since, request.app.state.profiling_since = getattr(request.app.state, "profiling_since", None), None
        return since
    claimed = f"{marker}.{os.getpid()}"
    try:
        os.rename(marker, claimed)
    except FileNotFoundError:
        return None
    with open(claimed) as f:
        since = float(f.read())
    os.unlink(claimed)
    return since


@router.post("/start_profile")
async def start_profile(request: Request) -> dict:
    _profile_dir(request)
    if not _begin(request):
        raise APIError(409, "A profile is already being recorded; POST /stop_profile first.", code="profile_running")
    await request.app.state.brisk.client.send_profile_request(ProfileRequest("start"))
    return {"status": "profiling"}


@router.post("/stop_profile")
async def stop_profile(request: Request) -> dict:
    directory = _profile_dir(request)
    since = _end(request)
    if since is None:
        raise APIError(409, "No profile is being recorded; POST /start_profile first.", code="profile_not_running")
    os.makedirs(directory, exist_ok=True)
    name = f"brisk-engine-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"  # never reused
    path = os.path.abspath(os.path.join(directory, name))
    await request.app.state.brisk.client.send_profile_request(ProfileRequest("stop", path))
    deadline = time.monotonic() + TRACE_WRITE_TIMEOUT_S
    while not os.path.exists(path):  # the engine renames the finished file into place
        if time.monotonic() > deadline or request.app.state.brisk.client.dead:
            raise APIError(503, "The engine did not write the profile in time.", code="profile_not_written")
        await asyncio.sleep(0.05)  # polling for the file with a deadline
    return {"status": "stopped", "trace_path": path, "seconds": round(time.time() - since, 3)}
