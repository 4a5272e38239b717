"""Errors the engine reports, named by the ErrorCode values of the gRPC contract."""


class EngineError(Exception):
    """A failure with a machine-readable code (an ErrorCode name without its prefix)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
