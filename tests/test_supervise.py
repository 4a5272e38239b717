"""`make run`'s supervisor (scripts/stack.py supervise): a process of the stack that exits is
started again with its own command line; one stopped through the stack is not."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tests.conftest import free_port, stack_command, stack_module

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
def stack(tmp_path):
    module = stack_module()
    stack = module.Stack(tmp_path, free_port(), free_port(), free_port())
    yield module, stack
    for name in stack.processes():
        stack.stop(name)


def command_line(pid: int) -> list[str]:
    """The process's argv once it has run exec (between fork and exec it reads empty)."""
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/cmdline") as f:
            argv = f.read().split("\0")
        if argv != [""] or time.monotonic() > deadline:
            return argv
        time.sleep(0.01)


def killed(stack, name: str) -> int:
    pid = stack.pid(name)
    os.killpg(pid, signal.SIGKILL)
    for _ in range(100):
        if stack.pid(name) is None:
            return pid
        time.sleep(0.05)
    raise AssertionError(f"{name} did not die")


def test_an_exited_process_starts_again_with_its_command_line(stack):
    module, stack = stack
    stack.start("worker", SLEEP)
    first = killed(stack, "worker")
    state = {}
    assert stack.restart_exited(state, time.monotonic()) == ["worker"]
    second = stack.pid("worker")
    assert second and second != first
    assert command_line(second)[:3] == SLEEP
    assert stack.restart_exited(state, time.monotonic()) == []  # running: left alone


def test_a_process_stopped_through_the_stack_stays_stopped(stack):
    module, stack = stack
    stack.start("beat", SLEEP)
    stack.stop("beat")
    assert stack.restart_exited({}, time.monotonic()) == []
    assert stack.pid("beat") is None


def test_a_process_that_keeps_exiting_waits_longer_each_time(stack):
    module, stack = stack
    stack.start("web", [sys.executable, "-c", "pass"])  # exits at once, every time
    state, now, starts = {}, 1000.0, []
    for step in range(40):  # 20 s of supervisor passes, half a second apart
        t = now + step / 2
        for _ in range(100):  # the last start's process has exited
            if stack.pid("web") is None:
                break
            time.sleep(0.02)
        if stack.restart_exited(state, t):
            starts.append(t - now)
    # Back-offs of 1, 2, 4 and 8 s after the first start again: not one start per pass.
    assert starts == [0.0, 1.0, 3.0, 7.0, 15.0], starts
    assert state["web"][1] == 8.0
    assert module.MAX_BACKOFF >= 8.0


def test_the_supervisor_process_restarts_what_exits_and_down_stops_everything(stack):
    module, stack = stack
    stack.start("agent", SLEEP)
    env = dict(stack.env, LLAMAFLEET_VAR_DIR=str(stack.var))
    stack.supervisor()
    first = killed(stack, "agent")
    deadline = time.monotonic() + 3 * module.SUPERVISE_SECONDS + 5
    while time.monotonic() < deadline and stack.pid("agent") in (None, first):
        time.sleep(0.1)
    second = stack.pid("agent")
    assert second and second != first, (stack.log_dir / "supervisor.log").read_text()
    assert "agent exited; starting it again" in (stack.log_dir / "supervisor.log").read_text()
    down = stack_command("down", env=env, timeout=60)
    assert down.returncode == 0, down.stderr
    # The supervisor stops first, so nothing is started again behind `down`.
    assert down.stdout.index("supervisor: stopped") < down.stdout.index("agent: stopped")
    assert stack.pid("agent") is None and stack.pid(module.SUPERVISOR) is None
    time.sleep(module.SUPERVISE_SECONDS + 0.5)
    assert stack.pid("agent") is None
