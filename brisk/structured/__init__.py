"""Structured outputs (JSON schema, JSON object, regex, choice, grammar, strict tools) on xgrammar.

spec.StructuredOutputs is what a request asks (light: imported by SamplingParams); compiler.GrammarCompiler
turns it into a compiled grammar off the step loop; matcher.Matcher follows one sequence and
matcher.apply_token_bitmask masks a batch's logits (those two import xgrammar and torch).
"""

from brisk.structured.spec import StrictTool, StructuredOutputs

__all__ = ["StrictTool", "StructuredOutputs"]
