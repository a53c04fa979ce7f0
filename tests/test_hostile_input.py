"""Hostile HTTP input against a live `brisk serve`: every case is a 4xx OpenAI-style error, never a 500
or a crash, and the server answers a normal request afterwards. Ends with a schemathesis fuzz run
generated from the server's own OpenAPI schema, asserting zero 5xx responses.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.server_utils import RunningServer
from tests.tiny_models import make_tiny_llama_with_tokenizer

MAX_SEQ_LEN = 48  # short generations keep the fuzz run fast
BODY_LIMIT = 1 << 20
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
USER = [{"role": "user", "content": "hi"}]
# What an error body must never show: tracebacks, source files, our paths.
LEAK_MARKERS = ("Traceback", 'File "', ".py", "/brisk/", "site-packages")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_hostile")
    make_tiny_llama_with_tokenizer(path)
    srv = RunningServer(
        str(path),
        "--served-model-name",
        "tiny",
        "--max_seq_len",
        str(MAX_SEQ_LEN),
        "--max-request-body-size",
        str(BODY_LIMIT),
        "--request-timeout",
        "2",
    )
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def still_serving(server) -> Iterator[None]:
    """After every test: the server is alive and a normal request succeeds."""
    yield
    assert server.proc.poll() is None, server.log()
    r = httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": "ok", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["type"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    assert not any(marker in r.text for marker in LEAK_MARKERS), r.text[:500]
    return error


def post_raw(server: RunningServer, path: str, content: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}", content=content, headers={"content-type": "application/json", **headers}, timeout=60
    )


# ---- malformed bodies ------------------------------------------------------------------------------
MALFORMED = {
    "not json": b"{not json",
    "truncated": b'{"prompt": "x", "max_tokens": ',
    "invalid utf-8": b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}',
    "lone surrogate": b'{"prompt": "\\ud800 alone", "max_tokens": 2}',
    "not an object": b"[1, 2, 3]",
    "empty": b"",
    "NaN literal": b'{"prompt": "x", "temperature": NaN}',
    "Infinity literal": b'{"prompt": "x", "top_p": Infinity}',
    "-Infinity literal": b'{"prompt": "x", "presence_penalty": -Infinity}',
    "NaN logit bias": b'{"prompt": "x", "logit_bias": {"5": NaN}}',
    "NaN timeout": b'{"prompt": "x", "timeout": NaN}',
    "5000-digit integer": b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    "nesting 100k deep": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_body_is_400(server, body):
    assert_openai_error(post_raw(server, COMPLETIONS, body), 400)


# ---- wrong types and out-of-range values -----------------------------------------------------------
BAD_VALUES = {
    "prompt is a number": (COMPLETIONS, {"prompt": 5}),
    "prompt mixes types": (COMPLETIONS, {"prompt": ["a", 1]}),
    "messages is a string": (CHAT, {"messages": "hi"}),
    "messages empty": (CHAT, {"messages": []}),
    "message without role": (CHAT, {"messages": [{"content": "hi"}]}),
    "message content is an object": (CHAT, {"messages": [{"role": "user", "content": {"a": 1}}]}),
    "n is a list": (COMPLETIONS, {"prompt": "x", "n": [1]}),
    "stream is an object": (COMPLETIONS, {"prompt": "x", "stream": {}}),
    "unknown field": (COMPLETIONS, {"prompt": "x", "bogus": 1}),
    "enormous n": (COMPLETIONS, {"prompt": "x", "n": 10**6}),
    "enormous max_tokens": (COMPLETIONS, {"prompt": "x", "max_tokens": 10**12}),
    "enormous chat max_tokens": (CHAT, {"messages": USER, "max_tokens": 10**30}),
    "enormous logprobs": (COMPLETIONS, {"prompt": "x", "logprobs": 10**9}),
    "enormous top_logprobs": (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 10**9}),
    "enormous min_tokens": (CHAT, {"messages": USER, "min_tokens": 10**30}),
    "enormous priority": (COMPLETIONS, {"prompt": "x", "priority": 10**30}),
    "enormous top_k": (COMPLETIONS, {"prompt": "x", "top_k": 10**30}),
    "enormous seed": (COMPLETIONS, {"prompt": "x", "seed": 10**30}),
    "negative max_tokens": (COMPLETIONS, {"prompt": "x", "max_tokens": -1}),
    "negative temperature": (COMPLETIONS, {"prompt": "x", "temperature": -1}),
    "negative top_p": (CHAT, {"messages": USER, "top_p": -0.5}),
    "zero timeout": (COMPLETIONS, {"prompt": "x", "timeout": 0}),
    "negative timeout": (RESPONSES, {"input": "x", "timeout": -5}),
    "huge presence penalty": (COMPLETIONS, {"prompt": "x", "presence_penalty": 1e308}),
    "100k-character stop string": (COMPLETIONS, {"prompt": "x", "stop": "s" * 100_000}),
    "1000 stop strings": (COMPLETIONS, {"prompt": "x", "stop": [f"s{i}" for i in range(1000)]}),
    "empty stop string": (COMPLETIONS, {"prompt": "x", "stop": [""]}),
    "token id beyond vocab": (COMPLETIONS, {"prompt": [1, 2, 10**7]}),
    "negative token id": (COMPLETIONS, {"prompt": [-1, 5]}),
    "huge token id": (COMPLETIONS, {"prompt": [10**30]}),
    "empty token list": (COMPLETIONS, {"prompt": [[]]}),
    "stop token id beyond vocab": (COMPLETIONS, {"prompt": "x", "stop_token_ids": [10**7]}),
    "logit bias beyond vocab": (COMPLETIONS, {"prompt": "x", "logit_bias": {"100000": 1}}),
    "logit bias key not a number": (COMPLETIONS, {"prompt": "x", "logit_bias": {"abc": 1}}),
    "detokenize beyond vocab": ("/detokenize", {"tokens": [10**7]}),
    "detokenize huge": ("/detokenize", {"tokens": [10**30]}),
    "too many prompts": (COMPLETIONS, {"prompt": ["x"] * 5000}),
    "responses input item not an object": (RESPONSES, {"input": [1, 2]}),
    "responses bad role": (RESPONSES, {"input": [{"type": "message", "role": "wizard", "content": "x"}]}),
    "responses bad item type": (RESPONSES, {"input": [{"type": "teleport"}]}),
    "tools on a non-harmony model": (
        CHAT,
        {
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        },
    ),
}


@pytest.mark.parametrize("path, body", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_bad_value_is_400(server, path, body):
    assert_openai_error(httpx.post(f"{server.url}{path}", json=body, timeout=60), 400)


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"inner": schema}}
    return schema


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_deeply_nested_tool_schema_is_400(server, path):
    function = {"name": "deep", "parameters": nested_schema(200)}
    body = (
        {"messages": USER, "tools": [{"type": "function", "function": function}]}
        if path == CHAT
        else {"input": "hi", "tools": [{"type": "function", **function}]}
    )
    error = assert_openai_error(post_raw(server, path, json.dumps(body).encode()), 400)
    assert "deeper than" in error["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        (COMPLETIONS, {"prompt": "word " * (4 * MAX_SEQ_LEN), "max_tokens": 1}),
        (COMPLETIONS, {"prompt": list(range(10, 10 + MAX_SEQ_LEN))}),
        (CHAT, {"messages": [{"role": "user", "content": "word " * (4 * MAX_SEQ_LEN)}]}),
        (RESPONSES, {"input": "word " * (4 * MAX_SEQ_LEN)}),
        (COMPLETIONS, {"prompt": "x", "max_tokens": MAX_SEQ_LEN}),
    ],
    ids=["text", "token ids", "chat", "responses", "max_tokens"],
)
def test_longer_than_max_seq_len_is_400(server, path, body):
    assert_openai_error(httpx.post(f"{server.url}{path}", json=body, timeout=60), 400, "context_length_exceeded")


# ---- size limits -----------------------------------------------------------------------------------
def test_body_over_the_limit_is_413(server):
    body = json.dumps({"prompt": "x" * BODY_LIMIT}).encode()
    assert_openai_error(post_raw(server, COMPLETIONS, body), 413, "request_too_large")


def test_chunked_body_over_the_limit_is_413(server):
    """No Content-Length: the limit is enforced on the bytes as they arrive."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 4096 + 8):
            yield b"x" * 4096
        yield b'"}'

    r = httpx.post(
        f"{server.url}{COMPLETIONS}", content=chunks(), headers={"content-type": "application/json"}, timeout=60
    )
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert_openai_error(r, 413, "request_too_large")


def test_chunked_body_within_the_limit_is_served(server):
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "chunked", '
        yield b'"max_tokens": 2, "ignore_eos": true}'  # a sampled EOS would end it after one token

    r = httpx.post(
        f"{server.url}{COMPLETIONS}", content=chunks(), headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_content_length_over_the_limit_is_413_before_the_body_is_read(server):
    """A declared length over the limit is refused at once, without waiting for (or reading) the body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 10000000000\r\n\r\n{"prompt": '
        )
        response = b""
        while b"\r\n\r\n" not in response or not response.endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"]["code"] == "request_too_large"


# ---- routes and methods ----------------------------------------------------------------------------
def test_unknown_route_and_wrong_method(server):
    assert_openai_error(httpx.post(f"{server.url}/v1/nothing", json={}), 404)
    assert_openai_error(httpx.get(f"{server.url}{COMPLETIONS}"), 405)
    assert_openai_error(httpx.delete(f"{server.url}/v1/models"), 405)


# ---- what fuzzing the OpenAPI document found (issue 29) -------------------------------------------------------------
@pytest.mark.parametrize("bias", [100.5, -101, 1e9])
def test_a_logit_bias_beyond_100_is_400(server, bias):
    r = httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": "x", "logit_bias": {"5": bias}}, timeout=60)
    assert assert_openai_error(r, 400)["param"] == "logit_bias.5"
    ok = {"prompt": "x", "max_tokens": 2, "logit_bias": {"5": -100, "6": 100}}
    assert httpx.post(f"{server.url}{COMPLETIONS}", json=ok, timeout=60).status_code == 200


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
def test_a_message_without_content_is_400(server, role):
    messages = [{"role": role, "content": None}, *USER]
    error = assert_openai_error(httpx.post(f"{server.url}{CHAT}", json={"messages": messages}, timeout=60), 400)
    assert error["param"] == "messages" and "messages[0]" in error["message"] and role in error["message"]


UNPARSEABLE = {
    "invalid utf-8": (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "not valid UTF-8"),
    "nesting 1,500 deep": (b'{"prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}", "nests too deeply"),
    "not json": (b"hello", "not valid JSON"),
    "truncated": (b'{"prompt": "x", "max_tokens": ', "not valid JSON"),
}


@pytest.mark.parametrize("body, reason", UNPARSEABLE.values(), ids=UNPARSEABLE.keys())
def test_an_unparseable_body_is_400_naming_the_body_and_why(server, body, reason):
    error = assert_openai_error(post_raw(server, COMPLETIONS, body), 400)
    assert error["param"] == "body" and reason in error["message"]


def test_health_has_a_content_type(server):
    r = httpx.get(f"{server.url}/health", timeout=30)
    assert r.status_code == 200 and r.text == "" and r.headers["content-type"].startswith("text/plain")


def test_the_tokenizer_endpoints_document_their_errors(server):
    paths = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    for path in ("/tokenize", "/detokenize"):
        assert {"400", "404"} <= set(paths[path]["post"]["responses"]), path
    assert_openai_error(httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "model": "other"}), 404)
    assert_openai_error(httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "messages": USER}), 400)


# ---- fuzzing from the OpenAPI schema ---------------------------------------------------------------
def test_fuzz_openapi_schema_never_5xx(server, pytestconfig):
    examples = pytestconfig.getoption("--fuzz-examples")  # per operation and mode: 25 gives ~270 cases
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures: list[str] = []
    num_cases = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        # Operations without a body (GETs, DELETE, POST .../cancel take a free-form id) have no invalid input to
        # generate.
        has_body = operation.method.upper() == "POST" and len(operation.body) > 0
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_body else [])
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def call(case) -> None:  # runs within this iteration, so the loop variables are current
                nonlocal num_cases
                num_cases += 1
                response = case.call(base_url=server.url, timeout=60)
                leaked = any(marker in response.text for marker in LEAK_MARKERS)
                if response.status_code >= 500 or leaked:
                    failures.append(
                        f"{operation.label} {mode.value} -> {response.status_code}: "  # noqa: B023
                        f"{response.text[:200]}\n  {case.as_curl_command()[:300]}"
                    )

            call()
    assert num_cases >= 8 * examples
    assert not failures, "\n".join(failures[:10])
