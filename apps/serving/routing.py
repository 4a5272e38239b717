from django.urls import path

from apps.serving.consumers import GenerationConsumer

websocket_urlpatterns = [
    path("ws/v1/generate", GenerationConsumer.as_asgi()),
]
