"""`ServerConfig`: the options of `brisk serve` alone (the HTTP server, its API processes, logging, TLS, CORS,
the OpenAI API's behaviour), declared as `brisk.config` declares the engine's; `brisk.config.OPTIONS` holds both."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Literal

from pydantic import field_validator, model_validator

from brisk.errors import ConfigError
from brisk.options import Alias, OptionModel, option


def _origins(text: str) -> list[str]:
    """A CORS list (origins, methods, headers): a JSON list (vLLM's form) or comma-separated."""
    if text.strip().startswith("["):
        value = json.loads(text)
        if not isinstance(value, list):
            raise argparse.ArgumentTypeError("must be a JSON list of origins")
        return [str(v) for v in value]
    return [item.strip() for item in text.split(",") if item.strip()]


class ServerConfig(OptionModel):
    """Server options (`brisk serve` only)"""

    host: str = option("127.0.0.1", "the address to listen on (0.0.0.0: every interface)", trtllm="host", vllm="host")
    port: int = option(8000, "the port to listen on", ge=0, le=65535, trtllm="port", vllm="port")
    uds: str | None = option(None, "listen on this Unix domain socket instead (--host and --port unused)", vllm="uds")
    served_model_name: list[str] | None = option(
        None,
        "the model's name in the API (default: MODEL as given); several names: the first is reported, all are served",
        vllm="served_model_name",
        nargs="+",
        metavar="NAME",
    )
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every route but /health and /ping (default: $BRISK_API_KEY)",
        vllm="api_key",
    )
    api_key_file: str | None = option(None, "read the API key from the first line of this file (keeps it out of `ps`)")
    max_request_body_size: int = option(8 << 20, "bytes; larger bodies get 413, chunked uploads included", ge=1)
    allowed_origins: list[str] | None = option(
        None,
        "origins allowed by CORS, comma-separated or a JSON list ('*' for any); CORS is off without it",
        vllm="allowed_origins",
        parse=_origins,
        metavar="ORIGINS",
    )
    ssl_certfile: str | None = option(
        None, "serve HTTPS with this certificate (PEM; with ssl_keyfile)", vllm="ssl_certfile"
    )
    ssl_keyfile: str | None = option(None, "the certificate's private key (PEM)", vllm="ssl_keyfile")
    ssl_ca_certs: str | None = option(
        None, "CA certificates (PEM) that client certificates are checked against", vllm="ssl_ca_certs"
    )
    ssl_cert_reqs: int = option(
        0, "client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)", ge=0, le=2, vllm="ssl_cert_reqs"
    )
    ssl_ciphers: str = option("TLSv1", "the TLS ciphers (OpenSSL's cipher list)", vllm="ssl_ciphers")
    allowed_methods: list[str] = option(
        default_factory=lambda: ["GET", "POST", "DELETE"],
        help="methods CORS allows (with allowed_origins), comma-separated or a JSON list ('*' for any)",
        vllm="allowed_methods",
        parse=_origins,
        metavar="METHODS",
    )
    allowed_headers: list[str] = option(
        default_factory=lambda: ["Authorization", "Content-Type"],
        help="request headers CORS allows (with allowed_origins), comma-separated or a JSON list ('*' for any)",
        vllm="allowed_headers",
        parse=_origins,
        metavar="HEADERS",
    )
    allow_credentials: bool = option(
        False,
        "CORS lets browsers send credentials (cookies) cross-origin (with allowed_origins)",
        vllm="allow_credentials",
    )
    root_path: str = option(
        "",
        "the path prefix a proxy serves brisk under (for the links of /docs); routes stay at the root",
        vllm="root_path",
    )
    disable_fastapi_docs: bool = option(
        False, "serve no OpenAPI document, /docs or /redoc", vllm="disable_fastapi_docs"
    )
    enable_request_id_headers: bool = option(
        False,
        "every response carries an X-Request-Id header: the request's own, or a new one",
        vllm="enable_request_id_headers",
    )
    log_prompts: bool = option(False, "log each request's prompt (request logs carry no prompt text otherwise)")
    log_outputs: bool = option(
        False,
        "log each request's outputs when it ends: each completion's text (or its token ids), token count and finish",
        vllm="enable_log_outputs",
    )
    max_log_len: int | None = option(
        None,
        "with log_prompts / log_outputs: a logged prompt's or output's characters (or token ids) at most",
        ge=0,
        vllm="max_log_len",
    )
    request_timeout: float | None = option(
        None, "seconds; longer-running requests are aborted (finish_reason 'abort')", gt=0.0
    )
    enable_force_include_usage: bool = option(
        False,
        "every streamed chat completion and completion ends with a usage chunk, as if it asked for it "
        "(stream_options.include_usage)",
        vllm="enable_force_include_usage",
    )
    enable_tokenizer_info_endpoint: bool = option(
        False,
        "serve GET /tokenizer_info (the tokenizer's configuration and the chat template)",
        vllm="enable_tokenizer_info_endpoint",
    )
    exclude_tools_when_tool_choice_none: bool = option(
        True,
        "tool_choice 'none' leaves the tools out of the prompt (OpenAI's meaning: no call is possible); off, the prompt "
        "shows them, as vLLM's default does, and a call the model writes is dropped from the answer",
        vllm="exclude_tools_when_tool_choice_none",
    )
    enable_prompt_tokens_details: bool = option(
        True,
        "chat completions and completions report usage.prompt_tokens_details.cached_tokens, as OpenAI does (vLLM's "
        "default is off; off, the field is null)",
        vllm="enable_prompt_tokens_details",
    )
    fingerprint_mode: Literal["full", "hash", "custom", "none"] = option(
        "full",
        "the system_fingerprint of chat completions and completions: full, brisk-<version>[-tp<n>][-dp<n>][-ep]-<hash "
        "of the engine options>; hash, without the parallel layout; custom, --fingerprint-value; none, no field",
        vllm="fingerprint_mode",
    )
    fingerprint_value: str | None = option(
        None, "the system_fingerprint under --fingerprint-mode custom", vllm="fingerprint_value"
    )
    sse_keep_alive_interval: float = option(
        0.0,
        "a streamed response sends an SSE comment line after this many seconds without an event (queued, in "
        "prefill, between tokens), so proxies with read timeouts keep the connection; 0: never",
        ge=0.0,
        vllm="sse_keep_alive_interval",
    )
    shutdown_timeout: float = option(
        30.0,
        "seconds in-flight requests may run after SIGTERM before being aborted (0: at once, vLLM's default)",
        ge=0.0,
    )
    otlp_traces_endpoint: str | None = option(
        None, "export OpenTelemetry traces by OTLP/HTTP to this URL (the otel extra)", vllm="otlp_traces_endpoint"
    )
    log_format: Literal["text", "json"] = option(
        "text", "json: one JSON object a log line, and one line per finished request with its id and timings"
    )
    log_level: Literal["debug", "info", "warning", "error"] = option(
        "info", "brisk's log level; debug also prints the traceback of a start-up error", trtllm="log_level"
    )
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = option(
        "info", "the HTTP server's (uvicorn's) log level", vllm="uvicorn_log_level"
    )
    disable_log_requests: bool = option(
        False,
        "no log line per request (method, path, status, time; prompts only with --log-prompts); vLLM's "
        "--enable-log-requests is its opposite",
        vllm=("disable_log_requests", "disable_uvicorn_access_log", Alias("enable_log_requests", invert=True)),
    )
    profile_dir: str | None = option(
        None, "enable POST /start_profile and /stop_profile, writing torch profiler traces here"
    )
    state_dir: str | None = option(None, "folder of the server's state: stored Responses; default ~/.local/state/brisk")
    response_ttl: float = option(30 * 24 * 3600.0, "seconds a stored Response is kept (default 30 days)", gt=0.0)
    max_stored_responses: int = option(100_000, "stored Responses kept at most; the oldest go first", ge=1)
    api_server_count: int = option(
        1,
        "API-server processes on the one port, each tokenizing, detokenizing and streaming its own requests to the one "
        "engine process; more than 1 when the API side is the bottleneck (docs/deploy.md)",
        vllm="api_server_count",
        trtllm="num_serve_frontends",
        short=("-asc",),
        ge=1,
    )
    num_postprocess_workers: int = option(
        0,
        "trtllm's detokenizing processes: brisk post-processes in its API-server processes, so N > 1 runs N of them "
        "(as --api-server-count N)",
        ge=0,
        trtllm="num_postprocess_workers",
    )
    default_chat_template_kwargs: dict[str, Any] | None = option(
        None,
        "keyword arguments every request's chat template gets (gpt-oss: reasoning_effort; Qwen3: enable_thinking); "
        "a request's chat_template_kwargs override them key by key",
        vllm="default_chat_template_kwargs",
    )
    return_tokens_as_token_ids: bool = option(
        False,
        "logprobs name each token 'token_id:N' instead of its text (every API; a chat or completion request's own "
        "return_tokens_as_token_ids decides for it)",
        vllm="return_tokens_as_token_ids",
    )
    reasoning_effort_map: dict[str, str] | None = option(
        None,
        "a request's reasoning effort (reasoning_effort; the Responses API's reasoning.effort) rewritten before the "
        'chat template sees it, efforts not listed unchanged: e.g. \'{"minimal": "low", "xhigh": "high"}\' '
        "for gpt-oss, which knows low, medium and high",
        vllm="reasoning_effort_map",
    )
    tool_call_parser: str | None = option(
        None,
        "harmony models (gpt-oss) have their tool calls parsed by brisk's harmony parser: openai is accepted for them",
        vllm="tool_call_parser",
        trtllm="tool_parser",
    )
    reasoning_parser: str | None = option(
        None,
        "harmony models (gpt-oss) have their reasoning parsed by brisk's harmony parser: openai_gptoss (GptOss) is "
        "accepted for them",
        vllm="reasoning_parser",
        trtllm="reasoning_parser",
    )
    enable_auto_tool_choice: bool = option(
        False,
        "tool_choice auto: always on for harmony models (gpt-oss), where brisk parses tool calls (no effect there)",
        vllm="enable_auto_tool_choice",
    )

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _one_name(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _origin_text(cls, value: Any) -> Any:
        return _origins(value) if isinstance(value, str) else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _trtllm_log_levels(cls, value: Any) -> Any:
        trtllm = {"trace": "debug", "verbose": "debug", "internal_error": "error"}
        return trtllm.get(value.lower(), value.lower()) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _tls_files(self) -> ServerConfig:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together: give both to serve HTTPS")
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path}: no such file")
        if (self.ssl_ca_certs is not None or self.ssl_cert_reqs) and self.ssl_certfile is None:
            raise ValueError(
                "ssl_ca_certs and ssl_cert_reqs check clients over HTTPS: give ssl_certfile and ssl_keyfile"
            )
        if self.ssl_cert_reqs == 2 and self.num_api_servers > 1:
            raise ValueError(
                "ssl_cert_reqs 2 (client certificates required) with several API-server processes: they forward "
                "requests to each other without one; give ssl_cert_reqs 0 or 1, or one API-server process"
            )
        return self

    @model_validator(mode="after")
    def _fingerprint_value_with_custom(self) -> ServerConfig:
        if (self.fingerprint_mode == "custom") != (self.fingerprint_value is not None):
            raise ValueError("fingerprint_value goes with fingerprint_mode custom (and custom needs the value)")
        return self

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile is not None else "http"

    @property
    def address(self) -> str:
        """Where the server listens, as its start-up line shows it."""
        return f"unix:{self.uds}" if self.uds is not None else f"{self.scheme}://{self.host}:{self.port}"

    @model_validator(mode="after")
    def _one_process_count(self) -> ServerConfig:
        workers, count = self.num_postprocess_workers, self.api_server_count
        if workers > 1 and "api_server_count" in self.model_fields_set and count != workers:
            raise ValueError(
                f"api_server_count {count} and num_postprocess_workers {workers} both set how many API-server "
                "processes run: give one of them"
            )
        return self

    @property
    def num_api_servers(self) -> int:
        """The API-server processes to run: --api-server-count, or trtllm's num_postprocess_workers (brisk
        post-processes each request in the API-server process that serves it)."""
        return max(self.api_server_count, self.num_postprocess_workers)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, value: str | None) -> str | None:
        if value is not None and value != "openai":
            raise ValueError(
                f"brisk has no tool-call parser {value!r}: it parses the tool calls of harmony models (gpt-oss) "
                "itself (--tool-call-parser openai, or leave it out)"
            )
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        if value == "":  # vLLM's default: no parser; harmony models' reasoning is parsed all the same
            return None
        if value is not None and value.replace("_", "").replace("-", "").lower() not in HARMONY_REASONING_PARSERS:
            raise ValueError(
                f"brisk has no reasoning parser {value!r}: it parses the reasoning of harmony models (gpt-oss) "
                "itself (--reasoning-parser openai_gptoss, or leave it out)"
            )
        return value

    def check_model(self, is_harmony: bool) -> None:
        """The parser options name harmony's parsers, which only harmony models speak."""
        if is_harmony:
            return
        for name in ("tool_call_parser", "reasoning_parser", "enable_auto_tool_choice"):
            if getattr(self, name):
                raise ConfigError(
                    f"--{name.replace('_', '-')}: brisk parses tool calls and reasoning of harmony models (gpt-oss) "
                    "only, and this model is not one; leave the option out"
                )


# vLLM's gpt-oss reasoning parser (openai_gptoss) and trtllm's / the spellings, without '_' / '-', lower case
HARMONY_REASONING_PARSERS = frozenset({"openaigptoss", "gptoss", "openai", "harmony"})
