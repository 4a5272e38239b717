"""Periodic liveness sweep of nodes."""

from celery import shared_task

from apps.nodes import services
from controlplane.celery import app


@shared_task(time_limit=60, soft_time_limit=50)
def sweep_stale_nodes() -> list[str]:
    """Mark nodes whose heartbeats stopped as unreachable (and fail what they held)."""
    return services.sweep_stale_nodes()


@app.on_after_finalize.connect
def _schedule(sender, **kwargs):
    sender.add_periodic_task(5.0, sweep_stale_nodes.s(), name="nodes: sweep stale nodes")
