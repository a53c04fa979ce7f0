"""brisk on Ray Serve: more replicas than one machine holds, behind one OpenAI-compatible endpoint.

    pip install 'brisk-llm[ray]'
    python deploy/ray/serve_brisk.py MODEL --replicas 4 [--max-replicas 8] [--routing prefix] -- [brisk serve flags]

- `BriskEngine`: each Ray Serve replica runs one `brisk serve` (its own engine process and KV cache) on a local
  port and streams its responses back. Ray Serve scales the replica count on ongoing requests
  (`--max-replicas`: autoscaling between `--replicas` and it) and restarts a replica whose server died
  (`check_health`).
- `BriskIngress`: the HTTP entry (Ray Serve's proxy, port 8000 by default): `/v1/completions`,
  `/v1/chat/completions`, `/v1/models`, `/health`. A request whose replica fails before the first byte of the
  response body reached the client (connection refused, replica killed, 503 while draining) is retried on
  another replica, up to `RETRIES` times; once bytes are streamed an error can only be reported in-band.
- Routing (`--routing`): `prefix` is Ray's `PrefixCacheAffinityRouter`: a prefix tree of the prompts each replica
  was sent; while the replicas' queues are within `imbalanced_threshold` of each other a request goes to the
  replica whose prompts share the longest prefix with it (at least 10 % of it), so its prefix-cache blocks are
  hit; otherwise power of two choices. `round_robin` (`RoundRobinRouter`, below) and `pow2` (Ray's default) are
  the baselines. Measured in docs/performance.md ("Ray Serve: prefix-aware routing").
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations on Ray's workers, where this
# module's globals travel by value only as far as code references them.
import argparse
import asyncio
import ctypes
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

RETRIES = 3  # other replicas a request may be retried on before its first byte
STARTUP_TIMEOUT_S = 600.0
ROUTERS = {
    # Ray's PrefixCacheAffinityRouter by its defining module: the public alias, ray.serve.llm.request_router,
    # imports all of ray.llm (pyarrow and more) that brisk does not need.
    "prefix": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter",
    "round_robin": None,  # set below: RoundRobinRouter
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
}


class BriskRequest:
    """What the ingress hands a replica. Ray's prefix-aware router reads the prompt from a `messages` or a
    `prompt` attribute, whichever exists (it looks for `messages` first), so only the body's own one is set."""

    def __init__(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self.path = path
        self.body = body
        self.headers = headers or {}
        if "messages" in body:
            self.messages = body["messages"]
        elif "prompt" in body:
            self.prompt = body["prompt"]


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn (the baseline the prefix-aware policy is measured against)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        return [[ordered[next(self._turn) % len(ordered)]]]


ROUTERS["round_robin"] = RoundRobinRouter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the brisk server's child process: SIGTERM it when the replica process dies (Linux prctl)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class BriskEngine:
    """One Ray Serve replica: a `brisk serve` process on a private local port, proxied with streaming."""

    def __init__(self, model: str | None, serve_args: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.replica = serve.get_replica_context().replica_id.unique_id
        command = [sys.executable, "-m", "brisk.cli", "serve", *([model] if model else [])]
        command += ["--host", "127.0.0.1", "--port", str(self.port), *serve_args]
        self.proc = subprocess.Popen(command, preexec_fn=_die_with_parent)
        self.http = httpx.AsyncClient(base_url=self.url, timeout=None)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"brisk serve did not start (exit code {self.proc.poll()})")
            time.sleep(0.25)  # polling the child's /health with a deadline

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"brisk serve exited with code {self.proc.returncode}")

    async def __call__(self, request: BriskRequest) -> AsyncIterator[Any]:
        """Yields (status, headers) first, then the body's bytes as brisk sends them."""
        send = self.http.build_request("POST", request.path, json=request.body, headers=request.headers)
        response = await self.http.send(send, stream=True)
        try:
            headers = {"content-type": response.headers.get("content-type", "application/json")}
            headers["x-brisk-replica"] = self.replica
            yield response.status_code, headers
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()


class BriskIngress:
    """OpenAI-compatible HTTP entry; retries a request on another replica until its first body byte."""

    def __init__(self, engine: Any, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name

    async def _start(self, request: BriskRequest) -> tuple[int, dict[str, str], bytes | None, AsyncIterator[Any]]:
        """Route, and read up to the first body chunk; a failure until then is retried elsewhere."""
        last_error: BaseException | None = None
        for attempt in range(1 + RETRIES):
            if attempt:
                await asyncio.sleep(0.2 * attempt)  # back off while Serve notices the dead replica
            stream = self.engine.options(stream=True).remote(request)
            try:
                status, headers = await stream.__anext__()
                if status == 503:  # that replica is draining or its engine died: another one may serve it
                    last_error = RuntimeError("replica answered 503")
                    stream.cancel()
                    continue
                first = await stream.__anext__()
                return status, headers, first, stream
            except StopAsyncIteration:
                return status, headers, None, stream
            except Exception as exc:  # the replica died or was unreachable before anything was sent
                last_error = exc
        raise RuntimeError(f"no replica could serve the request: {last_error!r}")

    async def forward(self, raw: Request, path: str) -> Response:
        body = await raw.json()
        auth = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        request = BriskRequest(path, body, auth)  # the brisk route (raw.url.path has the app's route prefix)
        try:
            status, headers, first, stream = await self._start(request)
        except RuntimeError as exc:
            error = {"message": str(exc), "type": "server_error", "param": None, "code": "no_replica"}
            return JSONResponse({"error": error}, status_code=503)

        async def body_chunks() -> AsyncIterator[bytes]:
            if first is not None:
                yield first
            try:
                async for chunk in stream:
                    yield chunk
            except Exception:  # the replica died mid-stream: the client has bytes already; report in-band
                if headers["content-type"].startswith("text/event-stream"):
                    error = {"message": "the replica serving this request failed", "type": "server_error"}
                    yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()

        return StreamingResponse(body_chunks(), status_code=status, headers=headers)


def build_app(
    model: str | None,
    serve_args: list[str],
    *,
    replicas: int = 1,
    max_replicas: int | None = None,
    routing: str = "prefix",
    served_model_name: str = "brisk",
    target_ongoing_requests: float = 8.0,
    gpus_per_replica: float = 0,
) -> Any:
    """The Ray Serve application: `serve.run(build_app(...))`. gpus_per_replica: the GPUs Ray gives each replica's
    `brisk serve` (its tp_size; Ray hides the GPUs of an actor that asks for none)."""
    from ray import cloudpickle
    from ray.serve.config import RequestRouterConfig

    router_kwargs = {"imbalanced_threshold": 4} if routing == "prefix" else {}
    # Built first: it pickles the router's module by value and then unregisters that module, which may be this one.
    router_config = RequestRouterConfig(request_router_class=ROUTERS[routing], request_router_kwargs=router_kwargs)
    if __name__ != "__main__":  # this file is not importable on Ray's workers: ship its classes by value
        cloudpickle.register_pickle_by_value(sys.modules[__name__])

    if "--served-model-name" not in serve_args:
        serve_args = [*serve_args, "--served-model-name", served_model_name]
    scaling: dict[str, Any] = {"num_replicas": replicas}
    if max_replicas is not None and max_replicas > replicas:
        scaling = {
            "autoscaling_config": {
                "min_replicas": replicas,
                "max_replicas": max_replicas,
                "target_ongoing_requests": target_ongoing_requests,
            }
        }
    engine = serve.deployment(
        BriskEngine,
        name="BriskEngine",
        max_ongoing_requests=64,
        health_check_period_s=2,
        ray_actor_options={"num_cpus": 0, "num_gpus": gpus_per_replica},
        request_router_config=router_config,
        **scaling,
    ).bind(model, serve_args)

    app = FastAPI(title="brisk on Ray Serve")

    @serve.deployment(name="BriskIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
    @serve.ingress(app)
    class Ingress(BriskIngress):
        @app.post("/v1/completions")
        async def completions(self, raw: Request) -> Response:
            return await self.forward(raw, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(self, raw: Request) -> Response:
            return await self.forward(raw, "/v1/chat/completions")

        @app.get("/v1/models")
        async def models(self) -> dict:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "brisk"}]}

        @app.get("/health")
        async def health(self) -> Response:
            return Response(status_code=200)

    return Ingress.bind(engine, served_model_name)


def default_gpus_per_replica(serve_args: list[str]) -> int:
    """A replica's GPUs by default: its `brisk serve`'s tensor-parallel size where CUDA is present, else none."""
    import torch

    if not torch.cuda.is_available():
        return 0
    for i, arg in enumerate(serve_args):
        for flag in ("--tp_size", "--tp-size", "--tensor-parallel-size", "-tp"):
            if arg == flag and i + 1 < len(serve_args):
                return int(serve_args[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.partition("=")[2])
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int)
    parser.add_argument("--routing", choices=sorted(ROUTERS), default="prefix")
    parser.add_argument("--served-model-name", default="brisk")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--gpus-per-replica",
        type=float,
        help="GPUs Ray gives each replica (default: the --tp_size after -- where this machine has CUDA, else 0)",
    )
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: flags for each `brisk serve`")
    args = parser.parse_args(argv)
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    gpus = args.gpus_per_replica if args.gpus_per_replica is not None else default_gpus_per_replica(serve_args)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(
        build_app(
            args.model,
            serve_args,
            replicas=args.replicas,
            max_replicas=args.max_replicas,
            routing=args.routing,
            served_model_name=args.served_model_name,
            gpus_per_replica=gpus,
        ),
        blocking=True,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "1")
    sys.exit(main())
