"""One validation path (issue 14): the same bad request offline and over HTTP names the same field; and the
OpenAPI document's response schemas describe what the endpoints really return.

One tiny Llama, loaded offline by `LLM` and served by a real `brisk serve`.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from brisk import LLM, SamplingParams
from tests.server_utils import RunningServer
from tests.tiny_models import make_tiny_llama_with_tokenizer

MAX_SEQ_LEN = 64
OUT_OF_VOCAB = 10**6

# (name, prompt token ids, SamplingParams / request fields, the field both errors must name)
BAD_REQUESTS = [
    ("empty prompt", [], {}, "prompt"),
    ("prompt id outside the vocabulary", [1, OUT_OF_VOCAB], {}, "prompt"),
    ("prompt too long", [1] * MAX_SEQ_LEN, {"max_tokens": 1}, "prompt"),
    ("prompt + max_tokens too long", [1, 2, 3], {"max_tokens": MAX_SEQ_LEN}, "max_tokens"),
    ("stop_token_ids outside the vocabulary", [1, 2], {"stop_token_ids": [OUT_OF_VOCAB]}, "stop_token_ids"),
    ("logit_bias outside the vocabulary", [1, 2], {"logit_bias": {OUT_OF_VOCAB: 1.0}}, "logit_bias"),
    ("negative temperature", [1, 2], {"temperature": -1.0}, "temperature"),
    ("top_p of zero", [1, 2], {"top_p": 0.0}, "top_p"),
    ("min_p above one", [1, 2], {"min_p": 1.5}, "min_p"),
    ("n of zero", [1, 2], {"n": 0}, "n"),
    ("min_tokens above max_tokens", [1, 2], {"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("too many logprobs", [1, 2], {"logprobs": 21}, "logprobs"),
    ("presence_penalty out of range", [1, 2], {"presence_penalty": 3.0}, "presence_penalty"),
    ("negative seed", [1, 2], {"seed": -1}, "seed"),
    ("top_k below -1", [1, 2], {"top_k": -2}, "top_k"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_validation")
    make_tiny_llama_with_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = RunningServer(model_dir, "--served-model-name", "tiny", "--max_seq_len", str(MAX_SEQ_LEN))
    yield srv
    srv.stop()


@pytest.mark.parametrize(("prompt", "fields", "param"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_same_bad_request_names_the_same_field_offline_and_over_http(llm, server, prompt, fields, param):
    with pytest.raises(ValueError) as offline:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(**fields))
    assert getattr(offline.value, "param", None) == param, str(offline.value)
    assert "None" not in str(offline.value)  # reads naturally ("asks for None more" was one)
    assert not llm.engine.has_unfinished_requests()

    body = {
        "prompt": prompt,
        **{k: ({str(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in fields.items()},
    }
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "None" not in error["message"]


def test_unknown_chat_role_is_refused_offline_and_over_http(llm, server):
    messages = [{"role": "wizard", "content": "hi"}]
    with pytest.raises(ValueError, match="wizard"):
        llm.chat(messages, SamplingParams(max_tokens=1))
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "wizard" in r.text


def test_offline_chat_renders_the_prompt_the_server_renders(llm, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    served = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert llm.render_chat(messages) == served
    out = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == served


def _validator(document: dict, schema: dict) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**schema, "components": document["components"]})


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_openapi_response_schemas_are_documented_and_validate_real_responses(server):
    document = httpx.get(f"{server.url}/openapi.json").json()
    calls = {
        ("get", "/version"): None,
        ("get", "/v1/models"): None,
        ("post", "/tokenize"): {"prompt": "Hello"},
        ("post", "/detokenize"): {"tokens": [1, 2, 3]},
        ("post", "/v1/chat/completions"): {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        ("post", "/v1/completions"): {"prompt": "Hi", "max_tokens": 3, "logprobs": 2},
        ("post", "/v1/responses"): {"input": "Hi", "max_output_tokens": 3},
        # the stored-response routes, on a background response (the only kind that can be cancelled)
        ("get", "/v1/responses/{response_id}"): None,
        ("get", "/v1/responses/{response_id}/input_items"): None,
        ("post", "/v1/responses/{response_id}/cancel"): None,
        ("delete", "/v1/responses/{response_id}"): None,
    }
    stored = httpx.post(
        f"{server.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 3, "background": True}, timeout=60
    )
    assert stored.status_code == 200, stored.text
    response_id = stored.json()["id"]
    json_endpoints = {
        (method, path)
        for path, ops in document["paths"].items()
        for method, op in ops.items()
        if "application/json" in op["responses"]["200"]["content"]
    }
    assert json_endpoints == set(calls)  # every JSON endpoint is exercised below
    checked = 0
    for (method, path), body in calls.items():
        content = document["paths"][path][method]["responses"]["200"]["content"]
        schema = content["application/json"]["schema"]
        assert schema, f"{method} {path}: empty response schema"
        url = f"{server.url}{path.format(response_id=response_id)}"
        r = httpx.request(method, url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        _validator(document, schema).validate(r.json())
        checked += 1
        if "text/event-stream" in content:  # the streamed form: every event validates against its schema
            stream_schema = content["text/event-stream"]["schema"]
            events = _sse_events(httpx.post(f"{server.url}{path}", json={**body, "stream": True}, timeout=60).text)
            assert events and stream_schema
            for event in events:
                _validator(document, stream_schema).validate(event)
    assert checked == len(calls)
    # error responses are documented with OpenAI's error shape, and never as FastAPI's 422
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and chat["400"]["content"]["application/json"]["schema"]
    for path in ("/health", "/metrics"):
        assert document["paths"][path]["get"]["responses"]["200"]["content"]["text/plain"]["schema"]
