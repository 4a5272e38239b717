"""Configuration that must hold: Celery's effective settings, strict environment parsing."""

import os
import subprocess
import sys

import pytest

from controlplane.celery import app


@pytest.fixture(autouse=True, scope="module")
def task_modules():
    """What a worker and beat do at start: import every app's tasks module."""
    app.loader.import_default_modules()


def test_celery_effective_config():
    conf = app.conf
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    tasks = app.tasks
    expected = {
        "apps.catalog.tasks.run_pull": ("jobs", 3600),
        "apps.deployments.tasks.load_replica": ("control", 960),
        "apps.deployments.tasks.reconcile_deployment": ("control", 120),
        "apps.deployments.tasks.free_replica": ("control", 90),
        "apps.nodes.tasks.sweep_stale_nodes": ("liveness", 60),
        "apps.deployments.tasks.autoscale": ("liveness", 30),
        "apps.usage.tasks.make_report": ("jobs", 360),
    }
    for name, (queue, limit) in expected.items():
        assert tasks[name].time_limit == limit, name
        assert tasks[name].soft_time_limit < limit, name
        route = app.amqp.router.route({}, name, args=(), kwargs={})
        assert route["queue"].name == queue, name


def test_periodic_tasks_are_declared():
    names = {entry["task"] for entry in app.conf.beat_schedule.values()}
    assert {"apps.nodes.tasks.sweep_stale_nodes", "apps.deployments.tasks.reconcile_all"} <= names


def test_missing_secret_stops_the_start_with_its_name():
    env = {k: v for k, v in os.environ.items() if k != "LLAMAFLEET_SECRET_KEY"}
    proc = subprocess.run(
        [sys.executable, "manage.py", "check"], env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "LLAMAFLEET_SECRET_KEY is not set" in proc.stderr


def test_bad_database_url_fails_clearly():
    env = os.environ | {"DATABASE_URL": "nosuchdb://x"}
    proc = subprocess.run(
        [sys.executable, "manage.py", "check"], env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0 and "nosuchdb" in proc.stderr


def test_two_stacks_sharing_a_redis_database_keep_their_tasks_apart(settings):
    """Celery's keys, the channel layer's and ours all carry the stack's namespace: a task
    sent by a stack with another namespace lands in its own queue, never in ours."""
    import redis

    from controlplane.redis import key

    client = redis.Redis.from_url(settings.REDIS_URL)
    env = os.environ | {"LLAMAFLEET_NAMESPACE": "other-stack"}
    code = (
        "import django; django.setup(); from apps.catalog.tasks import run_pull; "
        "run_pull.delay(424242)"
    )
    try:
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
        theirs = client.lrange("other-stack:jobs", 0, -1)
        assert len(theirs) == 1 and b"424242" in theirs[0]
        ours = client.lrange(f"{settings.REDIS_NAMESPACE}:jobs", 0, -1)
        assert not any(b"424242" in m for m in ours)
        assert settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"].startswith(
            settings.REDIS_NAMESPACE
        )
        assert key("rpm", "app", 7) == f"{settings.REDIS_NAMESPACE}:rpm:app:7"
    finally:
        for k in client.scan_iter("other-stack:*"):
            client.delete(k)
        client.close()
