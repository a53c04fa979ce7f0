"""From a StructuredOutputs spec to an xgrammar structural tag, for harmony models and for the rest.

Harmony (gpt-oss): the grammar is the assistant's whole turn, from after the prompt's `<|start|>assistant`: a
sequence of messages, each a channel header, `<|message|>`, a body and a terminator, where only the structure and
the answer are constrained and reasoning stays free text:

    (<|channel|>analysis<|message|>TEXT<|end|><|start|>assistant)*      reasoning, any number
    (<|channel|>commentary<|message|>TEXT<|end|><|start|>assistant)*    preambles, when no answer is constrained
    then one of
    <|channel|>final<|message|>ANSWER<|return|>                         the answer (TEXT if none is constrained)
    <|channel|>commentary to=functions.NAME CT<|message|>ARGS<|call|>   a call to a tool the request offers
     to=functions.NAME<|channel|>commentary CT<|message|>ARGS<|call|>   the same, recipient before the channel

CT is ` <|constrain|>json`, `<|constrain|>json` or ` json`; ARGS is the strict tool's parameters schema, or TEXT
for a tool that is not strict. TEXT is any text without special tokens: the GrammarCompiler's tokenizer table
makes every special token unmatchable as text, so harmony's structural tokens appear only where the grammar
names them (`TokenFormat`, by id). The only ways to finish are an answer that satisfies the constraint followed
by `<|return|>`, or a call followed by `<|call|>` (the matcher terminates there, without a further stop token);
a request whose `max_tokens` runs out first ends with finish_reason "length".

Known limits, by choice: preambles are routed to `content` by the harmony parser, so with a constrained answer
they are not allowed (content holds only the answer); built-in tools (browser, python), which brisk does not
offer, are not allowed; every special token, reserved ones included, is kept out of the text, reasoning
included; a channel name or recipient may still be spelled with ordinary tokens in any split ("fin" + "al"), as
the parser decodes header text; CT takes the three spellings gpt-oss and its chat template use.

A forced tool call (`from_start`: the prompt ends with the call's header) is only its arguments then `<|call|>`.
Other models: the whole output is the answer, ended by the model's stop token.

JSON (schemas, json_object, strict tools' arguments) is compact by default: separators `,` and `:` and no
whitespace outside strings, as OpenAI's structured outputs look, so that a model cannot spend its tokens on
whitespace; a spec with disable_any_whitespace false (vLLM's switch) allows bounded whitespace between tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    ConstStringFormat,
    GrammarFormat,
    JSONSchemaFormat,
    OrFormat,
    RegexFormat,
    SequenceFormat,
    StarFormat,
    StructuralTag,
    TokenFormat,
)

from brisk.errors import InvalidRequest
from brisk.harmony.parser import HarmonySpecialTokens
from brisk.structured.spec import StructuredOutputs

# JSON-schema keywords xgrammar 0.2 accepts but does not enforce (checked: an instance violating them is
# accepted). Refused with a 400 naming the keyword rather than silently loosening the schema.
UNENFORCED_KEYWORDS = {
    "uniqueItems": "xgrammar cannot enforce unique array items",
    "not": "xgrammar cannot enforce negated schemas",
    "if": "xgrammar cannot enforce conditional (if/then/else) schemas",
    "then": "xgrammar cannot enforce conditional (if/then/else) schemas",
    "else": "xgrammar cannot enforce conditional (if/then/else) schemas",
}
# keywords whose values are schemas / maps of schemas / lists of schemas: walked for nested keywords
_SUBSCHEMA = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def load_schema(schema: dict[str, Any] | str, param: str) -> dict[str, Any]:
    """The schema as a dict; a JSON text that does not parse to an object is a 400."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise InvalidRequest(param, f"the JSON schema is not valid JSON: {error}.") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(param, "a JSON schema must be an object.")
    return schema


def check_keywords(schema: Any, param: str, path: str = "#") -> None:
    """Raise InvalidRequest naming the first keyword the grammar engine would silently ignore."""
    if not isinstance(schema, dict):
        return
    for keyword, why in UNENFORCED_KEYWORDS.items():
        if keyword in schema:
            raise InvalidRequest(param, f"JSON schema keyword {keyword!r} at {path} is not supported: {why}.")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise InvalidRequest(
            param, f"JSON schema keyword 'allOf' at {path} with more than one schema is not supported."
        )
    for key in _SUBSCHEMA:
        check_keywords(schema.get(key), param, f"{path}/{key}")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_keywords(sub, param, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for index, sub in enumerate(schema[key]):
                check_keywords(sub, param, f"{path}/{key}/{index}")
    if isinstance(schema.get("items"), list):  # draft-4 tuple form
        for index, sub in enumerate(schema["items"]):
            check_keywords(sub, param, f"{path}/items/{index}")


# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "; the rest is the message users need
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


def compiler_message(error: BaseException) -> str:
    """xgrammar's error text without the C++ source location."""
    return _CPP_PREFIX.sub("", str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)


def _json_format(schema: dict[str, Any] | str, param: str, max_whitespace: int | None, compact: bool) -> Any:
    """JSON of the schema: compact (separators `,` and `:`, no whitespace outside strings, as OpenAI's structured
    outputs look; xgrammar's structural tag has no such JSON format, so the schema's grammar is spelled out), or
    with up to `max_whitespace` whitespace characters between tokens (None: unbounded)."""
    loaded = load_schema(schema, param)
    check_keywords(loaded, param)
    if not compact:
        return JSONSchemaFormat(json_schema=loaded, max_whitespace_cnt=max_whitespace)
    try:  # strict_mode: no properties or items beyond the schema's, as JSONSchemaFormat
        grammar = xgr.Grammar.from_json_schema(loaded, any_whitespace=False, separators=(",", ":"), strict_mode=True)
    except Exception as error:  # xgrammar raises RuntimeError/ValueError/its own types with the reason
        raise InvalidRequest(param, f"invalid {param}: {compiler_message(error)}") from None
    # xgrammar 0.2 spells the comma of its generic arrays and objects (basic_array_items, basic_object_properties: the
    # parts of a schema that say nothing of their items or properties) with its default ", " whatever the
    # separators; the test of json_object proves this is the one place a space was left.
    return GrammarFormat(grammar=str(grammar).replace('((", " basic_', '(("," basic_'))


def answer_format(spec: StructuredOutputs, max_whitespace: int | None = None) -> Any:
    """The xgrammar format of the answer constraint, or None when only tools are constrained.
    max_whitespace: the longest whitespace run JSON may hold (None: unbounded), where whitespace is allowed."""
    compact = spec.disable_any_whitespace is not False
    if spec.json is not None:
        return _json_format(spec.json, spec.param, max_whitespace, compact)
    if spec.json_object:
        return _json_format({"type": "object"}, spec.param, max_whitespace, compact)
    if spec.regex is not None:
        return RegexFormat(pattern=spec.regex)
    if spec.choice is not None:
        if len(spec.choice) == 1:
            return ConstStringFormat(value=spec.choice[0])
        return OrFormat(elements=[ConstStringFormat(value=choice) for choice in spec.choice])
    if spec.grammar is not None:
        return GrammarFormat(grammar=spec.grammar)
    return None


_TOOL_NAME = re.compile(r"[A-Za-z0-9_\-.]+")


def _tool_names(spec: StructuredOutputs) -> None:
    for name in [tool.name for tool in spec.tools] + list(spec.free_tools):
        if not _TOOL_NAME.fullmatch(name):
            raise InvalidRequest("tools", f"tool name {name!r} must be letters, digits, '_', '-', '.'.")


def _seq(*elements: Any) -> SequenceFormat:
    return SequenceFormat(elements=list(elements))


def _or(*elements: Any) -> OrFormat:
    return OrFormat(elements=list(elements))


def _text(value: str) -> ConstStringFormat:
    return ConstStringFormat(value=value)


def harmony_format(spec: StructuredOutputs, ids: HarmonySpecialTokens, max_whitespace: int | None) -> Any:
    """The assistant's turn as a sequence of harmony messages (see the module docstring)."""
    _tool_names(spec)

    def token(token_id: int) -> TokenFormat:
        return TokenFormat(token=token_id)

    free = AnyTextFormat()  # special tokens are no text (see GrammarCompiler): harmony's cannot appear in it
    answer = answer_format(spec, max_whitespace)
    next_message = (token(ids.end), token(ids.start), _text("assistant"))
    continuing = [_seq(token(ids.channel), _text("analysis"), token(ids.message), free, *next_message)]
    if answer is None:  # the final answer is free text; a preamble cannot spoil it
        continuing.append(_seq(token(ids.channel), _text("commentary"), token(ids.message), free, *next_message))
    final = _seq(
        token(ids.channel), _text("final"), token(ids.message), free if answer is None else answer, token(ids.return_)
    )
    content_type = _or(
        _seq(_text(" "), token(ids.constrain), _text("json")), _seq(token(ids.constrain), _text("json")), _text(" json")
    )
    calls: list[SequenceFormat] = []
    compact = spec.disable_any_whitespace is not False
    tools = [(tool.name, _json_format(tool.parameters, "tools", max_whitespace, compact)) for tool in spec.tools]
    for name, arguments in tools + [(name, free) for name in spec.free_tools]:
        body = (content_type, token(ids.message), arguments, token(ids.call))
        # the two header orders harmony allows: the recipient after the channel, or in the role part before it
        calls.append(_seq(token(ids.channel), _text(f"commentary to=functions.{name}"), *body))
        calls.append(_seq(_text(f" to=functions.{name}"), token(ids.channel), _text("commentary"), *body))
    return _seq(StarFormat(content=_or(*continuing)), _or(final, *calls) if calls else final)


def structural_tag(
    spec: StructuredOutputs, harmony: HarmonySpecialTokens | None, max_whitespace: int | None = None
) -> StructuralTag:
    """The grammar for `spec` on a harmony model (`harmony`: its structural token ids; the assistant's whole turn)
    or any other model (the whole output is the answer)."""
    answer = answer_format(spec, max_whitespace)
    if spec.from_start:  # a forced tool call's arguments: the prompt ends with the call's header
        return StructuralTag(format=answer if harmony is None else _seq(answer, TokenFormat(token=harmony.call)))
    if harmony is None:
        if spec.tools:
            raise InvalidRequest(
                "tools", "strict function tools are enforced on harmony models (gpt-oss) only; omit strict."
            )
        if spec.free_tools:
            raise InvalidRequest("tools", "function tools are supported on harmony models (gpt-oss) only.")
        return StructuralTag(format=answer)
    return StructuralTag(format=harmony_format(spec, harmony, max_whitespace))
