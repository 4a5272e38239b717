"""Scheduled reports. Their schedules are rows of django-celery-beat, editable in the admin."""

from datetime import datetime

from celery import shared_task

from apps.usage import services
from apps.usage.models import Report
from apps.usage.services import period, save_report
from controlplane.celery import every


@shared_task(soft_time_limit=300, time_limit=360)
def make_report(kind: str = Report.Kind.DAILY, start: str = "", end: str = "") -> int:
    """Build the report of the last complete day or week (or of [start, end)); its id."""
    if start and end:
        begin, finish = datetime.fromisoformat(start), datetime.fromisoformat(end)
    else:
        begin, finish = period(kind)
    return save_report(kind, begin, finish).pk


@shared_task(soft_time_limit=60, time_limit=90)
def settle_interrupted() -> int:
    """Complete the records of streams whose web process died (see services)."""
    return services.settle_interrupted()


every(60.0, settle_interrupted.name, "usage: settle interrupted records")
