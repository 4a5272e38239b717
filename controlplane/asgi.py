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

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": ApiKeyOrSessionAuthMiddleware(URLRouter(websocket_urlpatterns)),
    }
)
