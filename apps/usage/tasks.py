"""Scheduled reports. Their schedules are rows of django-celery-beat, editable in the admin."""

from datetime import datetime

from celery import shared_task

from apps.usage.models import Report
from apps.usage.services import period, save_report


@shared_task(soft_time_limit=300, time_limit=360)
def make_report(kind: str = Report.Kind.DAILY, start: str = "", end: str = "") -> int:
    """Build the report of the last complete day or week (or of [start, end)); its id."""
    if start and end:
        begin, finish = datetime.fromisoformat(start), datetime.fromisoformat(end)
    else:
        begin, finish = period(kind)
    return save_report(kind, begin, finish).pk
