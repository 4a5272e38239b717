"""Limits every HTTP request meets before any view: body size (413) and no NUL in the query
string (400; PostgreSQL text cannot hold one, so a filter would fail in the database)."""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import JsonResponse


def _error(status: int, message: str, param: str, code: str) -> JsonResponse:
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return JsonResponse({"error": body}, status=status)


def _refusal(request) -> JsonResponse | None:
    length = request.META.get("CONTENT_LENGTH") or "0"
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if not length.isdigit() or int(length) > limit:
        return _error(413, f"the request body is larger than {limit} bytes", "body", "too_large")
    if "%00" in request.META.get("QUERY_STRING", "") or "\x00" in request.path:
        return _error(400, "a NUL character is not accepted", "query", "invalid_characters")
    return None


class RequestLimitsMiddleware:
    """Refusals in the OpenAI error shape. Bodies without a Content-Length are bounded by
    Django's DATA_UPLOAD_MAX_MEMORY_SIZE as they are read."""

    async_capable = True
    sync_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self._acall(request)
        return _refusal(request) or self.get_response(request)

    async def _acall(self, request):
        return _refusal(request) or await self.get_response(request)
