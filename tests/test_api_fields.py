"""docs/api.md's field tables, walked against the spec and a live server (issue 17).

Each endpoint's table must list exactly the request fields of the official `openai` package (its request
TypedDicts are the spec), and every row's example is sent to `brisk serve` on the bundled demo model (a tiny
gpt-oss, harmony format): implemented and no-effect rows answer 200, rejected rows 400 naming the field.
"""

from __future__ import annotations

import json
import re
import typing
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

import brisk
from brisk.sampling_params import InvalidRequest
from brisk.server.protocol import ChatCompletionRequest
from tests.server_utils import RunningServer

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
PEER_FLAGS = Path(__file__).resolve().parent / "data" / "peer_flags"
DEMO_MODEL = Path(brisk.__file__).parent / "demo_model"
STATUSES = {"implemented", "no effect", "rejected"}
MAX_SEQ_LEN = 512

BASE = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
}
SPEC = {
    "/v1/chat/completions": chat_create_params.CompletionCreateParamsStreaming,
    "/v1/completions": completion_create_params.CompletionCreateParamsStreaming,
    "/v1/responses": response_create_params.ResponseCreateParamsStreaming,
}


def _rows() -> list[dict]:
    """(endpoint, field, source, status, example) for every table row of docs/api.md."""
    rows, endpoint = [], None
    for line in API_DOC.read_text().splitlines():
        heading = re.match(r"## POST (\S+)", line)
        if heading:
            endpoint = heading.group(1)
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if endpoint is None or len(cells) != 5 or not cells[0].startswith("`"):
            continue
        field, source, status, example, _ = cells
        rows.append(
            {
                "endpoint": endpoint,
                "field": field.strip("`"),
                "source": source,
                "status": status,
                "example": json.loads(example.strip("`")),
            }
        )
    return rows


ROWS = _rows()


def test_each_table_lists_exactly_the_spec_fields():
    assert {r["endpoint"] for r in ROWS} == set(SPEC)
    for endpoint, spec in SPEC.items():
        documented = {r["field"] for r in ROWS if r["endpoint"] == endpoint and r["source"] == "OpenAI"}
        assert documented == set(typing.get_type_hints(spec)), endpoint
    for row in ROWS:
        assert row["status"] in STATUSES, row
        assert row["field"] in row["example"], row  # the example exercises its own field
        assert row["source"] == "OpenAI" or row["status"] != "no effect", row  # extensions are never ignored


def test_every_field_of_vllms_requests_is_listed():
    """vLLM's chat, completion and Responses request fields (vLLM 0.33: tests/data/peer_flags/vllm_request_fields.json,
    written by tools/peer_flags.py; and those its releases since 0.10.1 had and 0.33 dropped,
    vllm_request_fields_releases.json, by tools/peer_flags_releases.py: a client written for them works unchanged)
    are each a row of the endpoint's table: implemented, or rejected with the reason."""
    vllm = json.loads((PEER_FLAGS / "vllm_request_fields.json").read_text())
    releases = json.loads((PEER_FLAGS / "vllm_request_fields_releases.json").read_text())
    assert releases["vllm"][0] == "0.10.1.1" and ["/v1/chat/completions", "guided_json"] in [
        row[:2] for row in releases["fields"]
    ]
    for endpoint in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        listed = {r["field"] for r in ROWS if r["endpoint"] == endpoint}
        earlier = [field for route, field, _, _ in releases["fields"] if route == endpoint]
        missing = [f for f in vllm[endpoint] + earlier if f not in listed]
        assert missing == [], endpoint


def test_every_field_of_trtllm_serves_requests_is_listed():
    """trtllm-serve's chat, completion and Responses request fields (tests/data/peer_flags/trtllm_request_fields.json)
    are each a row of the endpoint's table: a trtllm client's body never fails on an unknown field."""
    trtllm = json.loads((PEER_FLAGS / "trtllm_request_fields.json").read_text())["routes"]
    assert "top_p_min" in trtllm["/v1/completions"] and "thinking" in trtllm["/v1/chat/completions"]
    for endpoint, fields in trtllm.items():
        listed = {r["field"] for r in ROWS if r["endpoint"] == endpoint}
        assert [f for f in fields if f not in listed] == [], endpoint


def test_trtllm_serves_response_formats_and_thinking_constrain_as_brisks_own_fields_do():
    """trtllm-serve's response_format types are the structured outputs they name; thinking.effort is
    reasoning_effort; its defaults (early_stopping false, top_p_min 0, priority null) are accepted."""
    bodies = [
        ({"type": "json", "schema": {"type": "object"}}, {"json": {"type": "object"}}),
        ({"type": "json_schema", "json_schema": {"type": "object"}}, {"json": {"type": "object"}}),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, {"json": {"type": "object"}}),
        ({"type": "regex", "regex": "[a-z]+"}, {"regex": "[a-z]+"}),
        ({"type": "ebnf", "ebnf": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    ]
    messages = [{"role": "user", "content": "Hi"}]
    for trtllm, vllm in bodies:
        ours = ChatCompletionRequest(messages=messages, response_format=trtllm).to_sampling_params({})
        theirs = ChatCompletionRequest(messages=messages, structured_outputs=vllm).to_sampling_params({})
        assert ours.structured_outputs is not None and theirs.structured_outputs is not None
        assert msgspec.structs.replace(ours.structured_outputs, param="") == msgspec.structs.replace(
            theirs.structured_outputs, param=""
        )
    for bad, message in (
        ({"type": "structural_tag", "format": {}}, "no structural tags"),
        ({"type": "text", "regex": "x"}, "regex does not go with type: text"),
        ({"type": "ebnf"}, "type ebnf needs ebnf"),
    ):
        with pytest.raises(InvalidRequest, match=message):
            ChatCompletionRequest(messages=messages, response_format=bad).to_sampling_params({})
    request = ChatCompletionRequest(messages=messages, reasoning_effort="medium", thinking={"effort": "High"})
    assert request.reasoning_effort == "high"
    defaults = {"early_stopping": False, "top_p_min": 0.0, "priority": None, "prompt_ignore_length": 0}
    assert ChatCompletionRequest(messages=messages, **defaults).to_sampling_params({}).priority == 0


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_vllms_earlier_guided_fields_constrain_as_structured_outputs_does(server, endpoint):
    """guided_* (vLLM <= 0.11) are structured_outputs' constraints: the same spec on chat, the same text on
    completions (constrained from its first token); two kinds, or one beside structured_outputs or response_format,
    are a 400 naming the guided field."""
    choices = ["arctic fox", "brown bear"]
    messages = [{"role": "user", "content": "Hi"}]
    for kind, value in (
        ("json", {"type": "object"}),
        ("regex", "[a-z]+"),
        ("choice", choices),
        ("grammar", 'root ::= "a"'),
    ):
        guided = ChatCompletionRequest(messages=messages, **{f"guided_{kind}": value}).to_sampling_params({})
        plain = ChatCompletionRequest(messages=messages, structured_outputs={kind: value}).to_sampling_params({})
        assert guided.structured_outputs is not None and plain.structured_outputs is not None
        assert getattr(guided.structured_outputs, kind) == getattr(plain.structured_outputs, kind) == value
    base = {**BASE[endpoint], "max_tokens": 32, "temperature": 0}
    if endpoint == "/v1/completions":
        texts = []
        for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
            r = httpx.post(f"{server.url}{endpoint}", json={**base, **body}, timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        # the same text; on the harmony demo model the completion holds the channel's name before the answer
        assert texts[0] == texts[1] and texts[0].endswith(tuple(choices)), texts
    for extra in (
        {"guided_regex": "[a-z]+"},
        {"structured_outputs": {"choice": choices}},
        {"response_format": {"type": "json_object"}},
    ):
        r = httpx.post(f"{server.url}{endpoint}", json={**base, "guided_choice": choices, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("guided_choice", "guided_regex"), r.text


@pytest.fixture(scope="module")
def server():
    srv = RunningServer(
        str(DEMO_MODEL), "--served-model-name", "brisk-demo", "--max_batch_size", "8", "--max_seq_len", str(MAX_SEQ_LEN)
    )
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    "row", ROWS, ids=[f"{r['endpoint'].rsplit('/', 1)[-1]}:{r['field']}:{r['status']}" for r in ROWS]
)
def test_every_documented_field_behaves_as_its_row_says(server, row):
    example = dict(row["example"])
    if example.get("previous_response_id") == "$stored_response":  # a response stored just before
        stored = httpx.post(f"{server.url}/v1/responses", json=BASE["/v1/responses"], timeout=120).json()
        example["previous_response_id"] = stored["id"]
    body = {**BASE[row["endpoint"]], **example}
    r = httpx.post(f"{server.url}{row['endpoint']}", json=body, timeout=120)
    if row["status"] == "rejected":
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"] or "").split(".")[0] == row["field"], error
        return
    assert r.status_code == 200, r.text
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events and not any(e.get("error") for e in events), r.text  # no in-band error event


@pytest.mark.parametrize("endpoint", list(BASE))
def test_vllms_requests_written_out_whole_at_its_defaults_are_served(server, endpoint):
    """Proxies and routers built on vLLM's protocol classes send every field at its default (tools/peer_flags.py
    wrote each request so from vLLM's own models): brisk serves them as they are. A Response's request_id is its
    id, once."""
    whole = json.loads((PEER_FLAGS / "vllm_request_defaults.json").read_text())
    assert whole["vllm"] == "0.33.0"
    body = {**whole[endpoint], "model": "brisk-demo"}
    assert len(body) > 50 and "mm_payload" in body
    # a few tokens, not vLLM's default of the whole context
    body["max_output_tokens" if endpoint == "/v1/responses" else "max_tokens"] = 4
    if endpoint == "/v1/responses":
        body["request_id"] = f"resp_defaults_{uuid.uuid4().hex}"
    r = httpx.post(f"{server.url}{endpoint}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if endpoint != "/v1/responses":
        return
    assert r.json()["id"] == body["request_id"]
    assert httpx.get(f"{server.url}/v1/responses/{body['request_id']}", timeout=60).json()["id"] == body["request_id"]
    again = httpx.post(f"{server.url}{endpoint}", json=body, timeout=120)
    assert again.status_code == 400 and again.json()["error"]["param"] == "request_id", again.text
    bad = httpx.post(f"{server.url}{endpoint}", json={**body, "request_id": "../x"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id", bad.text


@pytest.mark.parametrize("endpoint", list(BASE))
def test_a_field_outside_spec_and_extensions_is_refused_by_name(server, endpoint):
    r = httpx.post(f"{server.url}{endpoint}", json={**BASE[endpoint], "frobnicate": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate", r.text


def test_completions_echo_leads_with_the_prompt(server):
    body = {"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["text"]
    echoed = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "ROMEO:" + plain
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": True, "stream": True}).text
    texts = [json.loads(x[6:])["choices"][0]["text"] for x in streamed.splitlines() if x.startswith("data: {")]
    assert "".join(texts) == echoed
    alone = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": True, "max_tokens": 0}).json()
    assert alone["choices"][0]["text"] == "ROMEO:" and alone["usage"]["completion_tokens"] == 0
    refused = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_completions_echo_with_logprobs_leads_with_the_prompt_tokens(server):
    url = f"{server.url}/v1/completions"
    body = {"prompt": "ROMEO: Hark!", "temperature": 0, "ignore_eos": True, "logprobs": 2}
    alone = httpx.post(url, json={**body, "echo": True, "max_tokens": 0}).json()["choices"][0]
    lps = alone["logprobs"]
    num_prompt = len(lps["tokens"])
    assert alone["text"] == "ROMEO: Hark!" and alone["finish_reason"] == "length"
    assert "".join(lps["tokens"]) == "ROMEO: Hark!" and num_prompt > 2
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in lps["token_logprobs"][1:])
    assert lps["text_offset"] == [len("".join(lps["tokens"][:i])) for i in range(num_prompt)]
    # each prompt token's entry: the token itself plus its top 2
    assert all(tok in top and 2 <= len(top) <= 3 for tok, top in zip(lps["tokens"][1:], lps["top_logprobs"][1:]))
    # with generation: the prompt's logprobs, then the generated tokens' (as without echo)
    both = httpx.post(url, json={**body, "echo": True, "max_tokens": 3}).json()["choices"][0]["logprobs"]
    plain = httpx.post(url, json={**body, "max_tokens": 3}).json()["choices"][0]["logprobs"]
    assert both["tokens"] == lps["tokens"] + plain["tokens"]
    assert both["token_logprobs"][1:num_prompt] == pytest.approx(lps["token_logprobs"][1:], abs=1e-5)
    assert both["token_logprobs"][num_prompt:] == pytest.approx(plain["token_logprobs"], abs=1e-5)
    streamed = httpx.post(url, json={**body, "echo": True, "max_tokens": 3, "stream": True}).text
    chunks = [json.loads(x[6:])["choices"][0] for x in streamed.splitlines() if x.startswith("data: {")]
    assert sum((c["logprobs"]["tokens"] for c in chunks), []) == both["tokens"]
    # vLLM's prompt_logprobs: the same values, keyed by token id, with ranks
    vllm = httpx.post(url, json={**body, "prompt_logprobs": 1, "max_tokens": 0}).json()["choices"][0]
    entries = vllm["prompt_logprobs"]
    assert entries[0] is None and len(entries) == num_prompt
    for entry, lp in zip(entries[1:], lps["token_logprobs"][1:]):
        assert any(e["logprob"] == pytest.approx(lp, abs=1e-5) for e in entry.values())
        assert any(e["rank"] == 1 for e in entry.values())
    assert "prompt_logprobs" not in httpx.post(url, json={**body, "max_tokens": 1}).json()["choices"][0]


def test_chat_prompt_logprobs(server):
    url = f"{server.url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    out = httpx.post(url, json=body).json()
    entries = out["prompt_logprobs"]
    assert entries[0] is None and len(entries) == out["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in entries[1:])
    refused = httpx.post(url, json={**body, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    assert "prompt_logprobs" not in httpx.post(url, json={**body, "prompt_logprobs": None}).json()


def test_responses_truncation_auto_drops_the_oldest_items(server):
    long_turn = "To be, or not to be, that is the question. " * 30
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": long_turn} for i in range(6)]
    body = {"input": [*history, {"role": "user", "content": "Speak."}], "max_output_tokens": 4}
    too_long = httpx.post(f"{server.url}/v1/responses", json=body)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input", too_long.text
    fitted = httpx.post(f"{server.url}/v1/responses", json={**body, "truncation": "auto"})
    assert fitted.status_code == 200, fitted.text
    usage = fitted.json()["usage"]
    assert usage["input_tokens"] + 4 <= MAX_SEQ_LEN and fitted.json()["truncation"] == "auto"


def test_completions_response_format_constrains_as_structured_outputs_does(server):
    """vLLM's response_format on /v1/completions: the same constraint as structured_outputs' json (greedy: the same
    text), and the text ends in a value the schema allows."""
    schema = {"enum": ["yes", "no"]}
    body = {"prompt": "Answer:", "max_tokens": 20, "temperature": 0}

    def text(**constraint) -> str:
        r = httpx.post(f"{server.url}/v1/completions", json={**body, **constraint}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    constrained = text(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert constrained == text(structured_outputs={"json": schema})
    assert constrained.endswith(('"yes"', '"no"')) and constrained != text()


def test_completions_add_special_tokens_reaches_the_tokenizer():
    """vLLM's add_special_tokens on /v1/completions: each text prompt is encoded with the request's switch (the demo
    tokenizers add no BOS, so the switch is checked where the completions route hands it to the tokenizer)."""
    import asyncio

    from brisk.server.completions import _prompts

    calls: list[bool] = []

    class Tokenizing:
        async def encode(self, text: str, param: str, add_special_tokens: bool = True, may_truncate=False) -> list[int]:
            calls.append(add_special_tokens)
            return [len(text)]

        def check_text_fits(self, size: int, param: str) -> None:
            pass

    assert asyncio.run(_prompts(Tokenizing(), "Hi", False)) == [("Hi", [2])]  # type: ignore[arg-type]
    asyncio.run(_prompts(Tokenizing(), ["a", "bc"], True))  # type: ignore[arg-type]
    assert calls == [False, True, True]


def test_responses_take_vllms_sampling_extensions(server):
    """vLLM's extensions on /v1/responses: structured_outputs constrains the answer as text.format does, and
    logit_bias / stop_token_ids reach the sampler (greedy: banning the first token changes the output; its second
    token as a stop token ends it there)."""
    base = {**BASE["/v1/responses"], "max_output_tokens": 24, "temperature": 0}

    def respond(**fields) -> dict:
        r = httpx.post(f"{server.url}/v1/responses", json={**base, **fields}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def text(body: dict) -> str:
        return "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])

    schema = {"type": "json_schema", "name": "a", "schema": {"enum": ["yes", "no"]}}
    assert text(respond(structured_outputs={"json": {"enum": ["yes", "no"]}})) == text(respond(text={"format": schema}))
    assert text(respond(text={"format": schema})) in ('"yes"', '"no"')
    plain = respond(include=["message.output_text.logprobs"], top_logprobs=0)
    tokens = [t for item in plain["output"] if item["type"] == "message" for t in item["content"][0]["logprobs"]]
    first = httpx.post(f"{server.url}/tokenize", json={"prompt": tokens[0]["token"]}).json()["tokens"][0]
    assert respond(logit_bias={str(first): -100})["output"] != plain["output"]
    stopped = respond(stop_token_ids=[first])
    assert stopped["usage"]["output_tokens"] < plain["usage"]["output_tokens"]
