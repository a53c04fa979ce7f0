"""tool_choice on gpt-oss: which tools the prompt offers, and the forced start of a tool call.

`required` and a named function start the assistant's turn with harmony's commentary header addressed to one
function (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`), so the model can only answer
with a call to it. For `required` with several tools the function is picked by the model itself, one token at a
time, with each step's choice constrained (logit bias) to the tokens that continue some tool's name: a call is
always made, to a tool that exists, and streaming and non-streaming requests pick alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from brisk.sampling_params import SamplingParams
from brisk.server.errors import APIError
from brisk.structured.spec import StructuredOutputs

CALL_HEADER = "<|channel|>commentary to=functions."
CALL_BODY = " <|constrain|>json<|message|>"
FORCE_BIAS = 100.0  # OpenAI's largest logit bias: the constrained tokens win over every other


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]] | None  # what the prompt offers
    forced_name: str | None = None  # a named tool_choice
    required: bool = False  # tool_choice "required": some call must be made
    returns_calls: bool = True  # False: tool_choice "none" with the tools shown, so a call written is dropped

    @property
    def forces_call(self) -> bool:
        return self.forced_name is not None or self.required


def plan_tools(state, tools: list[dict] | None, tool_choice: Any) -> ToolPlan:
    """Validate tool_choice against the tools (400s name the field)."""
    choice: Any = tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs 'tools'.", param="tool_choice")
    if not tools:
        return ToolPlan(None)
    if not state.is_harmony:
        raise APIError(400, "Function tools are supported for gpt-oss (harmony) models only.", param="tools")
    if choice == "none":  # the tools shown only with --no-exclude-tools-when-tool-choice-none (vLLM's default)
        return ToolPlan(None if state.server.exclude_tools_when_tool_choice_none else tools, returns_calls=False)
    if choice == "auto":
        return ToolPlan(tools)
    if choice == "required":
        return ToolPlan(tools, required=True)
    name = choice.function.name  # a NamedToolChoice: the schema allows nothing else
    if name not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"tool_choice names an unknown function '{name}'.", param="tool_choice")
    return ToolPlan(tools, forced_name=name)


def call_prefix(tokenizer, name: str) -> list[int]:
    """The token ids that open a call to `name` (the model writes its JSON arguments next)."""
    return tokenizer.encode(CALL_HEADER + name + CALL_BODY, add_special_tokens=False)


async def forced_call_prefix(
    state, plan: ToolPlan, prompt_ids: list[int], params: SamplingParams, timeout, cache_salt: str | None
) -> list[int]:
    """The forced start of the assistant's turn: none, the named function's call, or for `required` the call to
    the function the model picks among the tools (its probes run under the request's cache_salt, so the prompt's
    blocks they cache stay the salt's).

    A function without parameters has one valid argument object, `{}`: its call is forced whole, the prefix
    ending in `{}` and `params` changed in place to generate just the closing `<|call|>`."""
    if not plan.forces_call:
        return []
    if params.allowed_token_ids is not None:  # the call's tokens would be masked: nothing left to sample
        raise APIError(400, "allowed_token_ids cannot be combined with a forced tool call.", param="allowed_token_ids")
    assert plan.tools is not None  # a forced call always has tools
    names = [t["function"]["name"] for t in plan.tools]
    name = plan.forced_name
    if name is None:
        name = names[0] if len(names) == 1 else await _pick_tool(state, names, prompt_ids, params, timeout, cache_salt)
    prefix = call_prefix(state.tokenizer, name)
    spec = next(t["function"] for t in plan.tools if t["function"]["name"] == name)
    if not (spec.get("parameters") or {}).get("properties"):
        prefix += state.tokenizer.encode("{}", add_special_tokens=False)
        call = state.tokenizer.convert_tokens_to_ids("<|call|>")
        params.logit_bias = {**(params.logit_bias or {}), call: FORCE_BIAS}
        params.max_tokens, params.min_tokens = 1, 0
        params.structured_outputs = None
        return prefix
    # the output is the call's arguments: constrained to the function's parameters from the first token
    params.structured_outputs = StructuredOutputs(json=spec["parameters"], from_start=True, param="tool_choice")
    await state.check_structured_outputs(params)
    return prefix


async def _pick_tool(
    state, names: list[str], prompt_ids: list[int], params: SamplingParams, timeout, cache_salt: str | None
) -> str:
    tokenizer = state.tokenizer
    header = tokenizer.encode(CALL_HEADER, add_special_tokens=False)
    spelled = {}
    for name in names:
        ids = tokenizer.encode(CALL_HEADER + name, add_special_tokens=False)
        # the name's tokens as they follow the header (BPE could merge across the boundary: then alone)
        spelled[name] = ids[len(header) :] if ids[: len(header)] == header else tokenizer.encode(name)
    chosen: list[int] = []
    candidates = list(names)
    while len(candidates) > 1:
        step = len(chosen)
        finished = [n for n in candidates if len(spelled[n]) == step]
        if finished:  # a name that is a prefix of another's: the shorter one is spelled out already
            return finished[0]
        allowed = {spelled[n][step] for n in candidates}
        if len(allowed) > 1:
            bias = {**(params.logit_bias or {}), **dict.fromkeys(allowed, FORCE_BIAS)}
            one = replace(
                params,
                n=1,
                max_tokens=1,
                min_tokens=0,
                stop=[],
                logit_bias=bias,
                logprobs=None,
                prompt_logprobs=None,
                structured_outputs=None,
            )
            sampled: int | None = None
            probe = state.generate(prompt_ids + header + chosen, one, timeout=timeout, cache_salt=cache_salt)
            async for delta in probe:
                sampled = next(iter(delta.token_ids), sampled)
            # never anything else with a +100 bias; never fail the request over it either
            token = sampled if sampled in allowed and sampled is not None else spelled[candidates[0]][step]
        else:
            token = next(iter(allowed))
        chosen.append(token)
        candidates = [n for n in candidates if spelled[n][step] == token]
    return candidates[0]
