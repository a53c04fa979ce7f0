"""What a request asks its output to look like: one constraint kind, or strict tools, or both.

A plain msgspec struct so that it crosses the engine's process boundary inside SamplingParams and hashes to a
stable cache key. Checking the shape (one kind at a time) happens here; checking the content (does the schema,
regex or grammar compile) is the GrammarCompiler's job, because only the compiler knows.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from brisk.errors import InvalidRequest


class StrictTool(msgspec.Struct, frozen=True):
    """A function tool whose call arguments must validate against `parameters` (OpenAI `strict: true`)."""

    name: str
    parameters: dict[str, Any]


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """At most one of json / json_object / regex / choice / grammar constrains the answer; `tools` constrain
    function-call arguments. On a harmony model (gpt-oss) the answer is the final channel's text and reasoning
    stays free; on other models the whole output is the answer.

    json: a JSON schema (dict, or its JSON text). json_object: any JSON object. regex: a regular expression
    the whole answer matches. choice: the answer is exactly one of these strings. grammar: an EBNF grammar as
    xgrammar reads it (GBNF-style `root ::= ...`)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    tools: tuple[StrictTool, ...] = ()
    # Harmony: the names of the other function tools the request offers (not strict). The grammar is the whole
    # assistant turn, so a call is allowed only to a tool named here or in `tools`; these calls' arguments are free.
    free_tools: tuple[str, ...] = ()
    # The answer starts at the first generated token even on a harmony model: a forced tool call (tool_choice
    # required or named) whose header `... to=functions.NAME <|constrain|>json<|message|>` ends the prompt.
    from_start: bool = False
    # JSON whitespace (vLLM's name): true (or None, the default where no server setting resolved it) gives compact
    # JSON (fixed separators `,` `:`, no whitespace outside strings); false allows whitespace between JSON tokens,
    # up to the compiler's max_json_whitespace a run.
    disable_any_whitespace: bool | None = None
    param: str = "structured_outputs"  # the request field it came from, named in errors

    def __post_init__(self) -> None:
        kinds = self.answer_kinds()
        if len(kinds) > 1:
            raise InvalidRequest(self.param, f"give one structured output kind, not {' and '.join(kinds)}.")
        if not kinds and not self.tools:
            raise InvalidRequest(
                self.param, "structured outputs need one of json, json_object, regex, choice, grammar."
            )
        if self.from_start and (self.tools or self.free_tools or not kinds):
            raise InvalidRequest(self.param, "from_start constrains an answer kind, without strict tools.")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequest(self.param, "choice must be a non-empty list of strings.")

    def answer_kinds(self) -> list[str]:
        """The names of the answer constraints given (valid specs have at most one)."""
        given = {
            "json": self.json is not None,
            "json_object": self.json_object,
            "regex": self.regex is not None,
            "choice": self.choice is not None,
            "grammar": self.grammar is not None,
        }
        return [name for name, present in given.items() if present]

    def key(self) -> str:
        """A stable hash of what constrains the output (`param` excluded: it only names errors)."""
        body = msgspec.structs.replace(self, param="")
        return hashlib.sha256(msgspec.json.encode(body, order="sorted")).hexdigest()
