"""Stateful Responses API through `brisk serve` of the bundled demo model (issue 17): stored responses, GET /
input_items / DELETE, previous_response_id (with the prefix cache), function_call_output turns, background runs
(poll, resumable stream, cancel), and storage that outlives the server process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

import brisk
from brisk.server.response_items import OutputItems, reasoning_blob
from brisk.server.response_store import ResponseStore, StoredResponse, owner_of
from tests.server_utils import RunningServer, wait_until

DEMO_MODEL = Path(brisk.__file__).parent / "demo_model"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _serve(state_dir: Path) -> RunningServer:
    return RunningServer(str(DEMO_MODEL), "--served-model-name", "brisk-demo", "--state-dir", str(state_dir))


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("brisk_state")


@pytest.fixture(scope="module")
def server(state_dir):
    srv = _serve(state_dir)
    yield srv
    srv.stop()


def _post(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/responses", json={"temperature": 0, "max_output_tokens": 24, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _get(server, path: str, **params) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/responses/{path}", params=params, timeout=60)


def test_stored_by_default_and_read_back(server):
    first = _post(server, input="Good morrow, sir.")
    assert first["store"] is True
    again = _get(server, first["id"]).json()
    assert again == first
    items = _get(server, f"{first['id']}/input_items", order="asc").json()
    assert [i["content"] for i in items["data"]] == ["Good morrow, sir."] and items["has_more"] is False
    unstored = _post(server, input="Hark!", store=False)
    assert _get(server, unstored["id"]).status_code == 404
    r = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi", "previous_response_id": unstored["id"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(server):
    first = _post(server, input="What news from the court?", instructions="Speak briefly.")
    second = _post(server, input="And what of the king?", previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    # the second prompt holds the first exchange: longer, and its start served from the prefix cache
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 5
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    items = _get(server, f"{second['id']}/input_items", order="asc").json()["data"]
    contents = [i.get("content") for i in items if i.get("type", "message") == "message"]
    assert contents[0] == "What news from the court?" and contents[-1] == "And what of the king?"
    assert [i["id"] for i in items if i["type"] == "message" and i.get("role") == "assistant"] == [
        o["id"] for o in first["output"] if o["type"] == "message"
    ]


def test_function_call_output_turn(server):
    call_turn = _post(server, input="Weather in Verona?", tools=[TOOL], tool_choice="required")
    calls = [o for o in call_turn["output"] if o["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    answer = _post(
        server,
        previous_response_id=call_turn["id"],
        tools=[TOOL],
        input=[{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": '{"sky": "clear"}'}],
    )
    assert answer["status"] in ("completed", "incomplete") and answer["output"]
    kinds = [i["type"] for i in _get(server, f"{answer['id']}/input_items", order="asc").json()["data"]]
    assert kinds[-2:] == ["function_call", "function_call_output"]


def test_delete(server):
    response = _post(server, input="Farewell.")
    r = httpx.delete(f"{server.url}/v1/responses/{response['id']}")
    assert r.json() == {"id": response["id"], "object": "response.deleted", "deleted": True}
    assert _get(server, response["id"]).status_code == 404
    assert httpx.delete(f"{server.url}/v1/responses/{response['id']}").status_code == 404


def test_background_poll_and_resumable_stream(server):
    body = {"input": "Tell me a tale.", "background": True, "max_output_tokens": 32, "ignore_eos": True}
    started = _post(server, **body)
    assert started["background"] is True and started["status"] in ("queued", "in_progress")
    rid = started["id"]
    assert wait_until(lambda: _get(server, rid).json()["status"] != "in_progress", timeout=120)
    done = _get(server, rid).json()
    assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 32
    events = [
        json.loads(line[6:])
        for line in _get(server, rid, stream="true", starting_after=2).text.splitlines()
        if line.startswith("data: {")
    ]
    assert events[0]["sequence_number"] == 3 and [e["sequence_number"] for e in events] == list(
        range(3, 3 + len(events))
    )
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["output"] == done["output"]
    streamed = httpx.post(f"{server.url}/v1/responses", json={**body, "stream": True, "temperature": 0}, timeout=120)
    kinds = [json.loads(x[6:])["type"] for x in streamed.text.splitlines() if x.startswith("data: {")]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"


def test_background_cancel(server):
    started = _post(server, input="Speak on.", background=True, max_output_tokens=1500, ignore_eos=True)
    r = httpx.post(f"{server.url}/v1/responses/{started['id']}/cancel", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    assert _get(server, started["id"]).json()["status"] == "cancelled"
    in_flight = 'brisk:num_requests_in_flight{model_name="brisk-demo"}'
    assert wait_until(lambda: server.metrics()[in_flight] == 0, timeout=30)  # the engine request was aborted
    foreground = _post(server, input="Hi")
    r = httpx.post(f"{server.url}/v1/responses/{foreground['id']}/cancel")
    assert r.status_code == 400


def test_without_an_api_key_every_client_sees_the_stored_responses(server):
    # Client libraries send a placeholder key of their choosing ("EMPTY", "unused"...): on a server without keys it
    # means nothing, so a response stored through one is read through another (with a key, only that key passes).
    r = httpx.post(
        f"{server.url}/v1/responses",
        json={"input": "Hark!", "max_output_tokens": 4},
        headers={"Authorization": "Bearer EMPTY"},
        timeout=120,
    )
    rid = r.json()["id"]
    assert _get(server, rid).status_code == 200
    other = httpx.get(f"{server.url}/v1/responses/{rid}", headers={"Authorization": "Bearer unused"}, timeout=60)
    assert other.status_code == 200 and other.json()["id"] == rid
    follow = _post(server, input="Speak.", previous_response_id=rid)
    assert follow["previous_response_id"] == rid


def test_max_tool_calls_zero_offers_no_tool_and_refuses_a_forced_call(server):
    tool = {**TOOL, "parameters": {"type": "object", "properties": {}}}
    free = _post(server, input="Weather?", tools=[tool], max_tool_calls=0)
    assert all(item["type"] != "function_call" for item in free["output"]) and free["max_tool_calls"] == 0
    forced = _post(server, input="Weather?", tools=[tool], tool_choice="required")
    assert [item["type"] for item in forced["output"]] == ["function_call"]
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = httpx.post(
            f"{server.url}/v1/responses",
            json={"input": "Weather?", "tools": [tool], "tool_choice": choice, "max_tool_calls": 0},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tool_calls", r.text


def test_include_output_text_logprobs_streamed_or_not(server):
    body = {"input": "What say you?", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = _post(server, **body)
    part = next(i for i in whole["output"] if i["type"] == "message")["content"][0]
    assert part["text"] and "".join(e["token"] for e in part["logprobs"]) == part["text"]
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in part["logprobs"])
    assert _get(server, whole["id"]).json() == whole  # stored with them
    r = httpx.post(
        f"{server.url}/v1/responses", json={"temperature": 0, "max_output_tokens": 24, **body, "stream": True}
    )
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [x for e in deltas for x in e["logprobs"]] == part["logprobs"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == part["logprobs"]
    plain = next(i for i in _post(server, input="What say you?")["output"] if i["type"] == "message")
    assert plain["content"][0]["logprobs"] == []  # not asked: none computed


def test_encrypted_reasoning_round_trips_without_a_store(server):
    """include reasoning.encrypted_content (Codex, store: false): each reasoning item carries its text as a blob, in
    the stream's output_item.done too; an item sent back with the blob alone renders the reasoning as in clear."""
    items = OutputItems(encrypted_reasoning=True)
    items.add({"reasoning_content": "The user greets me."})
    items.add({"content": "Good morrow."})
    items.close()
    blob = items.items[0]["encrypted_content"]
    done = [e["item"] for e in items.take_events() if e["type"] == "response.output_item.done"]
    assert blob.startswith("brisk-reasoning-v1.") and done[0]["encrypted_content"] == blob
    assert "encrypted_content" not in items.items[1] and blob == reasoning_blob("The user greets me.")
    plain = OutputItems()
    plain.add({"reasoning_content": "The user greets me."})
    plain.close()
    assert "encrypted_content" not in plain.items[0]
    asked = {"input": "Good morrow, sir.", "store": False, "include": ["reasoning.encrypted_content"]}
    assert _post(server, **asked)["status"] == "completed"

    def prompt_tokens(reasoning: dict) -> int:  # reasoning before a tool call stays in gpt-oss's prompt
        turn = [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], **reasoning},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]
        return _post(server, input=turn, tools=[TOOL], store=False, max_output_tokens=1)["usage"]["input_tokens"]

    clear = prompt_tokens({"content": [{"type": "reasoning_text", "text": "The user greets me."}]})
    assert prompt_tokens({"encrypted_content": blob}) == clear > prompt_tokens({})
    r = httpx.post(
        f"{server.url}/v1/responses",
        json={"input": [{"type": "reasoning", "encrypted_content": blob[:-8]}, {"role": "user", "content": "Hi"}]},
        timeout=60,
    )
    assert r.status_code == 400 and "encrypted_content is damaged" in r.json()["error"]["message"], r.text


def test_stored_responses_outlive_the_server(state_dir, server):
    response = _post(server, input="Remember me.")
    server.stop()
    restarted = _serve(state_dir)
    try:
        assert _get(restarted, response["id"]).json() == response
    finally:
        restarted.stop()


def test_a_response_is_visible_only_to_the_key_that_stored_it(tmp_path):
    async def scenario() -> None:
        store = ResponseStore(tmp_path, ttl_s=60, max_responses=2)
        alice, bob = owner_of("Bearer alice"), owner_of("Bearer bob")
        for i in range(3):
            await store.put(alice, StoredResponse({"id": f"resp_{i}", "output": []}, [], []))
        assert await store.get(alice, "resp_2") is not None and await store.get(bob, "resp_2") is None
        assert await store.get(alice, "resp_0") is None  # the oldest went beyond max_responses
        assert not await store.delete(bob, "resp_2") and await store.delete(alice, "resp_2")
        store.close()

    asyncio.run(scenario())


def test_a_failed_generation_ends_the_stream_with_response_failed():
    # A failure once the stream has started (the engine died, a non-finite logit) is reported as OpenAI does: the
    # terminal event is response.failed, its response `failed` with the error; a stored one is stored so.
    from types import SimpleNamespace

    from brisk.sampling_params import SamplingParams
    from brisk.server.errors import APIError
    from brisk.server.protocol import ResponsesRequest
    from brisk.server.response_run import ResponseRun

    saved: list[dict] = []

    class Store:
        async def put(self, owner, stored):
            saved.append(stored.body)

    class FailingEngine:
        is_harmony, tokenizer, model_name = False, None, "brisk-demo"
        config = SimpleNamespace(stream_interval=1)
        response_store = Store()

        async def generate(self, prompt_ids, params, timeout=None, **_):
            raise APIError(503, "The engine is not running.", code="engine_dead")
            yield  # an async generator

    req = ResponsesRequest(input="Hi", stream=True)
    run = ResponseRun(FailingEngine(), req, "", [1, 2, 3], SamplingParams(max_tokens=4), [], [], [])

    async def events() -> list[dict]:
        return [event async for event in run.events()]

    kinds = asyncio.run(events())
    assert [e["type"] for e in kinds] == ["response.created", "response.in_progress", "response.failed"]
    assert [e["sequence_number"] for e in kinds] == [0, 1, 2]
    failed = kinds[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_dead"
    assert saved == [failed]


# ---- durable background responses (issue 29) -------------------------------------------------------------------------
def _server_children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_background_response_of_a_killed_server_reads_failed_after_the_restart(tmp_path):
    # The id of a background response goes out before it runs: it is stored then, and kept up to date as it runs,
    # so a crash (SIGKILL: nothing runs on the way out) leaves a row that the restarted server reads as failed, with
    # the reason; retrieve, cancel, stream and input_items all answer for it, none with a 404.
    state = tmp_path / "state"
    server = _serve(state)
    try:
        body = {"input": "Speak on.", "background": True, "max_output_tokens": 1900, "ignore_eos": True}
        started = _post(server, **body)
        rid = started["id"]
        assert started["status"] == "queued"
        # running, and its stored row brought up to date with some output at least once
        assert wait_until(lambda: len(_get(server, rid).json()["output"]) > 0, timeout=120)
        engine = _server_children(server.proc.pid)
        server.proc.kill()
        server.proc.wait()
        assert wait_until(lambda: not any(_alive(pid) for pid in engine), timeout=60)  # the engine went with it
    finally:
        server.stop()
    restarted = _serve(state)
    try:
        found = _get(restarted, rid)
        assert found.status_code == 200, found.text
        failed = found.json()
        assert failed["id"] == rid and failed["status"] == "failed" and failed["background"] is True
        assert failed["error"]["code"] == "interrupted" and "stopped" in failed["error"]["message"]
        cancel = httpx.post(f"{restarted.url}/v1/responses/{rid}/cancel", timeout=60)
        assert cancel.status_code == 200 and cancel.json() == failed
        stream = _get(restarted, rid, stream="true")
        events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
        assert stream.status_code == 200 and [e["type"] for e in events] == ["response.failed"]
        assert events[0]["response"] == failed and events[0]["sequence_number"] >= 1
        items = _get(restarted, f"{rid}/input_items").json()
        assert [i["content"] for i in items["data"]] == ["Speak on."]
        assert _get(restarted, rid).json() == failed  # written so: the next read agrees
    finally:
        restarted.stop()


def test_a_running_response_is_interrupted_only_when_its_process_is_gone(tmp_path):
    import sqlite3

    from brisk.server.response_store import SCHEMA, this_process

    # A state folder written by the previous schema (no runner column) opens, and its rows still read.
    old = sqlite3.connect(tmp_path / "responses.sqlite3")
    for statement in SCHEMA:
        old.execute(statement)
    old.execute("INSERT INTO responses VALUES ('resp_old', ?, ?, ?, '[]', '[]')", (owner_of(None), 1e12, '{"id": "resp_old", "status": "completed"}'))  # fmt: skip
    old.commit()
    old.close()

    def running(rid: str) -> dict:
        return {"id": rid, "status": "in_progress", "background": True, "output": []}

    async def scenario() -> None:
        store = ResponseStore(tmp_path)
        owner = owner_of(None)
        assert (await store.get(owner, "resp_old")).body["status"] == "completed"
        await store.put(owner, StoredResponse(running("resp_live"), [], [], this_process(), 4))
        await store.put(owner, StoredResponse(running("resp_dead"), [], [], "999999999:1", 7))
        live = await store.get(owner, "resp_live")
        assert live.running and live.body["status"] == "in_progress" and live.last_event == 4
        dead = await store.get(owner, "resp_dead")
        assert dead.body["status"] == "failed" and dead.body["error"]["code"] == "interrupted" and not dead.running
        store.close()
        again = ResponseStore(tmp_path)  # another process of the server reads what the first one wrote
        assert (await again.get(owner, "resp_dead")).body == dead.body
        # a process that reused the pid is not the runner: its start time differs
        pid, _, start = this_process().partition(":")
        await again.put(owner, StoredResponse(running("resp_reused"), [], [], f"{pid}:{int(start) + 1}", 0))
        assert (await again.get(owner, "resp_reused")).body["status"] == "failed"
        again.close()

    asyncio.run(scenario())


def test_the_stream_of_a_response_running_elsewhere_ends_with_its_terminal_event(tmp_path):
    # Another process of the server runs it: the stream waits for its row to end, then sends the terminal event.
    from types import SimpleNamespace

    from brisk.server.response_store import this_process
    from brisk.server.responses import _stored_events

    async def scenario() -> None:
        store = ResponseStore(tmp_path)
        owner = owner_of(None)
        body = {"id": "resp_x", "status": "in_progress", "background": True, "output": []}
        await store.put(owner, StoredResponse(body, [], [], this_process(), 5))
        stored = await store.get(owner, "resp_x")
        events = asyncio.create_task(anext(_stored_events(SimpleNamespace(response_store=store), owner, stored, 2)))
        await asyncio.sleep(0)
        assert not events.done()  # still running there
        other = ResponseStore(tmp_path)
        await other.put(owner, StoredResponse({**body, "status": "completed"}, [], [], None, 9))
        event = await asyncio.wait_for(events, timeout=30)
        assert event == {
            "type": "response.completed",
            "response": {**body, "status": "completed"},
            "sequence_number": 10,
        }
        other.close()
        store.close()

    asyncio.run(scenario())


def _open_store_at_once(state_dir: str, barrier) -> None:
    barrier.wait()
    ResponseStore(state_dir).close()


def test_api_server_processes_open_one_store_at_once(tmp_path):
    """--api-server-count N: N processes open (create, switch to WAL, upgrade) the same file at the same moment; every
    one of them must come up (an unguarded `PRAGMA journal_mode=WAL` was 'database is locked' for the second)."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(4)
    procs = [spawn.Process(target=_open_store_at_once, args=(str(tmp_path), barrier)) for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [proc.exitcode for proc in procs] == [0] * 4
