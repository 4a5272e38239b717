"""The Celery app; tasks and their periodic schedules live in each app's tasks.py."""

import logging
import os

from celery import Celery
from celery.contrib.django.task import DjangoTask
from celery.signals import after_setup_logger, after_setup_task_logger
from celery.worker.consumer import Consumer as _Consumer
from celery.worker.request import Request as _Request

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
log = logging.getLogger(__name__)


def _connection_lost(message) -> bool:
    """Whether the broker connection a message came on has been collected since (a reconnect
    happened while its task ran): kombu clears the transport's client, or the channel's."""
    channel = message.channel
    transport = channel.connection if channel is not None else None
    return transport is None or transport.client is None


class Request(_Request):
    """A task request that settles its message even when the connection it came on is gone.

    With acks_late, a task that runs while the broker connection drops is acknowledged when
    it ends, after the worker reconnected, through its message's old channel. Celery 5.7.0
    has collected that channel's connection by then, so kombu fails with AttributeError
    ('NoneType' object has no attribute 'hostname'), which Celery does not count as a
    connection error, and the worker stops for good: seen in CI after the fault battery's
    Redis restart. The Redis transport keeps an unacknowledged message in the broker under
    its delivery tag, not in the connection, so a new connection settles it just as well.
    """

    def acknowledge(self):
        if self.acknowledged or not _connection_lost(self._message):
            return super().acknowledge()
        self._settle_elsewhere(lambda qos, tag: qos.ack(tag), "acknowledged")
        self.acknowledged = True

    def reject(self, requeue=False):
        if self.acknowledged or not _connection_lost(self._message):
            return super().reject(requeue)
        what = "requeued" if requeue else "rejected"
        self._settle_elsewhere(lambda qos, tag: qos.reject(tag, requeue=requeue), what)
        self.acknowledged = True
        self.send_event("task-rejected", requeue=requeue)

    def _settle_elsewhere(self, settle, what: str) -> None:
        tag = self._message.delivery_tag
        with self._app.connection_for_write() as connection:
            if connection.transport.driver_type != "redis":  # AMQP redelivers on its own
                log.warning("task %s not %s: the connection it came on is gone", self.id, what)
                return
            try:
                connection.ensure_connection(max_retries=1)  # never hold the worker's loop
                channel = connection.channel()
                try:
                    settle(channel.qos, tag)
                finally:
                    channel.close()
            except connection.connection_errors + connection.channel_errors as exc:
                log.warning(
                    "task %s not %s (%r): its message comes back after the visibility timeout",
                    self.id, what, exc,
                )  # fmt: skip
            else:
                log.info("task %s %s through a new broker connection", self.id, what)


class Task(DjangoTask):
    """DjangoTask (`task.delay_on_commit(...)` sends once the transaction commits), whose
    requests survive a broker reconnection."""

    Request = Request


app = Celery("llamafleet", task_cls=Task)
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
    did not close); the message stays unacknowledged, and the task's Request settles it
    when the task ends.
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
