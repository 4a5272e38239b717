from django.apps import AppConfig


class NodesConfig(AppConfig):
    """Machines running a node agent: their capacity, liveness and gRPC address."""

    name = "apps.nodes"
