"""The Celery app; tasks and their periodic schedules live in each app's tasks.py."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("llamafleet")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def every(seconds: float, task_name: str, name: str) -> None:
    """Declare a periodic task next to its code (beat imports every tasks module first)."""
    app.conf.beat_schedule[name] = {"task": task_name, "schedule": seconds}
