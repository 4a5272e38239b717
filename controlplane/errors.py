"""One place that turns domain errors into API errors, so none of them leaks as a 500."""

from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


class DomainError(Exception):
    """A request the domain refuses; `status` is the HTTP status it maps to."""

    status = status.HTTP_400_BAD_REQUEST
    code = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None, status_code: int | None = None):
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        if status_code:
            self.status = status_code


class NotFound(DomainError):
    status = status.HTTP_404_NOT_FOUND
    code = "not_found"


class Conflict(DomainError):
    status = status.HTTP_409_CONFLICT
    code = "conflict"


class Unavailable(DomainError):
    status = status.HTTP_503_SERVICE_UNAVAILABLE
    code = "unavailable"


def exception_handler(exc, context):
    if isinstance(exc, DomainError):
        return Response({"detail": exc.message, "code": exc.code}, status=exc.status)
    return drf_exception_handler(exc, context)
