"""ASGI entry point: HTTP through Django, websockets through Channels."""

import gc
import os

from django.core import signals
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.db import close_old_connections, reset_queries  # noqa: E402

from apps.accounts.websocket import ApiKeyOrSessionAuthMiddleware  # noqa: E402
from apps.nodes.api.views import heartbeat_lane  # noqa: E402
from apps.serving.routing import websocket_urlpatterns  # noqa: E402
from controlplane import logs  # noqa: E402

HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
#: The OpenAI API: every view under it is async (apps/serving/urls.py).
OPENAI_PREFIX = "/v1/"

# Django's request_started receivers are sync, so every request hopped to a thread, started
# for it, before reaching its view (Django to a /v1 view: 1.20 ms with them, 0.87 without,
# 2026-12-05). Under ASGI they have nothing to do: a request's sync work runs in a thread of
# its own (asgiref's ThreadSensitiveContext), new, with no connection to close and no query
# logged yet. request_finished still closes what that thread opened. tests/test_asgi.py.
signals.request_started.disconnect(close_old_connections)
signals.request_started.disconnect(reset_queries)

logs.install()  # uvicorn configured its handlers before Django: mask secrets in them too
# Everything loaded so far lives as long as the process: keep it out of the collector's
# scans, which otherwise stall a request now and then (a routing decision's p99 halves).
gc.freeze()


async def lifespan(scope, receive, send):
    """The server's start and stop. On SIGTERM uvicorn stops accepting, lets open requests
    finish (streams included, up to --timeout-graceful-shutdown), then says shutdown: the
    usage records still being written are waited for, so none is lost to a clean stop."""
    from apps.usage.services import flush

    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await flush(timeout=10.0)
            await send({"type": "lifespan.shutdown.complete"})
            return


async def http(scope, receive, send):
    """Django, except agents' heartbeats: they take a lane without middleware.

    The OpenAI API's requests skip Django's per-request ThreadSensitiveContext. In one, the
    first sync call starts a thread for the request and the end joins it; an API request's
    only sync call is Django closing the response (request_finished), so each request
    started and joined a thread for that alone. Outside the context the close runs in
    asgiref's one long-lived sync thread: 0.4-0.9 ms less CPU in the web process a request
    and a warm first token 0.8-1.4 ms sooner, one request at a time (bench/NOTES.md,
    2026-12-05 17:48 UTC). The rest of Django (DRF's sync views, the console, the admin)
    keeps its thread per request, so a slow one never holds up another."""
    if scope["path"] == HEARTBEAT_PATH:
        return await heartbeat_lane(scope, receive, send)
    if scope["path"].startswith(OPENAI_PREFIX):
        return await django_asgi_app.handle(scope, receive, send)
    return await django_asgi_app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": http,
        "websocket": ApiKeyOrSessionAuthMiddleware(URLRouter(websocket_urlpatterns)),
        "lifespan": lifespan,
    }
)
