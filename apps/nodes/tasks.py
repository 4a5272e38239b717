"""Periodic liveness sweep of nodes."""

from celery import shared_task

from apps.nodes import services
from controlplane.celery import every


@shared_task(time_limit=60, soft_time_limit=50, expires=services.FLUSH_SECONDS * 2)
def sweep_stale_nodes() -> list[str]:
    """Mark nodes whose heartbeats stopped as unreachable (and fail what they held)."""
    return services.sweep_stale_nodes()


@shared_task(time_limit=900, soft_time_limit=870)
def measure_links(node_names: list[str] | None = None) -> int:
    """Have agents measure round trip and throughput to each other (see services)."""
    return services.measure_links(node_names)


# Every FLUSH_SECONDS: it writes the buffered heartbeats first, then looks for silence.
every(services.FLUSH_SECONDS, sweep_stale_nodes.name, "nodes: sweep stale nodes")
every(3600.0, measure_links.name, "nodes: measure links")
