"""`brisk serve --tp_size 2` on CPU: it serves what one rank serves, a dead rank makes it unhealthy and exit
non-zero (never a hang), no worker outlives the server, and torchrun-launched ranks work the same way."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from brisk import LLM, SamplingParams
from tests.server_utils import RunningServer, free_port, wait_until
from tests.tiny_models import make_tiny_llama_with_tokenizer

PROMPT_IDS = [1, 17, 42, 99, 7, 250, 31]
MAX_TOKENS = 8
SERVE_ARGS = ("--tp_size", "2", "--device", "cpu", "--max_batch_size", "8", "--served-model-name", "m")


@pytest.fixture(scope="module")
def model_and_expected(tmp_path_factory) -> tuple[str, str]:
    path = make_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("llama"))
    with LLM(path, device="cpu") as llm:
        out = llm.generate(
            {"prompt_token_ids": PROMPT_IDS}, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        )
    assert len(out[0].outputs[0].token_ids) == MAX_TOKENS
    return path, out[0].outputs[0].text


def _complete(server: RunningServer) -> str:
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={
            "model": "m",
            "prompt": PROMPT_IDS,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    return body["choices"][0]["text"]


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except FileNotFoundError:
                continue
            found += kids
            todo += kids
    return found


def _workers(server_pid: int) -> list[int]:
    workers = []
    for pid in _descendants(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"brisk.distributed.worker" in f.read():
                    workers.append(pid)
        except FileNotFoundError:
            pass
    return workers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_tp2_server_matches_one_rank_and_exits_non_zero_when_a_rank_dies(model_and_expected):
    path, expected = model_and_expected
    server = RunningServer(path, *SERVE_ARGS)
    try:
        assert _complete(server) == expected
        workers = _workers(server.proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert wait_until(lambda: server.proc.poll() is not None, timeout=60), "server still running"
        assert server.proc.returncode != 0
        assert "rank 1 exited" in server.log()
    finally:
        server.stop()


def test_no_worker_outlives_the_server(model_and_expected):
    path, _ = model_and_expected
    server = RunningServer(path, *SERVE_ARGS)
    workers = _workers(server.proc.pid)
    assert len(workers) == 1
    assert server.stop() == 0  # SIGTERM: drained, exit 0
    assert wait_until(lambda: not _alive(workers[0]), timeout=30), "the worker outlived the server"


def test_torchrun_launch(model_and_expected):
    path, expected = model_and_expected
    launcher = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "brisk.cli",
        "serve",
    ]
    server = RunningServer(path, *SERVE_ARGS, launcher=launcher)
    ranks = _descendants(server.proc.pid)
    try:
        assert _complete(server) == expected
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()
    assert wait_until(lambda: not any(_alive(p) for p in ranks), timeout=30), "a rank outlived torchrun"


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().split(") ")[-1].split()[1])
    except FileNotFoundError:
        return None


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except (FileNotFoundError, PermissionError):
        return None
    rank = env.get(b"RANK")
    return int(rank) if rank is not None and b"TORCHELASTIC_RUN_ID" in env else None


def test_torchrun_ranks_end_when_rank_0_alone_is_stopped(model_and_expected):
    """SIGTERM to rank 0's `brisk serve` only (not to torchrun, which would pass it to every rank): it drains and
    tells the other ranks to stop, so the whole job ends; the other ranks used to wait for a next step forever."""
    path, _ = model_and_expected
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    server = RunningServer(path, *SERVE_ARGS, launcher=[*launcher, "-m", "brisk.cli", "serve"])
    try:
        # torchrun's own children (rank 0's engine process, a grandchild, has its RANK too)
        ranks = {_rank_of(p): p for p in _descendants(server.proc.pid) if _parent_of(p) == server.proc.pid}
        assert 0 in ranks and 1 in ranks, ranks
        os.kill(ranks[0], signal.SIGTERM)
        assert wait_until(lambda: server.proc.poll() is not None, timeout=90), server.log()[-4000:]
        assert not _alive(ranks[1])
    finally:
        server.stop()
