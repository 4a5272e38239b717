"""The Celery app; tasks and their periodic schedules live in each app's tasks.py."""

import os

from celery import Celery
from celery.signals import after_setup_logger, after_setup_task_logger

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

# DjangoTask: `task.delay_on_commit(...)` sends a task once the transaction commits.
app = Celery("llamafleet", task_cls="celery.contrib.django.task:DjangoTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@after_setup_logger.connect
@after_setup_task_logger.connect
def _redact_logs(**kwargs):
    """Celery sets up its own handlers: mask secrets in them too."""
    from controlplane import logs

    logs.install()


def every(seconds: float, task_name: str, name: str) -> None:
    """Declare a periodic task next to its code (beat imports every tasks module first)."""
    app.conf.beat_schedule[name] = {"task": task_name, "schedule": seconds}
