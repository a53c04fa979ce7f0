"""What every router shares: the engine client, tokenizer and config, and the request checks run in one order.

Order of checks for a generation request (each answers before any work is done):
  middleware: draining (503), API key (401), body size (413)  ->  pydantic schema (400)  ->
  model name (404)  ->  capacity (503 engine dead, 400 too many prompts, 429 full)  ->
  sampling fields (400)  ->  render / tokenize (400)  ->  token ids and lengths against the model (400).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request

import brisk
from brisk.config import EngineConfig
from brisk.detokenizer import TokenDecoder
from brisk.engine.client import AsyncEngineClient, EngineDeadError
from brisk.engine.messages import EngineInfo
from brisk.engine.output_processor import CompletionDelta
from brisk.errors import InvalidRequest
from brisk.harmony.chat import render_chat
from brisk.harmony.render import REASONING_EFFORTS
from brisk.outputs import RequestOutput
from brisk.sampling_params import SamplingParams
from brisk.server.errors import APIError
from brisk.server.metrics import RequestTiming, ServerMetrics
from brisk.server.peers import Peers
from brisk.server.response_run import BackgroundRuns
from brisk.server.response_store import ResponseStore
from brisk.server.schemas import Usage
from brisk.server.tracing import ObservabilityConfig
from brisk.server_config import ServerConfig
from brisk.structured.compiler import GrammarCompiler
from brisk.structured.state import GrammarCompileError

logger = logging.getLogger("brisk.server")
# Texts this long (~1 ms of tokenizing and up) are rendered and tokenized on a worker thread, off the event loop.
OFF_LOOP_CHARS = 16_384


@dataclass
class ServerState:
    client: AsyncEngineClient
    tokenizer: Any
    config: EngineConfig
    model_name: str  # the name responses report (the first --served-model-name)
    generation_defaults: dict[str, Any]
    is_harmony: bool
    server: ServerConfig = field(default_factory=ServerConfig)  # the `brisk serve` options
    api_key: str | None = None  # resolved from --api-key, --api-key-file or $BRISK_API_KEY; None: no auth
    model_aliases: tuple[str, ...] = ()  # further --served-model-name names requests may use
    response_store: ResponseStore | None = None  # stored Responses (store: true); None keeps none
    draining: bool = False  # set at shutdown: new requests get 503, in-flight ones finish
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)  # traces, logs, profiling
    peers: Peers | None = None  # the other API-server processes of this server (--api-server-count > 1)
    metrics: ServerMetrics = field(init=False)
    background_runs: BackgroundRuns = field(init=False)
    _grammar_compiler: GrammarCompiler | None = field(init=False, default=None)
    _grammar_compiler_lock: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)
    started: float = field(default_factory=time.time)
    # gpt-oss's message text, decoded for every request by one TokenDecoder (its per-id byte table fills once)
    harmony_text_decoder: TokenDecoder | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.is_harmony:
            self.harmony_text_decoder = TokenDecoder(self.tokenizer, skip_special_tokens=True)
        peers = self.peers
        self.metrics = ServerMetrics(
            self.model_name,
            multiprocess_dir=None if peers is None else peers.metrics_dir,
            observes_engine=peers is None or peers.index == 0,
        )
        self.metrics.bind_engine(self.client, self.config)
        self.background_runs = BackgroundRuns()

    @property
    def max_request_body_size(self) -> int:
        return self.server.max_request_body_size

    @property
    def request_timeout(self) -> float | None:
        """The server-wide cap on a request's run time, seconds."""
        return self.server.request_timeout

    @functools.cached_property
    def system_fingerprint(self) -> str | None:
        """What chat completions and completions report as their system_fingerprint (--fingerprint-mode)."""
        return system_fingerprint(self.config, self.server)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        """A chat completion's or completion's usage, with prompt_tokens_details unless the server turned it off."""
        return Usage.of(prompt_tokens, completion_tokens, cached_tokens, self.server.enable_prompt_tokens_details)

    @property
    def log_prompts(self) -> bool:
        return self.server.log_prompts

    @property
    def allowed_origins(self) -> list[str]:
        return list(self.server.allowed_origins or [])

    @property
    def info(self) -> EngineInfo:
        """The engine's facts (vocabulary, max_seq_len); a 503 before the engine has started."""
        info = self.client.info
        if info is None:
            raise APIError(503, "The engine is not running.", code="engine_dead")
        return info

    # ---- request checks shared by the endpoints ------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, *self.model_aliases, self.config.model):
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )

    def load(self) -> int:
        """Generation requests in flight, queued or running (with several API-server processes, all of theirs)."""
        load = self.client.num_in_flight
        if self.peers is not None:  # the engine's count holds the other API-server processes' requests too
            load = max(load, self.client.engine_load())
        return load

    def admit(self, num_requests: int = 1) -> None:
        """Refuse work the server cannot take now (429, retry) or ever (400), before doing any."""
        if self.client.dead:
            raise APIError(503, "The engine is not running.", code="engine_dead")
        capacity = self.config.max_batch_size + self.config.max_num_waiting
        if num_requests > capacity:
            raise APIError(400, f"A request may hold at most {capacity} prompts.", param="prompt")
        if self.load() + num_requests > capacity:
            raise APIError(
                429, "The server is at capacity; retry later.", code="queue_full", headers={"Retry-After": "1"}
            )

    def sampling_params(self, req) -> SamplingParams:
        """The request's SamplingParams; an invalid value is a 400 naming the request's own field."""
        try:
            params = req.to_sampling_params(self.generation_defaults)
            params.check_max_logprobs(self.config.max_logprobs)
        except InvalidRequest as exc:
            raise invalid_request_error(exc, req.field_names()) from None
        if getattr(req, "bad_words", None):
            params.logit_bias = {**(params.logit_bias or {}), **self.banned_tokens(req.bad_words)}
        return params

    def banned_tokens(self, words: list[str]) -> dict[int, float]:
        """vLLM's bad_words as a logit bias of -100 (OpenAI's "ban") on each word's token, with and without a
        leading space. A word of several tokens would need a ban that depends on the tokens before it: 400."""
        banned: dict[int, float] = {}
        for word in words:
            variants = [self.tokenizer.encode(w, add_special_tokens=False) for w in {word, " " + word.lstrip()}]
            single = [ids[0] for ids in variants if len(ids) == 1]
            if not single:
                raise APIError(
                    400,
                    f"bad_words: {word!r} is several tokens; only single-token words can be banned.",
                    param="bad_words",
                )
            banned.update(dict.fromkeys(single, -100.0))
        return banned

    def check_prompt(
        self, prompt_ids: list[int], params: SamplingParams, field_names: dict[str, str] | None = None
    ) -> None:
        """The same model checks the offline API runs (SamplingParams.check_for_model), as a 400.

        `field_names` maps SamplingParams' names to the endpoint's (chat's prompt is `messages`)."""
        info = self.info
        try:
            params.check_for_model(prompt_ids, info.vocab_size, info.max_seq_len)
        except InvalidRequest as exc:
            raise invalid_request_error(exc, field_names) from None

    async def grammar_compiler(self) -> GrammarCompiler:
        """The model's GrammarCompiler, built on first use (its tokenizer table takes seconds for a 200k
        vocabulary, so it is built in a thread and only when a structured request comes)."""
        async with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = await asyncio.to_thread(
                    GrammarCompiler,
                    self.tokenizer,
                    self.info.vocab_size,
                    harmony=self.is_harmony,
                    compile_timeout_s=self.config.grammar_compile_timeout_s,
                    max_json_whitespace=self.config.grammar_max_json_whitespace,
                )
            return self._grammar_compiler

    async def check_structured_outputs(self, params: SamplingParams, field_names: dict[str, str] | None = None) -> None:
        """Compile the request's grammar now (cached), so that an invalid schema, regex or grammar, an unsupported
        keyword or a compile over the time limit is a 400 naming the problem before the engine sees it (the engine
        compiles it again off its step loop and enforces it)."""
        spec = params.structured_outputs
        if spec is None:
            return
        if spec.disable_any_whitespace is None:  # the request left it to the server (--structured-outputs-config)
            whitespace = self.config.structured_outputs_config.disable_any_whitespace
            spec = params.structured_outputs = msgspec.structs.replace(spec, disable_any_whitespace=whitespace)
        compiler = await self.grammar_compiler()
        try:
            future = compiler.submit(spec)
            # shield: a timeout here must not cancel the shared (cached) compile
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), compiler.compile_timeout_s)
        except InvalidRequest as exc:
            raise invalid_request_error(exc, field_names) from None
        except GrammarCompileError as exc:
            raise invalid_request_error(exc.naming(spec.param), field_names) from None
        except TimeoutError:
            raise invalid_request_error(compiler.timeout_error(spec), field_names) from None

    # ---- tokenization: small inputs on the event loop, large ones on a worker thread --------------------
    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token stands for, so a text of C characters is at least C / this many
        tokens; None when the tokenizer normalizes text first (a normalizer may shrink it, so no bound holds)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        # Byte-level vocabularies spell a byte a character; others spell characters (a byte fallback "<0xE4>"
        # counts six where it is one byte of text): either way no token covers more characters of text.
        return max(len(token) for token in backend.get_vocab(with_added_tokens=True))

    def check_text_fits(self, num_chars: int, param: str) -> None:
        """Refuse (400) a text that is more tokens than the context holds, from its length alone, before the
        tokenizer spends time on it."""
        per_token = self.max_token_chars
        max_seq_len = self.info.max_seq_len
        if per_token and num_chars > per_token * max_seq_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_seq_len} tokens, and {param} is {num_chars} "
                f"characters: at least {-(-num_chars // per_token)} tokens.",
                param=param,
                code="context_length_exceeded",
            )

    async def encode(
        self, text: str, param: str, add_special_tokens: bool = True, may_truncate: bool = False
    ) -> list[int]:
        """Token ids of a prompt text; a large one is tokenized on a worker thread (the tokenizer's batch call
        releases the GIL), so the event loop keeps serving meanwhile. Unless the caller `may_truncate` the ids, a text
        longer than the context can hold is a 400 first."""
        if not may_truncate:
            self.check_text_fits(len(text), param)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            encode = functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
            return await asyncio.to_thread(encode) if len(text) >= OFF_LOOP_CHARS else encode()
        if len(text) < OFF_LOOP_CHARS:  # straight to the Rust tokenizer: the Python wrapper costs twice as much
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        batch = functools.partial(backend.encode_batch, [text], add_special_tokens=add_special_tokens)
        return (await asyncio.to_thread(batch))[0].ids

    def tokens_as_token_ids(self, requested: bool | None) -> bool:
        """Whether logprobs name tokens `token_id:N`: the request's return_tokens_as_token_ids, else the server's."""
        return self.server.return_tokens_as_token_ids if requested is None else requested

    @staticmethod
    def completion_id(prefix: str, raw: Request, requested: str | None) -> str:
        """A completion's id as vLLM names it: the prefix and the X-Request-Id header, else the request's
        request_id, else a fresh one (the engine names its request itself, so ids need not be unique)."""
        return prefix + (raw.headers.get("x-request-id") or requested or uuid.uuid4().hex)

    def reasoning_effort(self, requested: str | None, param: str) -> str | None:
        """A request's reasoning effort after --reasoning-effort-map; on a harmony model, one gpt-oss has."""
        if requested is None:
            return None
        effort = (self.server.reasoning_effort_map or {}).get(requested, requested)
        if self.is_harmony and effort not in REASONING_EFFORTS:
            raise APIError(
                400,
                f"reasoning effort {effort!r} is not one this model has ({', '.join(REASONING_EFFORTS)}); the "
                "server's --reasoning-effort-map can rewrite it",
                param=param,
            )
        return effort

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        reasoning_effort: str | None,
        template_kwargs: dict[str, Any],
        add_generation_prompt: bool = True,
        param: str = "messages",
        may_truncate: bool = False,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Prompt ids of a conversation (on a worker thread when its text is large). A conversation that cannot
        fit the context is a 400 before it is rendered, unless the caller `may_truncate` it to fit."""
        num_chars = sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
        if not may_truncate:
            self.check_text_fits(num_chars, param)
        render = functools.partial(
            render_chat,
            self.tokenizer,
            messages,
            harmony=self.is_harmony,
            tools=tools,
            reasoning_effort=reasoning_effort,
            template_kwargs={**(self.server.default_chat_template_kwargs or {}), **template_kwargs},
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        try:
            return await asyncio.to_thread(render) if num_chars >= OFF_LOOP_CHARS else render()
        except Exception as exc:  # the template's own errors (jinja, TypeError) are the request's fault
            raise APIError(400, f"Cannot render the messages: {exc}", param=param) from None

    def timeout_for(self, requested: float | None) -> float | None:
        """The request's own `timeout`, capped by the server's --request-timeout."""
        limits = [t for t in (requested, self.request_timeout) if t is not None]
        return min(limits) if limits else None

    def logged_prompt(self, prompt: str | None, prompt_ids: list[int]) -> str:
        """A prompt (or an output) as --log-prompts logs it: its text (else its token ids), cut to --max-log-len."""
        limit = self.server.max_log_len
        shown: str | list[int] = prompt if prompt is not None else prompt_ids
        return repr(shown if limit is None else shown[:limit])

    def log_outputs(self, rid: str, output: RequestOutput) -> None:
        """--enable-log-outputs: each completion's text (a harmony one's tokens decoded, headers included)."""
        for completion in output.outputs:
            text = completion.text or self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
            logger.info(
                "request %s output %d: %s (%d tokens, finish %s)",
                rid,
                completion.index,
                self.logged_prompt(text, completion.token_ids),
                len(completion.token_ids),
                completion.finish_reason,
            )

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        timeout: float | None = None,
        detokenize: bool = True,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[CompletionDelta, None]:
        """Engine deltas for one prompt, with metrics; raises APIError for engine-side failures. `detokenize`
        False: the deltas carry token ids only (a harmony parser decodes them itself).

        A completion that ends with finish_reason "error" (the model produced non-finite logits) fails
        the request: a 500, or an in-band error event once a stream has started.
        """
        rid = uuid.uuid4().hex
        if self.log_prompts:
            logger.info(
                "request %s prompt: %s (%d tokens)", rid, self.logged_prompt(prompt, prompt_ids), len(prompt_ids)
            )
        timing = RequestTiming(rid, len(prompt_ids), params.max_tokens, params.n)
        last = None
        try:
            async for delta in self.client.generate(
                rid, prompt_ids, params, prompt, self.timeout_for(timeout), detokenize, cache_salt
            ):
                if delta.finish_reason == "error":
                    raise APIError(500, "The model produced non-finite logits for this request.", code="model_error")
                timing.on_delta(delta)
                last = delta
                yield delta
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        except InvalidRequest as exc:  # refused by the engine core
            raise APIError(400, str(exc)) from None
        finally:
            timing.finish(last)
            self.metrics.observe_request(timing)
            if self.server.log_outputs and last is not None:
                self.log_outputs(rid, last.output)


def _text_chars(content: Any) -> int:
    """Characters of a message's content: a string, or the text of its parts (the rest renders to no text)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def invalid_request_error(exc: InvalidRequest, field_names: dict[str, str] | None = None) -> APIError:
    param = (field_names or {}).get(exc.param, exc.param)
    message = exc.message
    if param != exc.param and exc.param != "prompt":  # say the field as the client named it
        message = re.sub(rf"\b{re.escape(exc.param)}\b", param, message)  # the word, not within max_logprobs
    return APIError(400, message, param=param, code=exc.code)


async def server_state(request: Request) -> ServerState:
    """The app's ServerState (a FastAPI dependency of every router; async, so FastAPI does not run it in a
    worker thread)."""
    return request.app.state.brisk


def system_fingerprint(config: EngineConfig, server: ServerConfig) -> str | None:
    """vLLM's system_fingerprint, brisk's name in it: `brisk-<version>[-tp<n>][-pp<n>][-dp<n>][-ep]-<hash8>`, the hash
    of every engine option (what can change a sampled token: model, dtype, KV dtype, kernels, speculation...) but
    the hub token and download directory. The same options give the same fingerprint on every start."""
    mode = server.fingerprint_mode
    if mode == "none":
        return None
    if mode == "custom":
        return server.fingerprint_value
    options = config.model_dump_json(exclude={"hf_token", "download_dir"})
    parts = [f"brisk-{brisk.__version__}"]
    if mode == "full":
        layout = (("tp", config.tp_size), ("pp", config.pp_size), ("dp", config.data_parallel_size))
        parts += [f"{name}{size}" for name, size in layout if size > 1]
        parts += ["ep"] if config.enable_expert_parallel or config.ep_size > 1 else []
    return "-".join([*parts, hashlib.sha256(options.encode()).hexdigest()[:8]])
