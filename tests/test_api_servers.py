"""Several API-server processes on one port (--api-server-count 2; trtllm's num_postprocess_workers): every API from
every process, n > 1, aborts on disconnect, stored and background Responses across processes (read, streamed and
cancelled through another process than the one running them), /metrics summed over the processes, SIGTERM draining
all of them, and the engine's death stopping all of them.

Each API-server process also listens on a private Unix socket (api-<pid>.sock, in the directory the supervisor
logs); the tests reach a given process through it, and the shared port through TCP.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import pytest
import zmq

import brisk
from brisk.engine.messages import EngineCoreOutput, EngineInfo, EngineOutputs, SchedulerStats
from brisk.engine.process import OutputRouter
from brisk.server.api_servers import Supervisor
from brisk.server.errors import APIError
from brisk.server.peers import Peers
from brisk.server.state import ServerState
from tests.server_utils import RunningServer, is_idle, wait_until

DEMO_MODEL = Path(brisk.__file__).parent / "demo_model"
MODEL = "brisk-demo"
GREEDY = {"temperature": 0, "ignore_eos": True}
SUCCESS = f'brisk:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
GENERATED = f'brisk:generation_tokens_total{{model_name="{MODEL}"}}'
STEPS = f'brisk:iteration_tokens_total_count{{model_name="{MODEL}"}}'


class Processes:
    """The supervisor's processes, from its start-up line."""

    def __init__(self, server: RunningServer, tls: bool = False) -> None:
        # with --ssl-certfile the private sockets speak HTTPS too (their certificate is the port's; not checked)
        self.base_url, self.verify = ("https://brisk", False) if tls else ("http://brisk", True)
        found = re.search(
            r"engine process (\d+); API-server processes ([\d ]+) \(private sockets in (\S+)\)", server.log()
        )
        assert found, server.log()
        self.engine = int(found.group(1))
        self.api = [int(pid) for pid in found.group(2).split()]
        self.sockets = [os.path.join(found.group(3), f"api-{pid}.sock") for pid in self.api]
        for index in range(len(self.api)):  # the port answered: one process serves; wait for each
            assert wait_until(lambda index=index: self._healthy(index), timeout=60), server.log()

    def _healthy(self, index: int) -> bool:
        try:
            with self.client(index, timeout=5) as http:
                return http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def client(self, index: int, **kw) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=self.sockets[index], verify=self.verify)
        return httpx.Client(transport=transport, base_url=self.base_url, **kw)

    def async_client(self, index: int, **kw) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(uds=self.sockets[index], verify=self.verify)
        return httpx.AsyncClient(transport=transport, base_url=self.base_url, **kw)

    async def stream(self, index: int, body: dict, started: asyncio.Event) -> list:
        """The events of a streamed completion from process `index`; `started` is set at its first line."""
        async with self.async_client(index, timeout=120) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    started.set()
                return _sse("\n".join(lines))


def _serve(state_dir: Path, *args: str, tls: ssl.SSLContext | None = None) -> RunningServer:
    return RunningServer(str(DEMO_MODEL), "--served-model-name", MODEL, "--state-dir", str(state_dir), *args, tls=tls)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _serve(tmp_path_factory.mktemp("state"), "--api-server-count", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def processes(server) -> Processes:
    return Processes(server)


def _sse(text: str) -> list:
    return [
        line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        for line in text.splitlines()
        if line[:6] == "data: "
    ]


# ---- the engine side: each output to the process that owns its request ----------------------------------------------
def test_output_router_sends_each_output_to_its_process():
    ctx = zmq.Context()
    pulls, pushes = [], []
    for i in range(2):
        pulls.append(ctx.socket(zmq.PULL))
        pulls[-1].bind(f"inproc://router-{i}")
        pushes.append(ctx.socket(zmq.PUSH))
        pushes[-1].connect(f"inproc://router-{i}")
    router = OutputRouter(pushes)
    decoder = msgspec.msgpack.Decoder(EngineOutputs)
    try:
        router.added("a", 0)
        router.added("b", 1)
        stats = SchedulerStats(num_running=2, iteration_tokens=(2,))
        outputs = [
            EngineCoreOutput("a", 0, [5]),
            EngineCoreOutput("b", 0, [6]),
            EngineCoreOutput("b", 1, [7], None, "length"),
        ]
        router.send(EngineOutputs(outputs, [], stats), {"a", "b"})
        first, second = (decoder.decode(p.recv()) for p in pulls)
        assert [o.request_id for o in first.outputs] == ["a"] and [o.new_token_ids for o in second.outputs] == [
            [6],
            [7],
        ]
        # steps are counted once (process 0); the gauges reach every process that gets a message
        assert first.stats.iteration_tokens == (2,) and second.stats.iteration_tokens == ()
        assert second.stats.num_running == 2
        # process 0 gets the stats even when none of the outputs is its own; b is over: forgotten, so an output of
        # a request never added goes to process 0
        router.send(
            EngineOutputs([EngineCoreOutput("b", 0, [8], None, "length")], [("c", "prompt", "bad")], stats), {"a"}
        )
        only = decoder.decode(pulls[0].recv())
        assert [o.request_id for o in only.outputs] == [] and only.refused == [("c", "prompt", "bad")]
        assert [o.new_token_ids for o in decoder.decode(pulls[1].recv()).outputs] == [[8]]
        router.send(EngineOutputs([EngineCoreOutput("b", 0, [9])], [], stats), {"b"})
        assert [o.request_id for o in decoder.decode(pulls[0].recv()).outputs] == ["b"]
        assert not pulls[1].poll(0)
    finally:
        ctx.destroy(linger=0)


def test_admission_counts_the_other_processes_requests(tmp_path):
    # One process's own in-flight requests are not the engine's load: it also counts what the engine last reported.
    info = EngineInfo("LlamaForCausalLM", 64, 64, 8, [16])
    config = SimpleNamespace(
        model="fake", max_batch_size=4, max_num_waiting=4, enable_prefix_caching=True, dtype="auto"
    )
    for peers, engine_load, admitted in (
        (Peers(str(tmp_path), 1, 2), 7, True),
        (Peers(str(tmp_path), 1, 2), 8, False),
        (None, 8, True),
    ):
        client = SimpleNamespace(
            dead=False,
            info=info,
            num_in_flight=1,
            stats_listeners=[],
            in_flight_listeners=[],
            engine_load=lambda n=engine_load: n,
        )
        state = ServerState(client, None, config, "fake", {}, False, peers=peers)
        if admitted:
            state.admit()
        else:
            with pytest.raises(APIError) as refused:
                state.admit()
            assert refused.value.status == 429


# ---- every API from every process -----------------------------------------------------------------------------------
def test_two_api_servers_serve_every_api(server, processes):
    assert len(processes.api) == 2 and len(set(processes.api)) == 2
    completion = {"prompt": "Good morrow", "max_tokens": 8, "n": 2, **GREEDY}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **GREEDY}
    texts = []
    for index in range(2):
        with processes.client(index, timeout=120) as http:
            r = http.post("/v1/completions", json=completion)
            assert r.status_code == 200, r.text
            choices = r.json()["choices"]
            assert sorted(c["index"] for c in choices) == [0, 1] and choices[0]["text"] == choices[1]["text"]
            events = _sse(http.post("/v1/completions", json={**completion, "stream": True}).text)
            assert events[-1] == "[DONE]"
            streamed = {
                i: "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == i)
                for i in (0, 1)
            }
            assert streamed == {0: choices[0]["text"], 1: choices[1]["text"]}
            texts.append(choices[0]["text"])
            r = http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
            chunks = _sse(http.post("/v1/chat/completions", json={**chat, "stream": True}).text)
            assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
            r = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 8, "temperature": 0})
            assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
            body = {"input": "Hi", "max_output_tokens": 8, "temperature": 0, "stream": True}
            kinds = [e["type"] for e in _sse(http.post("/v1/responses", json=body).text) if isinstance(e, dict)]
            assert kinds[0] == "response.created" and kinds[-1] == f"response.{r.json()['status']}"
            assert http.get("/health").status_code == 200
    assert texts[0] == texts[1]  # greedy: one engine, the same tokens whichever process asked
    r = httpx.post(f"{server.url}/v1/completions", json=completion, timeout=120)  # the shared port
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == texts[0]


def test_metrics_are_summed_over_the_processes(server, processes):
    before = [processes.client(i).get("/metrics").text for i in range(2)]
    assert before[0].count("\nbrisk:num_requests_running{") == 1  # the engine's gauges once, not once a process
    start = server.metrics()
    for index, count in ((0, 3), (1, 2)):
        with processes.client(index, timeout=120) as http:
            for _ in range(count):
                assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, **GREEDY}).status_code == 200
    for index in range(2):
        with processes.client(index) as http:
            values = {
                line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
                for line in http.get("/metrics").text.splitlines()
                if line and not line.startswith("#")
            }
        assert values[SUCCESS] - start[SUCCESS] == 5  # requests served by either process, counted once each
        assert values[GENERATED] - start[GENERATED] == 20
        assert values[STEPS] - start[STEPS] >= 4  # engine steps, counted by one process
        assert values[f'brisk:engine_up{{model_name="{MODEL}"}}'] == 1.0


def test_a_disconnect_aborts_in_whichever_process(server, processes):
    async def hang_up(index: int) -> None:
        async with processes.async_client(index, timeout=60) as http:
            body = {"prompt": "Speak on", "max_tokens": 1500, "stream": True, **GREEDY}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    break  # the first chunk: the request runs; then the client goes

    async def run() -> None:
        await asyncio.gather(hang_up(0), hang_up(1))

    asyncio.run(run())
    assert wait_until(lambda: is_idle(server.metrics(), MODEL), timeout=60), server.metrics()


# ---- Responses across processes -------------------------------------------------------------------------------------
def _respond(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/responses", json={"temperature": 0, "max_output_tokens": 16, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_stored_responses_continue_in_another_process(processes):
    with processes.client(0, timeout=120) as a, processes.client(1, timeout=120) as b:
        first = _respond(a, input="Good morrow, sir.")
        assert b.get(f"/v1/responses/{first['id']}").json() == first
        follow = _respond(b, input="And to you.", previous_response_id=first["id"])
        assert follow["previous_response_id"] == first["id"]
        items = a.get(f"/v1/responses/{follow['id']}/input_items", params={"order": "asc"}).json()["data"]
        assert items[0]["content"] == "Good morrow, sir." and items[-1]["content"] == "And to you."


def test_a_background_response_is_followed_and_cancelled_through_another_process(server, processes):
    with processes.client(0, timeout=120) as a, processes.client(1, timeout=120) as b:
        body = {"input": "Tell me a tale.", "background": True, "max_output_tokens": 48, "ignore_eos": True}
        started = _respond(a, **body)
        rid = started["id"]
        # streamed live through the other process, from the start: every event, in order, to the terminal one
        events = [e for e in _sse(b.get(f"/v1/responses/{rid}", params={"stream": "true"}).text) if e != "[DONE]"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        done = b.get(f"/v1/responses/{rid}").json()
        assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 48
        final = [i for i in done["output"] if i["type"] == "message"]
        assert not final or final[0]["content"][0]["text"] == deltas

        long = _respond(a, **{**body, "max_output_tokens": 1900})
        assert b.get(f"/v1/responses/{long['id']}").json()["status"] in ("queued", "in_progress")
        cancelled = b.post(f"/v1/responses/{long['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        assert a.get(f"/v1/responses/{long['id']}").json()["status"] == "cancelled"
    # its engine request was aborted
    assert wait_until(lambda: is_idle(server.metrics(), MODEL), timeout=60), server.metrics()


def _self_signed(folder: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (PEM files in `folder`)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(certfile), str(keyfile)


def test_https_on_the_port_and_between_the_processes(tmp_path):
    """vLLM's --ssl-certfile / --ssl-keyfile: the port serves HTTPS only, and a Response run by one API-server
    process is streamed through the other (forwarded over its private socket, HTTPS too)."""
    certfile, keyfile = _self_signed(tmp_path)
    args = ("--api-server-count", "2", "--ssl-certfile", certfile, "--ssl-keyfile", keyfile)
    trusted = ssl.create_default_context(cafile=certfile)
    server = _serve(tmp_path / "state", *args, tls=trusted)
    try:
        # the port answers once one process serves; the supervisor's ready line comes when both do
        assert wait_until(lambda: f"on https://127.0.0.1:{server.port}" in server.log(), timeout=60), server.log()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hail"}], "max_tokens": 4}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, verify=trusted, timeout=120)
        assert r.status_code == 200, r.text
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the port: no answer
            httpx.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body, timeout=30)
        processes = Processes(server, tls=True)
        with processes.client(0, timeout=120) as a, processes.client(1, timeout=120) as b:
            started = _respond(a, input="Tell me a tale.", background=True, max_output_tokens=8, ignore_eos=True)
            events = [e for e in _sse(b.get(f"/v1/responses/{started['id']}", params={"stream": "true"}).text)]
            assert events[-1] == "[DONE]" and events[-2]["type"] == "response.incomplete"
    finally:
        server.stop()


def test_https_client_certificates_and_ciphers(tmp_path):
    """--ssl-ca-certs with --ssl-cert-reqs 2: a client without a certificate the CA signed gets no answer;
    --ssl-ciphers: a TLS 1.2 client offering only other ciphers gets none either."""
    certfile, keyfile = _self_signed(tmp_path)  # its own CA: it signs itself, and serves as the client's too

    def client(cipher: str, with_certificate: bool = True) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=certfile)
        context.maximum_version = ssl.TLSVersion.TLSv1_2  # set_ciphers rules TLS 1.2's ciphers (not 1.3's)
        context.set_ciphers(cipher)
        if with_certificate:
            context.load_cert_chain(certfile, keyfile)
        return context

    allowed = "ECDHE-ECDSA-AES128-GCM-SHA256"
    args = ("--ssl-certfile", certfile, "--ssl-keyfile", keyfile, "--ssl-ca-certs", certfile, "--ssl-cert-reqs", "2")
    server = _serve(tmp_path / "state", *args, "--ssl-ciphers", allowed, tls=client(allowed))
    try:
        assert httpx.get(f"{server.url}/v1/models", verify=client(allowed)).status_code == 200
        for refused in (client(allowed, with_certificate=False), client("ECDHE-ECDSA-AES256-GCM-SHA384")):
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"{server.url}/v1/models", verify=refused, timeout=30)
    finally:
        server.stop()


# ---- shutdown and failure -------------------------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class _EndsBetweenLooks:
    """An API-server process that ends between the supervisor's first and second look at its exit code."""

    def __init__(self) -> None:
        read, write = os.pipe()
        os.close(write)  # an ended process's sentinel: readable (end of file)
        self.sentinel, self.pid, self.looks = read, None, 0

    @property
    def exitcode(self) -> int | None:
        self.looks += 1
        return None if self.looks == 1 else 0


class _RunningEngine:
    def __init__(self) -> None:
        self.sentinel, self._write_end = os.pipe()  # never readable while this object lives
        self.exitcode = None

    def is_alive(self) -> bool:
        return True


def test_the_supervisor_sees_a_process_that_ends_between_two_looks():
    """The race behind a drained server that never exited: an API-server process ending between the supervisor's
    check that one still runs and its list of what to wait on was in neither, so it waited on the engine alone."""
    supervisor = Supervisor(_RunningEngine(), 2.0, ipc_dir="", has_other_ranks=False)  # type: ignore[arg-type]
    supervisor.children = [_EndsBetweenLooks()]  # type: ignore[list-item]
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.supervise()), daemon=True)
    thread.start()
    thread.join(10)
    assert result == [0]


def test_sigterm_drains_every_api_server(tmp_path):
    srv = _serve(tmp_path, "--api-server-count", "2", "--shutdown-timeout", "2")
    try:
        procs = Processes(srv)
        long = {"prompt": "long", "n": 8, "max_tokens": 1500, "stream": True, **GREEDY}
        short = {"prompt": "short", "max_tokens": 3, "stream": True, **GREEDY}

        async def run():
            started = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.create_task(procs.stream(i, long, started[i])) for i in range(2)]
            tasks.append(asyncio.create_task(procs.stream(1, short, started[2])))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)  # in flight in both processes
            os.kill(srv.proc.pid, signal.SIGTERM)
            signalled = time.monotonic()
            for index in range(2):
                async with procs.async_client(index, timeout=10) as http:
                    while (await http.get("/health")).status_code == 200:
                        assert time.monotonic() - signalled < 10, "a process did not start draining"
                        await asyncio.sleep(0.05)  # polling the observable drain state, with a deadline
                    refused = await http.post("/v1/completions", json={**short, "stream": False})
                    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            return await asyncio.gather(*tasks)

        *long_streams, short_stream = asyncio.run(run())
        assert short_stream[-1] == "[DONE]" and short_stream[-2]["choices"][0]["finish_reason"] == "length"
        for events in long_streams:
            reasons = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
            assert events[-1] == "[DONE]" and reasons == ["abort"] * 8  # aborted at the shutdown timeout
        assert srv.proc.wait(timeout=60) == 0
        assert all(_gone(pid) for pid in [procs.engine, *procs.api])
    finally:
        srv.stop()


def test_engine_death_stops_every_api_server(tmp_path):
    """Started with trtllm's num_postprocess_workers 2, which runs two API-server processes."""
    srv = _serve(tmp_path, "--num-postprocess-workers", "2")
    try:
        procs = Processes(srv)
        assert "num_postprocess_workers 2: brisk detokenizes in its API-server processes" in srv.log()
        body = {"prompt": "Speak on", "max_tokens": 1500, "stream": True, **GREEDY}

        async def run():
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(procs.stream(i, body, started[i])) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)  # one in flight in each process
            os.kill(procs.engine, signal.SIGKILL)
            return await asyncio.gather(*tasks)

        for events in asyncio.run(run()):  # each stream ends with the engine's death, told in band
            errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
            assert errors and errors[-1]["code"] == "engine_dead", events[-3:]
        assert srv.proc.wait(timeout=60) == 1
        assert all(_gone(pid) for pid in procs.api)
        assert srv.log().count("the engine core process died") >= 2  # each API-server process saw it
    finally:
        srv.stop()


@pytest.mark.parametrize("count", [1, 2], ids=["one-process", "two-processes"])
def test_uds_serves_on_a_unix_socket(tmp_path, count):
    """vLLM's --uds: the API on a Unix domain socket (no TCP port), with one or several API-server processes; a
    stale socket file is replaced, one a live server listens on is a start-up error, and the file goes at exit."""
    path = str(tmp_path / "brisk.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a file left by a server that is gone
    stale.close()
    command = [sys.executable, "-m", "brisk.cli", "serve", str(DEMO_MODEL), "--uds", path]
    command += ["--api-server-count", str(count), "--max-num-seqs", "4"]
    log = open(tmp_path / "log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://brisk", timeout=60)

    def healthy() -> bool:
        try:
            return server.poll() is not None or client.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_until(healthy, timeout=120) and server.poll() is None, (tmp_path / "log").read_text()
        body = {"model": str(DEMO_MODEL), "prompt": "Good morrow", "max_tokens": 4, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "--uds" in second.stderr and "listens on it" in second.stderr
        assert f"on unix:{path}" in (tmp_path / "log").read_text()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        client.close()
    assert not os.path.exists(path)


def test_a_child_whose_parent_died_before_it_could_ask_to_end_with_it_ends_at_once():
    """The engine (and an API-server process) asks the kernel to kill it when its parent ends, seconds after it was
    spawned (its imports come first): a parent that died in between left it to init, where the engine would run on
    holding its GPU. The parent's pid, given at spawn, tells it; the child then ends at once."""
    code = "import os, sys; from brisk.engine.process import end_with_parent; end_with_parent(int(sys.argv[1])); print('on')"
    orphaned = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True, text=True, timeout=60)
    assert orphaned.returncode == 1 and "on" not in orphaned.stdout, orphaned.stdout + orphaned.stderr
    kept = subprocess.run([sys.executable, "-c", code, str(os.getpid())], capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0 and kept.stdout.strip() == "on", kept.stdout + kept.stderr


@pytest.mark.parametrize("count", [1, 2])
def test_a_state_dir_that_cannot_keep_responses_is_a_start_up_error_not_a_hang(tmp_path, count):
    """--state-dir under a regular file: one line naming it and exit 2, before the engine serves; it used to fail
    after the engine started, outside the shutdown that ends it, and the exit waited for the engine forever."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    command = [sys.executable, "-m", "brisk.cli", "serve", str(Path(brisk.__file__).parent / "demo_model")]
    command += ["--state-dir", str(blocker / "sub"), "--port", "0", "--api-server-count", str(count)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--state-dir {blocker / 'sub'}: stored Responses cannot be kept there" in done.stderr


def test_one_profile_for_all_api_server_processes(tmp_path):
    """The engine's profile is the API-server processes' together: started through one, it is stopped through the
    other (and a second start through either is refused while it runs); each stop writes a trace of its own."""
    srv = _serve(tmp_path / "state", "--api-server-count", "2", "--profile-dir", str(tmp_path / "profiles"))
    try:
        procs = Processes(srv)
        traces = []
        for first, second in ((0, 1), (1, 0), (0, 1)):
            with procs.client(first, timeout=60) as a, procs.client(second, timeout=180) as b:
                assert a.post("/start_profile").status_code == 200
                assert b.post("/start_profile").status_code == 409
                stopped = b.post("/stop_profile")
                assert stopped.status_code == 200, stopped.text
                assert a.post("/stop_profile").status_code == 409
            traces.append(stopped.json()["trace_path"])
        assert len(set(traces)) == 3 and all(os.path.getsize(t) > 0 for t in traces)
    finally:
        srv.stop()


def test_the_supervisor_stops_an_engine_with_other_ranks_by_telling_it(tmp_path):
    """tp_size 2 behind two API-server processes: on SIGTERM, once both have drained, the supervisor tells the engine
    to stop (it stops its other rank, then ends with 0) instead of a SIGKILL that would leave that rank waiting."""
    srv = _serve(tmp_path, "--api-server-count", "2", "--tensor-parallel-size", "2")
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **GREEDY}
            assert http.post("/v1/completions", json=body).status_code == 200
    finally:
        code = srv.stop()
    log = srv.log()
    assert code == 0, log
    assert "the engine core stopped" in log and "the engine process ended (exit code 0)" in log, log
