"""Model pulls run on the `jobs` queue: they are long and must not delay control work."""

from celery import shared_task

from apps.catalog import services
from controlplane.celery import every


@shared_task(time_limit=3600, soft_time_limit=3500)
def run_pull(job_id: int) -> str:
    """Run one pull job by id; its row records progress and outcome."""
    return services.run_pull(job_id).state


@shared_task(time_limit=7200, soft_time_limit=7100)
def run_quantize(job_id: int) -> str:
    """Run one quantization job by id; its row records progress and outcome."""
    from apps.catalog import quantization

    return quantization.run_quantize(job_id).state


@shared_task(time_limit=60, soft_time_limit=50)
def expire_job_leases() -> dict:
    """Fail jobs whose worker died holding them; send again those never picked up."""
    return services.expire_leases()


every(60.0, expire_job_leases.name, "catalog: expire job leases")
