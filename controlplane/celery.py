"""The Celery app; tasks and their periodic schedules live in each app's tasks.py."""

import logging
import os

from celery import Celery
from celery.signals import after_setup_logger, after_setup_task_logger
from celery.worker.consumer import Consumer as _Consumer

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
log = logging.getLogger(__name__)

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


class Consumer(_Consumer):
    """The worker's consumer, surviving a broker that drops while a task runs.

    When the broker connection drops, Celery 5.7.0 collects the connection (which clears its
    transport's client) and then closes it. With a task in flight (acks_late) the close
    restores its unacknowledged message through that cleared client, raises AttributeError,
    which Celery does not count as a connection error, and the worker stops for good
    ("Unrecoverable error"): a Redis restart left the control plane without a worker. Here
    that close may fail without stopping the worker, as Celery 5.6 did (it collected and
    did not close); the message comes back after the broker's visibility timeout, and the
    tasks are idempotent (acks_late).
    """

    def on_connection_error_after_connected(self, exc):
        connection = self.connection
        if connection is not None:
            close = connection.close

            def close_collected():
                try:
                    close()
                except AttributeError as error:
                    log.warning("broker connection closed with unacknowledged messages: %r", error)

            connection.close = close_collected
        super().on_connection_error_after_connected(exc)
