"""OpenAI response schemas (pydantic): what the endpoints return and stream, documented in /openapi.json.

Responses and streams are written with `exclude_unset`, so a body carries exactly the fields its builder set
(OpenAI's explicit nulls included) and none it did not; constant fields (`object`, `type`: a single Literal) are
always written.
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel as _PydanticModel
from pydantic import Field


class BaseModel(_PydanticModel):
    def model_post_init(self, context: Any, /) -> None:
        constants = _constant_fields(type(self))
        if constants:
            self.model_fields_set.update(constants)


def _constant_fields(cls: type[_PydanticModel]) -> tuple[str, ...]:
    cached = cls.__dict__.get("_brisk_constants")
    if cached is None:
        cached = tuple(
            name
            for name, f in cls.model_fields.items()
            if get_origin(f.annotation) is Literal and len(get_args(f.annotation)) == 1
        )
        cls._brisk_constants = cached  # type: ignore[attr-defined]
    return cached


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, details: bool = True) -> Usage:
        """`details` False: prompt_tokens_details null (--disable-prompt-tokens-details)."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens) if details else None,
        )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---- chat completions ------------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`, keyed by token id."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    reasoning_logprobs: ChoiceLogprobs | None = None  # with the request's `reasoning_logprobs` (docs/api.md)
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM's extension, with `return_token_ids`: every output token


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None  # --fingerprint-mode
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with `prompt_logprobs` asked
    prompt_token_ids: list[int] | None = None  # vLLM's extension, with `return_token_ids`


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    reasoning_logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with `return_token_ids`: the tokens this chunk carries


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None  # on the stream's last chunk (--fingerprint-mode)
    prompt_token_ids: list[int] | None = None  # with `return_token_ids`: in the stream's first chunk


# ---- completions -----------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with `prompt_logprobs` asked
    # vLLM's extension, with `return_token_ids`: the prompt's (a stream's first chunk of the choice) and the output's
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    """A completion, whole or (object `text_completion` too, as OpenAI streams it) one SSE event."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None  # a whole completion's, a stream's last chunk's (--fingerprint-mode)


class CompletionChunk(Completion):
    """One SSE event of a streamed completion."""


# ---- responses -------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)  # with include message.output_text.logprobs


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseMessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: str
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ResponseReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class ResponseFunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str | None = None
    name: str
    arguments: str
    status: str


ResponseOutputItem = ResponseMessageItem | ResponseReasoningItem | ResponseFunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(BaseModel):
    reason: str


class ResponseObject(BaseModel):
    """A Response (POST /v1/responses), as OpenAI's Responses API returns it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    model: str
    output: list[ResponseOutputItem]
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    instructions: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    error: ErrorDetail | None = None
    incomplete_details: IncompleteDetails | None = None
    usage: ResponseUsage | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    store: bool = True
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    background: bool = False
    user: str | None = None


class InputItemList(BaseModel):
    """GET /v1/responses/{id}/input_items."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class ResponseStreamEvent(BaseModel):
    """One SSE event of a streamed Response: `type` says which (response.created, response.output_text.delta,
    ... response.completed); the other fields are those OpenAI's event of that type carries."""

    model_config = {"extra": "allow"}
    type: str
    sequence_number: int


# ---- admin -----------------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "brisk"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionInfo(BaseModel):
    version: str


class TokenizeResult(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResult(BaseModel):
    prompt: str


STREAM_MODELS = (ChatCompletionChunk, CompletionChunk, ResponseStreamEvent)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)
}


def event_stream_response(model_name: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for an endpoint that streams `model_name` events when `stream` is true."""
    schema = {"$ref": f"#/components/schemas/{model_name}"}
    return {200: {"content": {"text/event-stream": {"schema": schema}}}}
