"""The whole stack as separate processes, started by scripts/stack.py on a fresh var/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import free_port, stack_command, stack_module


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_path):
    """One stack per test module (a module may stop parts of it)."""
    var = tmp_path_factory.mktemp("stack-var")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMAFLEET_", "DJANGO_"))}
    env |= {
        "LLAMAFLEET_VAR_DIR": str(var),
        "PORT": str(free_port()),
        "LLAMAFLEET_AGENT_PORT": str(free_port()),
        "LLAMAFLEET_AGENT_METRICS_PORT": str(free_port()),
        "LLAMAFLEET_BOOTSTRAP_KEY": "lf-e2e-bootstrap-key-000000000000",
        # Its own database: the stack's Celery worker must not meet the tests' broker traffic.
        "REDIS_URL": os.environ["REDIS_URL"].rsplit("/", 1)[0] + "/14",
        "LLAMAFLEET_HEARTBEAT_SECONDS": "1",
        "LLAMAFLEET_HEARTBEAT_TIMEOUT": "4",
        # These tests kill processes to see what the fleet shows (tests/test_supervise.py
        # covers the supervisor that would start them again).
        "LLAMAFLEET_SUPERVISE": "0",
    }
    env.pop("DATABASE_URL", None)  # the embedded default: SQLite under var/
    up = stack_command("up", "--wait", "120", env=env, timeout=600)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "LlamaFleet is up at" in up.stdout and env["LLAMAFLEET_BOOTSTRAP_KEY"] in up.stdout
        yield {
            "url": f"http://127.0.0.1:{env['PORT']}",
            "key": env["LLAMAFLEET_BOOTSTRAP_KEY"],
            "var": Path(var),
            "env": env,
        }
    finally:
        down = stack_command("down", env=env, timeout=120)
        assert down.returncode == 0, down.stderr
        for name in stack_module().PROCESSES:
            assert not (Path(var) / "run" / f"{name}.pid").exists()
