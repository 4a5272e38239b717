from django.urls import path

from apps.console.consumers import DashboardConsumer
from apps.serving.consumers import GenerationConsumer

websocket_urlpatterns = [
    path("ws/v1/generate", GenerationConsumer.as_asgi()),
    path("ws/v1/console", DashboardConsumer.as_asgi()),
]
