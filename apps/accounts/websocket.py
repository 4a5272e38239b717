"""Websocket authentication: an API key (header or `?api_key=`) or the browser session."""

from urllib.parse import parse_qs

from channels.auth import get_user
from channels.db import database_sync_to_async
from channels.sessions import CookieMiddleware, SessionMiddleware
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.http.request import split_domain_port, validate_host

from apps.accounts.services import authenticate_key, bearer_from_header


@database_sync_to_async
def _key_owner(raw: str):
    key = authenticate_key(raw)
    return (key.owner, key) if key else (AnonymousUser(), None)


def _same_origin(scope) -> bool:
    """Session cookies ride along cross-site; only pages of this very origin (scheme, host and
    port, as Django's CSRF check compares them) or of a CSRF-trusted origin may use them."""
    headers = dict(scope.get("headers", []))
    origin = headers.get(b"origin", b"").decode("latin-1")
    host = headers.get(b"host", b"").decode("latin-1")
    if not origin or not host or not validate_host(split_domain_port(host)[0], _allowed_hosts()):
        return False
    scheme = "https" if scope.get("scheme") in ("wss", "https") else "http"
    return origin == f"{scheme}://{host}" or origin in settings.CSRF_TRUSTED_ORIGINS


def _allowed_hosts() -> list[str]:
    return settings.ALLOWED_HOSTS or ["localhost", "127.0.0.1", "[::1]"]


class _ApiKeyOrSession:
    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        scope = dict(scope)
        headers = dict(scope.get("headers", []))
        raw = bearer_from_header(headers.get(b"authorization", b"").decode())
        raw = raw or parse_qs(scope.get("query_string", b"").decode()).get("api_key", [""])[0]
        scope["api_key"] = None
        if raw:
            scope["user"], scope["api_key"] = await _key_owner(raw)
        elif _same_origin(scope):
            scope["user"] = await get_user(scope)
        else:
            scope["user"] = AnonymousUser()
        return await self.inner(scope, receive, send)


def ApiKeyOrSessionAuthMiddleware(inner):
    """Sets scope["user"] (AnonymousUser when neither credential is valid) and scope["api_key"]."""
    return CookieMiddleware(SessionMiddleware(_ApiKeyOrSession(inner)))
