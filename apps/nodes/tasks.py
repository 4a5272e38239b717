"""Periodic liveness sweep of nodes, and link measurements (as LinkJob rows)."""

from celery import shared_task

from apps.nodes import services
from apps.nodes.models import LinkJob
from controlplane.celery import every


@shared_task(time_limit=60, soft_time_limit=50, expires=services.FLUSH_SECONDS * 2)
def sweep_stale_nodes() -> list[str]:
    """Mark nodes whose heartbeats stopped as unreachable (and fail what they held)."""
    return services.sweep_stale_nodes()


@shared_task(time_limit=900, soft_time_limit=870)
def measure_links(job_id: int | None = None) -> str:
    """Run a round of link measurements (the schedule's, without a job, makes its own)."""
    if job_id is None:
        job_id = LinkJob.objects.create().pk
    return services.run_link_job(job_id).state


@shared_task(time_limit=60, soft_time_limit=50)
def expire_link_job_leases() -> dict:
    """Fail link jobs whose worker died; send again those nobody picked up."""
    return LinkJob.expire(measure_links.delay)


# Every FLUSH_SECONDS: it writes the buffered heartbeats first, then looks for silence.
every(services.FLUSH_SECONDS, sweep_stale_nodes.name, "nodes: sweep stale nodes")
every(3600.0, measure_links.name, "nodes: measure links")
every(60.0, expire_link_job_leases.name, "nodes: expire link job leases")
