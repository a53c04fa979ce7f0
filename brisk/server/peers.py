"""One API-server process among several of a server (--api-server-count): where its siblings can be reached.

Every API-server process also listens on a Unix socket of its own, `api-<pid>.sock` in the server's private IPC
directory (0700, as the engine's sockets). A background Response lives in the process that runs it (its task, its
events); a request about it that reaches another process (GET, GET ?stream=true, cancel, DELETE) is forwarded
there as it came, and that process's answer streamed back. The stored row names its runner by pid, which names the
socket. A forwarded request carries FORWARDED_HEADER and is never forwarded again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from brisk.server.errors import APIError

FORWARDED_HEADER = "x-brisk-forwarded"
# Request headers a forwarded request keeps (auth decides whose responses it sees) and response headers it returns.
FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "accept")
FORWARDED_RESPONSE_HEADERS = ("content-type", "cache-control", "retry-after")


@dataclass(frozen=True)
class Peers:
    ipc_dir: str  # the server's private directory: the engine's sockets, the API processes' sockets, metrics
    index: int  # this process's place, 0 .. count - 1 (its engine client's index)
    count: int

    @property
    def metrics_dir(self) -> str:
        return os.path.join(self.ipc_dir, "metrics")

    def socket_path(self, pid: int) -> str:
        return os.path.join(self.ipc_dir, f"api-{pid}.sock")

    def socket_of(self, runner: str) -> str | None:
        """The socket of the sibling process `runner` ("pid:start", a stored Response's runner); None when it is
        this process, or no process of this server (another server sharing the state folder, say)."""
        pid = runner.partition(":")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            return None
        path = self.socket_path(int(pid))
        return path if os.path.exists(path) else None


async def forward(raw: Request, socket_path: str, scheme: str) -> StreamingResponse:
    """Send `raw` to the sibling listening on `socket_path`; its answer (a stream too) comes back as it is sent.
    `scheme`: the server's; with https the sibling's private socket serves HTTPS too, and its certificate is not
    checked (the socket is found by path in the server's own private folder, which is what vouches for it)."""
    transport = httpx.AsyncHTTPTransport(uds=socket_path, verify=scheme == "http")
    client = httpx.AsyncClient(transport=transport, timeout=None)
    headers = {name: raw.headers[name] for name in FORWARDED_REQUEST_HEADERS if name in raw.headers}
    request = client.build_request(
        raw.method,
        f"{scheme}://brisk{raw.url.path}",
        params=str(raw.query_params),
        headers={**headers, FORWARDED_HEADER: "1"},
        content=await raw.body(),
    )
    try:
        answer = await client.send(request, stream=True)
    except httpx.HTTPError:  # it ended between the look-up and now (a drain): the row tells what it left
        await client.aclose()
        raise APIError(
            503, "The server process running this response is stopping; retry.", code="unavailable"
        ) from None
    except BaseException:
        await client.aclose()
        raise

    async def close() -> None:
        await answer.aclose()
        await client.aclose()

    kept = {name: answer.headers[name] for name in FORWARDED_RESPONSE_HEADERS if name in answer.headers}
    return StreamingResponse(answer.aiter_raw(), answer.status_code, kept, background=BackgroundTask(close))
