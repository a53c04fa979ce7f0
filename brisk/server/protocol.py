"""OpenAI request schemas (pydantic). Unknown fields are rejected (400), never silently ignored.

Hostile input is stopped here, before any work: JSON NaN/Infinity literals are refused, integers are
bounded so they always fit the engine's int64 messages, stop strings are bounded in number and length,
and every request body is bounded in nesting depth and may not hold lone UTF-16 surrogates (which
cannot be encoded back to UTF-8 by the tokenizer or in a response).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from brisk.errors import InvalidRequest
from brisk.sampling_params import MAX_LOGPROB_TOKEN_IDS, SamplingParams
from brisk.structured.spec import StrictTool, StructuredOutputs

MAX_INT32 = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_TOKEN_ID_LIST = 1024  # stop_token_ids and logit_bias entries
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # allowed_token_ids: a whole vocabulary (gpt-oss: 201,088)
MAX_TOOLS = 128
MAX_NAME_CHARS = 256  # model and function names (they are echoed in error messages)
MAX_JSON_DEPTH = 64  # of a whole request body, so a tool schema may nest about 60 levels
# The OpenAI API's efforts (and vLLM's "max"); --reasoning-effort-map rewrites them, gpt-oss has low, medium, high.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
_SURROGATE = re.compile("[\ud800-\udfff]")

TokenId = Annotated[int, Field(ge=-MAX_INT32, le=MAX_INT32)]  # range-checked against the vocabulary later
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise ValueError if a parsed JSON value nests deeper than max_depth or holds a lone surrogate.

    Iterative, so a hostile body cannot exhaust the Python stack here; scalars are checked in place
    rather than pushed, since a body can hold a million-token prompt.
    """
    stack: list[tuple[Any, int]] = [([value], 0)]
    while stack:
        container, depth = stack.pop()
        if depth > max_depth:
            raise ValueError(f"the request nests deeper than {max_depth} levels")
        for child in list(container) + list(container.values()) if isinstance(container, dict) else container:
            if isinstance(child, str):
                if _SURROGATE.search(child):
                    raise ValueError("strings must be valid Unicode (a lone UTF-16 surrogate was found)")
            elif isinstance(child, (dict, list)):
                stack.append((child, depth + 1))


def lower_case(value: Any) -> Any:
    """A choice in any case: trtllm-serve takes openai_harmony's efforts ("Low", "High") too."""
    return value.lower() if isinstance(value, str) else value


def refused(reason: str) -> AfterValidator:
    """For a field of the OpenAI API that brisk cannot honour (`Annotated[Any, refused(why)]`): null is accepted,
    any other value is a 400 naming the field (ignoring it would change the result)."""

    def check(value: Any) -> Any:
        if value is not None:
            raise PydanticCustomError("unsupported_field", reason)
        return value

    return AfterValidator(check)


def only(accepted: tuple[Any, ...], reason: str) -> AfterValidator:
    """For a vLLM extension brisk honours in one of its values only (`accepted`: what brisk does anyway): null and
    those are accepted, any other value is a 400 naming the field, with `reason`."""

    def check(value: Any) -> Any:
        if value is not None and value not in accepted:
            raise PydanticCustomError("unsupported_field", reason)
        return value

    return AfterValidator(check)


# An OpenAI field with no effect on a self-hosted server (docs/api.md says why for each); accepted, bounded
# only by the body's own limits (size, depth).
NoEffect = Any
Metadata = Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Body(_Request):
    """A whole request body: checked for depth and surrogates before field validation recurses into it."""

    @model_validator(mode="before")
    @classmethod
    def _bounded_json(cls, data: Any) -> Any:
        check_json_value(data)
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: NoEffect = None
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class _GenerationFields(_Body):
    """The sampling fields every generation endpoint takes (the Responses API's set), with one builder."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    # OpenAI fields with no effect here (docs/api.md)
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    safety_identifier: str | None = Field(None, max_length=MAX_NAME_CHARS)
    service_tier: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    prompt_cache_options: NoEffect = None
    prompt_cache_retention: Literal["in_memory", "24h", "in-memory"] | None = None
    moderation: NoEffect = None
    # extensions (vLLM / TensorRT-LLM names)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    ignore_eos: bool = False
    priority: int | None = Field(None, ge=-MAX_INT32, le=MAX_INT32)  # None: 0
    timeout: float | None = Field(None, gt=0.0, description="seconds; the request is aborted when it runs longer")
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's extensions brisk cannot honour (docs/api.md): each refused with its reason, never as unknown
    # vLLM's: names the completion (its id is `chatcmpl-` / `cmpl-` and this); an X-Request-Id header comes first
    request_id: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    session_id: Annotated[Any, refused("brisk has no sessions; previous_response_id chains Responses.")] = None
    # vLLM's: prefix-cache blocks shared only among requests with the same salt (tenants isolated)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    kv_transfer_params: Annotated[Any, refused("brisk has no KV transfer between instances (disaggregation).")] = None
    ec_transfer_params: Annotated[Any, refused("brisk has no transfer between instances (disaggregation).")] = None
    vllm_xargs: Annotated[Any, refused("brisk takes no plugin arguments: it loads no plugins.")] = None
    watermarking: Annotated[Any, refused("brisk does not watermark its outputs.")] = None
    # vLLM's default "tensors"; it reads the field on its render routes only ("ignored on generation endpoints")
    mm_payload: Annotated[Any, only(("tensors", "none"), TEXT_ONLY)] = None
    return_mm_kwargs: Annotated[Any, refused(TEXT_ONLY)] = None
    media_io_kwargs: Annotated[Any, refused(TEXT_ONLY)] = None
    mm_processor_kwargs: Annotated[Any, refused(TEXT_ONLY)] = None
    thinking_token_budget: Annotated[
        Any, refused("a reasoning token budget is not available; reasoning_effort sets gpt-oss's reasoning depth.")
    ] = None

    def field_names(self) -> dict[str, str]:
        """This endpoint's names of SamplingParams fields where they differ, so errors name the client's field."""
        return {}

    def _vllm_structured_outputs(self) -> StructuredOutputs | None:
        return self.structured_outputs.spec() if self.structured_outputs is not None else None

    def _answer(self, answer: StructuredOutputs | None) -> StructuredOutputs | None:
        """The answer constraint: the OpenAI field's (`answer`, with structured_outputs' options applied), or
        vLLM's structured_outputs."""
        vllm = self.structured_outputs
        if answer is not None and vllm is not None:
            if not vllm.options_only():
                raise InvalidRequest("structured_outputs", "give response_format or structured_outputs, not both.")
            # vLLM's way to set structured_outputs' options for a response_format
            answer = msgspec.structs.replace(answer, disable_any_whitespace=vllm.disable_any_whitespace)
        return answer or self._vllm_structured_outputs()

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any], **extra: Any
    ) -> SamplingParams:
        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        for name in ("presence_penalty", "frequency_penalty"):
            if extra.get(name) is None:
                extra[name] = defaults.get(name, 0.0)
        cap = defaults.get("max_tokens")  # vLLM's: a generation config's max_new_tokens is a default and a cap
        if cap is not None:
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)
        return SamplingParams(
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            priority=self.priority or 0,
            **extra,
        )


TEXT_ONLY = "brisk serves text-only models: there is no multimodal input or output."
NO_STRUCTURAL_TAGS = (
    "brisk has no structural tags: strict function tools constrain tool calls' arguments, response_format the answer."
)
GUIDED_WHITESPACE = (
    "guided_whitespace_pattern is a setting of vLLM's outlines backend; brisk's JSON whitespace is set by "
    "structured_outputs: {disable_any_whitespace: false}."
)


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` (StructuredOutputsParams): exactly one of these constrains the output, or,
    beside response_format, none (only its options); disable_any_whitespace: false allows whitespace in JSON."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    def spec(self) -> StructuredOutputs:
        return StructuredOutputs(
            json=self.json_,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            disable_any_whitespace=self.disable_any_whitespace,
            param="structured_outputs",
        )

    def options_only(self) -> bool:
        return (self.json_, self.regex, self.choice, self.grammar, self.json_object) == (None,) * 5


def combine_structured(
    answer: StructuredOutputs | None, tools: list[tuple[str, dict[str, Any] | None, bool | None]]
) -> StructuredOutputs | None:
    """One spec from the answer constraint (response_format / text.format / structured_outputs) and the request's
    (name, parameters, strict) function tools: strict ones have their arguments constrained, the others may still
    be called (a harmony grammar is the whole turn); None when neither an answer nor a strict tool is constrained."""
    strict = tuple(
        StrictTool(name, parameters if parameters is not None else {"type": "object"})
        for name, parameters, is_strict in tools
        if is_strict
    )
    free = tuple(name for name, _, is_strict in tools if not is_strict)
    if answer is None:
        return StructuredOutputs(tools=strict, free_tools=free, param="tools") if strict else None
    return StructuredOutputs(
        json=answer.json,
        json_object=answer.json_object,
        regex=answer.regex,
        choice=answer.choice,
        grammar=answer.grammar,
        tools=strict,
        free_tools=free,
        disable_any_whitespace=answer.disable_any_whitespace,
        param=answer.param,
    )


LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None, Field(max_length=MAX_TOKEN_ID_LIST)
]


def token_bias(logit_bias: dict[str, float] | None) -> dict[int, float]:
    try:
        return {int(k): v for k, v in (logit_bias or {}).items()}
    except ValueError:
        raise InvalidRequest("logit_bias", "logit_bias keys must be token ids.") from None


class _SamplingFields(_GenerationFields):
    """Chat completions' and completions' further sampling fields: OpenAI's plus vLLM's extensions."""

    n: int = Field(1, ge=1, le=128)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # None: the server's default (0.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: LogitBias = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None  # OpenAI's on chat completions; vLLM's extension on completions
    # extensions
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKEN_ID_LIST)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = True  # None (vLLM's unset): true
    bad_words: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM: top logprobs of each prompt token
    best_of: int | None = Field(None, ge=1, le=128)  # OpenAI's on completions, vLLM's on chat (<= 0.11): n only
    # vLLM <= 0.11's structured outputs, one field a kind (structured_outputs' keys since): one kind per request
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(None, min_length=1)
    guided_decoding_backend: Annotated[
        Any, only(("auto", "xgrammar"), "brisk's structured outputs run on xgrammar.")
    ] = None
    guided_whitespace_pattern: Annotated[Any, refused(GUIDED_WHITESPACE)] = None
    structural_tag: Annotated[Any, refused(NO_STRUCTURAL_TAGS)] = None
    logits_processors: Annotated[Any, refused("brisk runs no logits processors named in a request.")] = None
    # vLLM's extensions brisk cannot honour (docs/api.md): each refused with its reason, never as unknown
    use_beam_search: Annotated[Any, only((False,), "brisk has no beam search.")] = None
    length_penalty: Annotated[Any, only((1, 1.0), "length_penalty scores beams: brisk has no beam search.")] = None
    spaces_between_special_tokens: Annotated[
        Any,
        only((True,), "brisk writes special tokens (skip_special_tokens: false) as the tokenizer decodes them (true)."),
    ] = None
    # vLLM's: keep the prompt's last N tokens (truncation_side "right": its first N); -1: the context length
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT32)
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    # vLLM's: these ids' logprobs at each output position (after the sampled token's), not the likeliest tokens'
    logprob_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_LOGPROB_TOKEN_IDS)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens `token_id:N` (None: the server's)
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the output's token ids beside the text
    return_token_offsets: Annotated[Any, only((False,), "brisk's responses carry no token offsets.")] = None
    return_weight_versions: Annotated[
        Any, only((False,), "brisk serves one set of weights for its life: there are no weight versions to report.")
    ] = None
    routed_experts_prompt_start: Annotated[Any, only((0,), "brisk does not report the experts tokens route to.")] = None
    repetition_detection: Annotated[
        Any, refused("repetition_detection is not available; repetition_penalty discourages repeats.")
    ] = None
    stream_interval: Annotated[
        Any, refused("the streaming interval is the server's --stream-interval, not a request's.")
    ] = None
    # TensorRT-LLM's extensions (trtllm-serve's request fields) brisk honours in one value, or not at all
    early_stopping: Annotated[Any, only((False,), "early_stopping ends beam search: brisk has no beam search.")] = None
    top_p_min: Annotated[
        Any, only((0,), "top-p decay is not available (top_p_min is its floor); top_p sets the nucleus.")
    ] = None
    # trtllm's: presence and frequency penalties skip the prompt's first N tokens (0: they count the whole prompt)
    prompt_ignore_length: int | None = Field(None, ge=-MAX_INT32, le=MAX_INT32)
    lora_request: Annotated[Any, refused("brisk serves no LoRA adapters.")] = None
    disaggregated_params: Annotated[
        Any, refused("brisk has no disaggregated serving (context and generation instances).")
    ] = None
    conversation_params: Annotated[
        Any,
        refused(
            "brisk routes no conversations: one engine serves every request, and its prefix cache matches each "
            "prompt by its tokens."
        ),
    ] = None

    def truncated(self, prompt_ids: list[int], max_seq_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens and truncation_side (default left: the last tokens kept) cut it."""
        keep = self.truncate_prompt_tokens
        if keep is None or len(prompt_ids) <= (keep := max_seq_len if keep == -1 else keep):
            return prompt_ids
        return prompt_ids[:keep] if self.truncation_side == "right" else prompt_ids[len(prompt_ids) - keep :]

    def _response_format_answer(self) -> StructuredOutputs | None:
        """The answer constraint: response_format's (with structured_outputs' options), or structured_outputs'."""
        return self._answer(self.response_format.spec() if self.response_format is not None else None)

    def _guided(self) -> StructuredOutputs | None:
        """vLLM <= 0.11's guided_* fields as the structured outputs they name."""
        given = {kind: getattr(self, f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")}
        given = {kind: value for kind, value in given.items() if value is not None}
        if not given:
            return None
        if len(given) > 1:
            raise InvalidRequest(
                f"guided_{sorted(given)[1]}",
                "one kind of structured output a request: guided_json, guided_regex, guided_choice or guided_grammar.",
            )
        ((kind, value),) = given.items()
        return StructuredOutputs(**{kind: value}, param=f"guided_{kind}")

    def _answer(self, answer: StructuredOutputs | None) -> StructuredOutputs | None:
        guided = self._guided()
        if guided is not None and (answer is not None or self.structured_outputs is not None):
            raise InvalidRequest(guided.param, "give one of response_format, structured_outputs and guided_*.")
        return guided or super()._answer(answer)

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any], **extra: Any
    ) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of", "best_of other than n is not supported.")
        if self.prompt_ignore_length is not None and (self.presence_penalty or self.frequency_penalty):
            raise InvalidRequest(
                "prompt_ignore_length",
                "brisk's presence and frequency penalties count output tokens only (OpenAI's), as trtllm's do with "
                "prompt_ignore_length at least the prompt's length; it is accepted while both penalties are 0.",
            )
        bias = token_bias(self.logit_bias)
        return super().sampling_params(
            max_tokens,
            logprobs,
            defaults,
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias or None,
            allowed_token_ids=self.allowed_token_ids,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens is not False,
            structured_outputs=extra.pop("structured_outputs", None) or self._vllm_structured_outputs(),
            **{"prompt_logprobs": self.prompt_logprobs, **extra},
        )


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(_Request):
    name: str = Field(max_length=MAX_NAME_CHARS)


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class JSONSchemaSpec(_Request):
    """response_format.json_schema (chat) — Responses' text.format carries the same fields flat."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(_Request):
    """OpenAI's types (text, json_object, json_schema), and trtllm-serve's: json with `schema`, regex, ebnf (EBNF as
    xgrammar reads it), and json_schema given as the bare schema."""

    type: Literal["text", "json_object", "json_schema", "json", "regex", "ebnf", "structural_tag"] = "text"
    json_schema: JSONSchemaSpec | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    regex: str | None = Field(None, min_length=1)
    ebnf: str | None = Field(None, min_length=1)
    format: NoEffect = None  # trtllm's structural tag: refused with its type

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    @field_validator("json_schema", mode="before")
    @classmethod
    def _bare_schema(cls, value: Any) -> Any:
        """trtllm's json_schema: the schema itself, or OpenAI's wrapper without its name."""
        if isinstance(value, dict) and "name" not in value:
            return {"name": "response", "schema": value["schema"] if "schema" in value else value}
        return value

    def spec(self, param: str = "response_format") -> StructuredOutputs | None:
        """The answer constraint, None for plain text. `strict: false` still constrains: brisk has one mode, and
        a schema the output may break is a schema the client does not get."""
        given = {"json_schema": self.json_schema, "schema": self.schema_, "regex": self.regex, "ebnf": self.ebnf}
        given["format"] = self.format
        needs = {"json_schema": "json_schema", "json": "schema", "regex": "regex", "ebnf": "ebnf"}.get(self.type)
        needs = "format" if self.type == "structural_tag" else needs
        stray = [name for name, value in given.items() if value is not None and name != needs]
        if stray:
            raise InvalidRequest(param, f"{stray[0]} does not go with type: {self.type}.")
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputs(json_object=True, param=param)
        if self.type == "structural_tag":
            raise InvalidRequest(param, NO_STRUCTURAL_TAGS)
        if self.type == "json":
            return StructuredOutputs(json=self.schema_ or {"type": "object"}, param=param)
        if self.type == "regex" and self.regex is not None:
            return StructuredOutputs(regex=self.regex, param=param)
        if self.type == "ebnf" and self.ebnf is not None:
            return StructuredOutputs(grammar=self.ebnf, param=param)
        if self.type in ("regex", "ebnf"):
            raise InvalidRequest(param, f"type {self.type} needs {self.type}.")
        if self.json_schema is None:
            raise InvalidRequest(param, "type json_schema needs json_schema: {name, schema}.")
        return StructuredOutputs(json=self.json_schema.schema_ or {"type": "object"}, param=param)


class ThinkingParam(_Request):
    """trtllm's `thinking`: enabled (the model reasons, as gpt-oss always does), and how hard."""

    type: Annotated[
        Literal["enabled", "disabled"],
        only(
            ("enabled",),
            "brisk's models reason as their chat template has them (gpt-oss always does); include_reasoning: false "
            "leaves the reasoning out of the answer.",
        ),
    ] = "enabled"
    keep: Annotated[Any, refused("brisk renders earlier turns' reasoning as the chat template does.")] = None
    effort: Annotated[ReasoningEffort | None, BeforeValidator(lower_case)] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    metadata: Metadata | None = None
    store: bool | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: NoEffect = None
    verbosity: Literal["low", "medium", "high"] | None = None
    audio: Annotated[Any, refused("brisk generates text only; audio output is not available.")] = None
    web_search_options: Annotated[Any, refused("brisk has no web search.")] = None
    functions: Annotated[Any, refused("functions is deprecated and not supported; use tools.")] = None
    function_call: Annotated[Any, refused("function_call is deprecated and not supported; use tool_choice.")] = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # brisk: the reasoning tokens' logprobs, apart from `content`'s (the choice's `reasoning_logprobs`)
    reasoning_logprobs: bool = False
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Annotated[ReasoningEffort | None, BeforeValidator(lower_case)] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM: false leaves reasoning_content out (the model still reasons)
    # TensorRT-LLM's: the reasoning's effort (as reasoning_effort, which it overrides)
    thinking: ThinkingParam | None = None
    agent_hierarchy: Annotated[
        Any, refused("brisk's scheduler orders requests by priority and arrival; it has no agent hierarchy.")
    ] = None
    injected_chat_template_kwargs: Annotated[
        Any, refused("trtllm-serve fills this in itself; chat_template_kwargs passes keys to the chat template.")
    ] = None
    prompt_token_ids: Annotated[
        Any,
        refused("brisk renders the messages with the chat template; /v1/completions takes a prompt as token ids."),
    ] = None
    prompt_token_ids_b64: Annotated[
        Any, refused("brisk has no disaggregated serving; the prompt comes from the messages.")
    ] = None

    @model_validator(mode="after")
    def _thinking_effort(self) -> ChatCompletionRequest:
        if self.thinking is not None and self.thinking.effort is not None:
            self.reasoning_effort = self.thinking.effort
        return self

    add_special_tokens: Annotated[
        Any, only((False,), "the chat template writes the special tokens a chat prompt has; none are added.")
    ] = None
    echo: bool = False  # vLLM's: the answer leads with the last message's content when that is the assistant's
    # vLLM's: the last message is left open and the model continues it (a prefill), instead of a new turn
    continue_final_message: bool = False
    documents: Annotated[Any, refused("chat templates' documents are not available; put them in the messages.")] = None
    chat_template: Annotated[
        Any, refused("brisk renders every request with the server's chat template (--chat-template).")
    ] = None
    return_prompt_text: Annotated[Any, only((False,), "brisk's responses do not repeat the rendered prompt.")] = None
    return_assistant_tokens_mask: Annotated[  # vLLM 0.28's
        Any, only((False,), "brisk does not return a mask of the assistant's tokens in the prompt.")
    ] = None

    @field_validator("messages")
    @classmethod
    def _message_contents(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A message has text content (a string or a list of parts); only an assistant's may be null (a turn of
        tool calls, or of reasoning alone)."""
        for i, message in enumerate(messages):
            content = message.get("content")
            if content is None and message.get("role") != "assistant":
                raise PydanticCustomError(
                    "missing_content",
                    "messages[{i}] ({role}) has no content; it must be a string or a list of content parts.",
                    {"i": i, "role": message.get("role")},
                )
            if content is not None and not isinstance(content, (str, list)):
                raise PydanticCustomError(
                    "content_type", "messages[{i}].content must be a string or a list of content parts.", {"i": i}
                )
        return messages

    @property
    def echoed_text(self) -> str:
        """vLLM's chat echo: the last message's text when it is the assistant's (the answer's role), else none."""
        last = self.messages[-1]
        if not self.echo or last.get("role") != "assistant":
            return ""
        content = last.get("content") or ""
        return content if isinstance(content, str) else "\n".join(str(p.get("text", "")) for p in content)

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        # vLLM's rule: add_generation_prompt given true beside continue_final_message is a 400 (its default gives way)
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in self.model_fields_set
        ):
            raise InvalidRequest(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true: the one continues the last "
                "message, the other starts a new assistant turn.",
            )
        if self.top_logprobs and not self.logprobs:  # 0 (vLLM's default) asks for nothing
            raise InvalidRequest("top_logprobs", "top_logprobs needs logprobs: true.")
        if self.reasoning_logprobs and not self.logprobs:
            raise InvalidRequest("reasoning_logprobs", "reasoning_logprobs needs logprobs: true.")
        if self.reasoning_logprobs and not self.include_reasoning:
            raise InvalidRequest("reasoning_logprobs", "reasoning_logprobs needs include_reasoning: true.")
        if self.logprob_token_ids is not None and not self.logprobs:
            raise InvalidRequest("logprob_token_ids", "logprob_token_ids needs logprobs: true.")
        # vLLM's: chosen ids take precedence over top_logprobs
        logprobs = (self.top_logprobs or 0) if self.logprobs and self.logprob_token_ids is None else None
        answer = self._response_format_answer()
        offered = self.tools if self.tool_choice != "none" else None  # "none": the prompt offers no tools
        tools = [(t.function.name, t.function.parameters, t.function.strict) for t in offered or []]
        return self.sampling_params(
            self.max_completion_tokens or self.max_tokens,
            logprobs,
            defaults,
            structured_outputs=combine_structured(answer, tools),
            logprob_token_ids=self.logprob_token_ids,
        )

    def field_names(self) -> dict[str, str]:
        max_tokens = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return {"prompt": "messages", "max_tokens": max_tokens, "logprobs": "top_logprobs"}


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0, le=MAX_INT32)  # 0: with echo, the prompt alone
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Annotated[Any, refused("suffix (fill-in-the-middle) is not supported by brisk's models.")] = None
    # vLLM's extensions
    add_special_tokens: bool = True  # the tokenizer's BOS (where it has one) leads a text prompt
    prompt_embeds: Annotated[Any, refused("brisk takes prompts as text or token ids, not embeddings.")] = None
    # TensorRT-LLM's
    detokenize: Annotated[
        Any, only((True,), "brisk always returns the text; return_token_ids: true adds the token ids beside it.")
    ] = None
    return_context_logits: Annotated[
        Any, only((False,), "brisk returns no logits; prompt_logprobs gives the prompt tokens' logprobs.")
    ] = None

    @property
    def echoes_logprobs(self) -> bool:
        """echo with logprobs: the prompt tokens' logprobs lead each choice's (lm-eval's loglikelihood)."""
        return self.echo and self.logprobs is not None

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        # max_tokens 0 (with echo) is a prefill-only request: nothing is sampled
        prompt_logprobs = self.prompt_logprobs
        if self.logprob_token_ids is not None:
            if self.logprobs is None:
                raise InvalidRequest("logprob_token_ids", "logprob_token_ids needs logprobs set.")
            if self.echo and self.max_tokens == 0:
                raise InvalidRequest("logprob_token_ids", "with echo and max_tokens 0 no output token has logprobs.")
        if self.echoes_logprobs:
            prompt_logprobs = max(self.logprobs or 0, prompt_logprobs or 0)
        return self.sampling_params(
            self.max_tokens,
            self.logprobs if self.logprob_token_ids is None else None,  # vLLM's: chosen ids take precedence
            defaults,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=self._response_format_answer(),
            logprob_token_ids=self.logprob_token_ids,
        )


class TokenizeRequest(_Body):
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's, as on chat completions


class DetokenizeRequest(_Body):
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tokens: list[TokenId]


class ResponsesFunctionTool(_Request):
    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesReasoning(_Request):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesTextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    def spec(self) -> StructuredOutputs | None:
        param = "text.format"
        if self.type == "json_schema":
            if self.name is None or self.schema_ is None:
                raise InvalidRequest(param, "text.format of type json_schema needs name and schema.")
            return StructuredOutputs(json=self.schema_, param=param)
        if self.name is not None or self.schema_ is not None or self.strict is not None:
            raise InvalidRequest(param, f"name, schema and strict belong to type json_schema, not {self.type}.")
        return StructuredOutputs(json_object=True, param=param) if self.type == "json_object" else None


class ResponsesText(_Request):
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: NoEffect = None


ResponseIncludable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


class ResponsesRequest(_GenerationFields):
    input: str | list[dict[str, Any]]
    # vLLM's: the Response's id (unique in the store: one a stored Response has is a 400); letters, digits, _.:-
    request_id: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[A-Za-z0-9_.:-]+$")
    instructions: str | None = None
    tools: list[ResponsesFunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=0, le=MAX_INT32)
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    reasoning: ResponsesReasoning | None = None
    text: ResponsesText | None = None
    include: list[ResponseIncludable] | None = Field(None, max_length=16)
    store: bool = True
    metadata: Metadata | None = None
    stream_options: ResponsesStreamOptions | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    background: bool | None = None
    background_options: NoEffect = None
    access_programs: NoEffect = None
    image: NoEffect = None
    context_management: Annotated[Any, refused("brisk does not compact conversations; use truncation.")] = None
    conversation: Annotated[Any, refused("the Conversations API is not available; use previous_response_id.")] = None
    prompt: Annotated[Any, refused("stored prompt templates are not available; send the input itself.")] = None
    # vLLM's extensions
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # None: the server's default (0.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: LogitBias = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKEN_ID_LIST)
    chat_template_kwargs: dict[str, Any] | None = None
    stop: Annotated[
        Any, only(([],), "stop strings are not available on /v1/responses; /v1/chat/completions has them.")
    ] = None
    include_stop_str_in_output: Annotated[Any, only((False,), "stop strings are not available on /v1/responses.")] = (
        None
    )
    skip_special_tokens: Annotated[
        Any, only((True,), "a Response's items hold text; special tokens are never written into them.")
    ] = None
    spaces_between_special_tokens: Annotated[
        Any, only((True,), "a Response's items hold text; special tokens are never written into them.")
    ] = None
    include_reasoning: Annotated[
        Any, only((True,), "reasoning items are part of a Response (and of the conversation it continues).")
    ] = None
    enable_response_messages: Annotated[
        Any, only((False,), "a Response's output items are its messages; the raw harmony messages are not returned.")
    ] = None
    previous_input_messages: Annotated[
        Any, refused("continue a conversation with previous_response_id (or send the whole input).")
    ] = None

    def field_names(self) -> dict[str, str]:
        return {"prompt": "input", "max_tokens": "max_output_tokens"}

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        answer = self.text.format.spec() if self.text is not None and self.text.format is not None else None
        # tool_choice "none" or max_tool_calls 0: the prompt offers no tools, so no call is allowed
        offered = self.tools if self.tool_choice != "none" and self.max_tool_calls != 0 else None
        tools = [(t.name, t.parameters, t.strict) for t in offered or []]
        logprobs = (self.top_logprobs or 0) if self.includes_logprobs else None
        return self.sampling_params(
            self.max_output_tokens,
            logprobs,
            defaults,
            structured_outputs=combine_structured(self._answer(answer), tools),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=token_bias(self.logit_bias) or None,
            stop_token_ids=list(self.stop_token_ids or []),
        )

    @property
    def includes_encrypted_reasoning(self) -> bool:
        """`include: ["reasoning.encrypted_content"]`: each reasoning item carries its text as an opaque blob, for
        clients that keep no store (store: false, Codex) and send reasoning items back that way."""
        return "reasoning.encrypted_content" in (self.include or [])

    @property
    def includes_logprobs(self) -> bool:
        """`include: ["message.output_text.logprobs"]`: the output text's tokens with their logprobs (and
        `top_logprobs` alternatives), as OpenAI and vLLM return them."""
        return "message.output_text.logprobs" in (self.include or [])
