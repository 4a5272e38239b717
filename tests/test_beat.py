"""Beat's scheduler on the real database: it waits for what is due instead of spinning."""

from __future__ import annotations

import time

import pytest
from django.conf import settings
from kombu.utils.imports import symbol_by_name

from controlplane.beat import Scheduler
from controlplane.celery import app


@pytest.mark.django_db(transaction=True)
def test_beat_checks_the_database_about_twice_per_task_it_sends():
    """Run beat's loop as celery.beat.Service does (tick, sleep what it says) for 6.5 s
    over the stack's own schedule, sending nothing to the broker: a sweep is due every 2 s,
    the autoscaler every 5 s, and so on. Each tick queries the database, on the cores an
    engine decodes with. Celery's 10 ms "drift" made the wait before an entry due in under
    10 ms negative, and beat ticked about five times per task."""
    assert symbol_by_name(settings.CELERY_BEAT_SCHEDULER) is Scheduler
    app.loader.import_default_modules()  # every tasks module declares its intervals
    scheduler = Scheduler(app, lazy=False)
    sent = []
    scheduler.apply_async = lambda entry, **kwargs: sent.append(entry.name)
    scheduler.tick()  # the first read of the schedule
    sent.clear()
    ticks, end = 0, time.monotonic() + 6.5
    try:
        while time.monotonic() < end:
            wait = scheduler.tick()
            ticks += 1
            if wait and wait > 0:
                time.sleep(wait)
    finally:
        scheduler._finalize()  # its sync at exit, now, while the test's tables exist
    assert sent.count("nodes: sweep stale nodes") >= 3, sent
    # Each send is one tick (returning 0) and one more to find the next wait, sometimes a
    # third for an entry found a moment early (with Celery's drift: about five).
    assert ticks <= 3 * len(sent) + 2, f"{ticks} ticks for {len(sent)} sends: {sent}"
