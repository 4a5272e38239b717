from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    """Desired state (deployments) and actual state (replicas on nodes), reconciled."""

    name = "apps.deployments"

    def ready(self):
        from apps.deployments import receivers  # noqa: F401  (connects to node signals)
