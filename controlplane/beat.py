"""Beat's scheduler: django-celery-beat's, without the busy re-checks before each run."""

from django_celery_beat.schedulers import DatabaseScheduler


class Scheduler(DatabaseScheduler):
    """The database scheduler (schedules editable in the admin), sleeping what it says.

    Celery takes 10 ms off every wait ("drift"). When an entry is due in under 10 ms the wait
    comes out negative, beat does not sleep, and ticks again at once: each tick a database
    query, until the entry is due. Measured on an idle stack (2026-12-05): about five such
    ticks before each of the ~1 run a second (sweeps every 2 s), 4.6 ticks and 10 ms of CPU a
    second, on the cores an engine on the same machine decodes with. Here a wait is the time
    left, so an entry a few milliseconds early is checked once more, not several times.
    """

    def adjust(self, n, drift=0.0):
        return n
