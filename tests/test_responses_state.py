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
