"""The charts' points, taken by beat for every console at once."""

from celery import shared_task

from apps.console import series
from controlplane.celery import every


@shared_task(time_limit=30, soft_time_limit=25, expires=series.STEP * 2)
def record_series() -> int:
    """Take the fleet page's next point; returns how many deployments it covers."""
    return len(series.record()["deployments"])


every(series.STEP, record_series.name, "console: chart points")
