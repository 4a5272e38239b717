"""ASGI entry point: HTTP through Django, websockets through Channels."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from apps.accounts.websocket import ApiKeyOrSessionAuthMiddleware  # noqa: E402
from apps.serving.routing import websocket_urlpatterns  # noqa: E402
from controlplane import logs  # noqa: E402

logs.install()  # uvicorn configured its handlers before Django: mask secrets in them too


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


application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": ApiKeyOrSessionAuthMiddleware(URLRouter(websocket_urlpatterns)),
        "lifespan": lifespan,
    }
)
