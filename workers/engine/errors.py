"""Errors the engine and agent report, as ErrorCode values of the gRPC contract.

A failed call carries its code's name (without the ERROR_CODE_ prefix) in its trailing
metadata under METADATA_KEY; `code_of` reads it back, so no caller matches message text.
"""

from __future__ import annotations

from llamafleet.agent.v1.agent_pb2 import ErrorCode

METADATA_KEY = "llamafleet-error-code"

CONTEXT_LENGTH_EXCEEDED = ErrorCode.ERROR_CODE_CONTEXT_LENGTH_EXCEEDED
REPLICA_NOT_FOUND = ErrorCode.ERROR_CODE_REPLICA_NOT_FOUND
ENGINE_FAILED = ErrorCode.ERROR_CODE_ENGINE_FAILED
BAD_MODEL_FILE = ErrorCode.ERROR_CODE_BAD_MODEL_FILE
OVERLOADED = ErrorCode.ERROR_CODE_OVERLOADED
INVALID_ARGUMENT = ErrorCode.ERROR_CODE_INVALID_ARGUMENT
INVALID_SCHEMA = ErrorCode.ERROR_CODE_INVALID_SCHEMA
DRAINING = ErrorCode.ERROR_CODE_DRAINING
ENDPOINT_IN_USE = ErrorCode.ERROR_CODE_ENDPOINT_IN_USE
UNSPECIFIED = ErrorCode.ERROR_CODE_UNSPECIFIED

_PREFIX = "ERROR_CODE_"


def code_name(code: int) -> str:
    """The name a code travels under ("ENGINE_FAILED")."""
    return ErrorCode.Name(code).removeprefix(_PREFIX)


def code_of(name: str) -> int:
    """The code a name stands for; UNSPECIFIED for "" or a name this side does not know."""
    try:
        return ErrorCode.Value(_PREFIX + name) if name else UNSPECIFIED
    except ValueError:
        return UNSPECIFIED


class EngineError(Exception):
    """A failure with a machine-readable ErrorCode value."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def name(self) -> str:
        return code_name(self.code)


def describe(exc: Exception) -> str:
    """A failed gRPC call in words: the peer's message, else its status name (one formatter
    for every caller)."""
    details = getattr(exc, "details", None)
    code = getattr(exc, "code", None)
    if callable(details) and callable(code):
        return details() or code().name
    return str(exc)
