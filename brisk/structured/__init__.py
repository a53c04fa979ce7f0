"""Structured outputs (JSON schema, JSON object, regex, choice, grammar, strict tools) on xgrammar.

spec.StructuredOutputs is what a request asks (light: imported by SamplingParams); grammars.py builds xgrammar's
structural tag of it; compiler.GrammarCompiler compiles it off the step loop; engine.StructuredOutputManager is the
engine core's side (compiles in flight, each step's bitmasks) and state.GrammarState one completion's grammar;
matcher.Matcher follows one sequence and matcher.GrammarBitmaskApplier masks a step's logits in the runner.
"""

from brisk.structured.spec import StrictTool, StructuredOutputs

__all__ = ["StrictTool", "StructuredOutputs"]
