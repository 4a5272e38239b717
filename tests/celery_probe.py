"""Tasks a test worker imports (`--include tests.celery_probe`) to show what it is doing."""

import time

import redis

from controlplane.celery import app


def _mark(key: str) -> None:
    redis.Redis.from_url(app.conf.broker_url).set(key, "1")


@app.task(name="tests.probe.mark")
def mark(key: str) -> None:
    _mark(key)


@app.task(name="tests.probe.sleep")
def sleep(key: str, seconds: float) -> None:
    _mark(key)
    time.sleep(seconds)
