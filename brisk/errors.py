"""The two errors brisk reports to its users, in a module that imports nothing of brisk (any layer may raise them).

`ConfigError`: a setting is wrong (start-up fails, naming the key). `InvalidRequest`: a request cannot be served
as asked; the one error for a refused request wherever the refusal happens (validation in the API server or the
offline `LLM`, admission in the engine core, a grammar that fails to compile after admission). The server answers
it with a 400 naming `param`, the offline API raises it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value the user gave is wrong; the message names the key."""


class InvalidRequest(ValueError):
    """A request that cannot run. `param` names the offending field, as OpenAI's error object does."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.message, self.code = param, message, code
