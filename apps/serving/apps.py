from django.apps import AppConfig


class ServingConfig(AppConfig):
    """Inference for clients: OpenAI-compatible HTTP (JSON and SSE) and websockets."""

    name = "apps.serving"

    def ready(self):
        from apps.serving import routing_table

        routing_table.connect_signals()
