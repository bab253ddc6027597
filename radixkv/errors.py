"""The errors a user can cause, carrying what is wrong as data: the parameter and the limit.

Layers map them by their fields (the server to OpenAI's error shape), never by parsing the
message text. `assert` stays for internal invariants only.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses. `param` names the offending input (`prompt`, `max_tokens`,
    `n`, ...), `code` a machine-readable reason (`context_length_exceeded`), `limit` the bound
    it broke where there is one."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.limit = limit


class QueueFull(RuntimeError):
    """The waiting queue is at EngineConfig.max_queue_len; retry later."""

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class ConfigError(ValueError):
    """A configuration value outside what the engine accepts; `param` names the field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class OwnerCapExceeded(InvalidRequest):
    """A request past its owner's own share of a cap (pins per owner): the same request may
    succeed once the owner releases some of its share. The server answers it with 429."""


class UnsupportedModel(ValueError):
    """A model whose architecture or settings the forward does not implement."""
