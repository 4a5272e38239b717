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
        "apps.nodes.tasks.sweep_stale_nodes": ("control", 60),
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
