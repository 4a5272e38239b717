"""The middleware of every HTTP request: limits it meets before any view (body size, 413;
no NUL in the query string, 400: PostgreSQL text cannot hold one, so a filter would fail in
the database), and Django's and WhiteNoise's middleware made to run on the event loop."""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions
from django.http import JsonResponse
from django.middleware import clickjacking, common, csrf, security
from whitenoise.middleware import WhiteNoiseMiddleware


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


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    """WhiteNoise, able to run async. WhiteNoise's middleware is sync only, and one sync
    middleware makes Django run every async view behind two thread hops (a third of the web
    process's CPU per request here). Finding a file is a dict lookup, done on the event
    loop (a walk of the file system with autorefresh, in DEBUG: in a thread), and serving one
    goes to a thread."""

    async_capable = True
    sync_capable = True

    def __init__(self, get_response=None, *args, **kwargs):
        super().__init__(get_response, *args, **kwargs)
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self._acall(request)
        return super().__call__(request)

    async def _acall(self, request):
        if self.autorefresh:
            static_file = await sync_to_async(self.find_file)(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return await sync_to_async(self.serve)(static_file, request)
        return await self.get_response(request)


_SAFE_METHODS = ("GET", "HEAD", "OPTIONS", "TRACE")  # RFC 9110's, as Django's CSRF check has them


class _Inline:
    """Runs a Django middleware's hooks on the event loop when they do no I/O.

    Django 5.2's own middleware is sync: on an async request MiddlewareMixin passes every
    process_request and process_response through sync_to_async, a hop to the sync thread
    and back each, a dozen a request for hooks that only read and set headers and cookies.
    A hook that may reach the database (a session or messages that were used) still goes to
    the thread: `_needs_thread` says when.
    """

    def _needs_thread(self, request) -> bool:
        return False

    async def __acall__(self, request):
        response = None
        if hasattr(self, "process_request"):
            response = self.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            if self._needs_thread(request):
                response = await sync_to_async(self.process_response, thread_sensitive=True)(
                    request, response
                )
            else:
                response = self.process_response(request, response)
        return response


class SecurityMiddleware(_Inline, security.SecurityMiddleware):
    """Django's, inline (see _Inline)."""


class CommonMiddleware(_Inline, common.CommonMiddleware):
    """Django's, inline (see _Inline)."""


class CsrfViewMiddleware(_Inline, csrf.CsrfViewMiddleware):
    """Django's, inline (see _Inline): the secret lives in a cookie (CSRF_USE_SESSIONS is
    off), so no hook reads the session.

    process_view too: Django passes a sync one through sync_to_async, which started a
    thread for every request, /v1 streams included, before its view ran. It runs on the
    event loop for an exempt view (the API's) or a safe method, where Django's reads only
    headers and cookies; else in the thread, since checking a form's token reads the body,
    which may have been spooled to disk."""

    def __init__(self, get_response):
        super().__init__(get_response)
        if iscoroutinefunction(get_response):  # the instance's, as load_middleware reads it
            self.process_view = self._process_view_async

    async def _process_view_async(self, request, callback, callback_args, callback_kwargs):
        check = super().process_view
        if getattr(callback, "csrf_exempt", False) or request.method in _SAFE_METHODS:
            return check(request, callback, callback_args, callback_kwargs)
        return await sync_to_async(check, thread_sensitive=True)(
            request, callback, callback_args, callback_kwargs
        )


class AuthenticationMiddleware(_Inline, auth.AuthenticationMiddleware):
    """Django's, inline (see _Inline): it only sets a lazy request.user."""


class XFrameOptionsMiddleware(_Inline, clickjacking.XFrameOptionsMiddleware):
    """Django's, inline (see _Inline)."""


class SessionMiddleware(_Inline, sessions.SessionMiddleware):
    """Django's, inline unless the request used its session (saving one writes it)."""

    def _needs_thread(self, request) -> bool:
        session = getattr(request, "session", None)
        return session is not None and (session.accessed or session.modified)


class MessageMiddleware(_Inline, messages.MessageMiddleware):
    """Django's, inline unless messages were read or added (storing them may load the
    session from the database)."""

    def _needs_thread(self, request) -> bool:
        storage = getattr(request, "_messages", None)
        return storage is not None and (storage.used or storage.added_new)
