"""Run the whole stack on this machine: `up`, `down`, `status`.

`up` starts what is missing (Redis if none answers at REDIS_URL, the ASGI server, a Celery
worker and beat, one node agent), pulls and deploys the default model and prints the URL
and an API key. Secrets are generated once into var/env (mode 0600) unless the
environment provides them. Every process writes var/log/<name>.log and var/run/<name>.pid;
`down` stops exactly those. A supervisor (`supervise`, started by `up` unless
LLAMAFLEET_SUPERVISE=0) starts again any of them that exits without `down` or `stop`.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
DEFAULT_MODEL = "smollm2-135m-instruct"
#: The processes of `make run`, in the order they start, each by the Stack method of its
#: name. They stop in the reverse order: agents first (they drain), Redis last.
PROCESSES = ("redis", "web", "worker", "beat", "agent")
SUPERVISOR = "supervisor"
#: How often the supervisor looks; a process that exits again within MIN_UPTIME of its
#: start waits twice as long as the last time before the next try (up to MAX_BACKOFF).
SUPERVISE_SECONDS, MIN_UPTIME, MAX_BACKOFF = 2.0, 30.0, 60.0


class Stack:
    """Paths and environment of one stack instance (one var/ directory)."""

    def __init__(self, var: Path, port: int, agent_port: int, metrics_port: int = 9464):
        self.var = var
        self.port = port
        self.agent_port = agent_port
        self.metrics_port = metrics_port
        self.run_dir = var / "run"
        self.log_dir = var / "log"
        for d in (self.run_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.env = self._environment()

    # ---- configuration -------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        """Process environment: the caller's, plus secrets kept in var/env.

        Every command of the stack (the supervisor, `manage.py` through it, the bench) reads
        the file, so it is read and written under a lock, rewritten only when a secret is
        new or set from the environment, and replaced whole: a reader that found it
        truncated by another process's rewrite made new secrets and saved them, and the
        running stack's API key stopped matching the file's (seen: the bench's 401)."""
        env_file = self.var / "env"
        with open(self.var / "env.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            saved = {}
            if env_file.exists():
                for line in env_file.read_text().splitlines():
                    key, _, value = line.partition("=")
                    if key:
                        saved[key] = value
            before = dict(saved)
            for key, make in (
                ("LLAMAFLEET_SECRET_KEY", lambda: secrets.token_urlsafe(48)),
                ("LLAMAFLEET_NODE_TOKEN", lambda: secrets.token_urlsafe(32)),
                ("LLAMAFLEET_METRICS_TOKEN", lambda: secrets.token_urlsafe(32)),
                ("LLAMAFLEET_BOOTSTRAP_KEY", lambda: "lf-" + secrets.token_urlsafe(32)),
            ):
                if os.environ.get(key):
                    saved[key] = os.environ[key]
                saved.setdefault(key, make())
            if saved != before:
                # Created 0600 from the start: no moment where another user could read the
                # secrets; renamed over the old file, so no reader sees it half written.
                part = env_file.with_name("env.part")
                fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.fchmod(fd, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write("".join(f"{k}={v}\n" for k, v in sorted(saved.items())))
                os.replace(part, env_file)
        env = dict(os.environ) | saved | self._local_pki()
        env.setdefault("LLAMAFLEET_VAR_DIR", str(self.var))
        env.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
        env["LLAMAFLEET_PUBLIC_URL"] = f"http://127.0.0.1:{self.port}"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _local_pki(self) -> dict[str, str]:
        """A cluster CA in var/pki and one certificate (127.0.0.1, localhost) for the control
        plane and the agent: gRPC between them is mutual TLS, as on a real cluster."""
        from workers import tls

        pki = self.var / "pki"
        tls.make_ca(pki)
        if not (pki / "local.pem").exists():
            tls.issue(pki, "local", ["127.0.0.1", "localhost", "::1"])
        return {
            "LLAMAFLEET_TLS_CA": str(pki / "ca.pem"),
            "LLAMAFLEET_TLS_CERT": str(pki / "local.pem"),
            "LLAMAFLEET_TLS_KEY": str(pki / "local-key.pem"),
        }

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- processes -----------------------------------------------------------------

    def pid(self, name: str) -> int | None:
        path = self.run_dir / f"{name}.pid"
        try:
            pid = int(path.read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return None if _exited(pid) else pid

    def start(self, name: str, argv: list[str]) -> None:
        if self.pid(name):
            print(f"  {name}: already running (pid {self.pid(name)})")
            return
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        (self.run_dir / f"{name}.pid").write_text(str(proc.pid))
        # What the supervisor starts again if it exits; removed by stop().
        (self.run_dir / f"{name}.argv").write_text(json.dumps(argv))
        print(f"  {name}: started (pid {proc.pid}, log {self.log_dir / (name + '.log')})")

    def stop(self, name: str) -> None:
        pid = self.pid(name)
        if pid:
            try:
                os.killpg(pid, signal.SIGTERM)
            except OSError:
                os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                time.sleep(0.1)
                if not self.pid(name):
                    break
            else:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            print(f"  {name}: stopped")
        (self.run_dir / f"{name}.pid").unlink(missing_ok=True)
        (self.run_dir / f"{name}.argv").unlink(missing_ok=True)

    # ---- supervision ---------------------------------------------------------------

    def restart_exited(self, state: dict[str, tuple[float, float]], now: float) -> list[str]:
        """Start again every process that exited without stop(); returns their names.

        state: name -> (time of its last start, its current back-off), kept by the caller.
        A process that ran less than MIN_UPTIME waits its back-off, doubled each time,
        before the next start; one that ran longer starts again at once.
        """
        restarted = []
        for argv_file in sorted(self.run_dir.glob("*.argv")):
            name = argv_file.stem
            if name == SUPERVISOR or self.pid(name):
                continue
            started, backoff = state.get(name, (float("-inf"), 0.0))
            if now - started < MIN_UPTIME:  # it exited soon after its last start
                backoff = min(max(2 * backoff, 1.0), MAX_BACKOFF)
                if now - started < backoff:
                    continue  # backing off
            else:
                backoff = 0.0
            try:
                argv = json.loads(argv_file.read_text())
            except (OSError, ValueError):
                continue  # stopped meanwhile
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {name} exited; starting it again")
            (self.run_dir / f"{name}.pid").unlink(missing_ok=True)
            self.start(name, argv)
            state[name] = (now, backoff)
            restarted.append(name)
        return restarted

    def supervisor(self) -> None:
        """The process that runs supervise() over this stack."""
        argv = [PY, str(ROOT / "scripts/stack.py"), "supervise", "--var", str(self.var)]
        self.start(SUPERVISOR, argv)

    def supervise(self) -> None:
        """Until SIGTERM (from `down`): start again what exits, every SUPERVISE_SECONDS."""
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        state: dict[str, tuple[float, float]] = {}
        while not stopping:
            self.restart_exited(state, time.monotonic())
            time.sleep(SUPERVISE_SECONDS)

    def manage(self, *args: str, quiet: bool = False) -> None:
        out = subprocess.DEVNULL if quiet else None
        proc = subprocess.run([PY, "manage.py", *args], cwd=ROOT, env=self.env, stdout=out)
        if proc.returncode:
            sys.exit(f"manage.py {' '.join(args)} failed (exit {proc.returncode})")

    # ---- redis ---------------------------------------------------------------------

    def ensure_redis(self) -> None:
        url = urlparse(self.env["REDIS_URL"])
        host, port = url.hostname or "127.0.0.1", url.port or 6379
        if _redis_answers(host, port):
            print(f"  redis: reachable at {host}:{port}")
            return
        if host not in ("127.0.0.1", "localhost", "::1"):
            sys.exit(f"Redis at {host}:{port} does not answer, and it is not local to start it.")
        server = shutil.which("redis-server")
        if not server:
            sys.exit(
                "No Redis answers at REDIS_URL and redis-server is not installed "
                "(apt-get install redis-server, or point REDIS_URL at one)."
            )
        self.start(
            "redis",
            [
                server,
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.var),
            ],
        )
        _wait(lambda: _redis_answers(host, port), 10, "redis")

    # ---- the whole thing -----------------------------------------------------------

    def web(self, proc: str = "web", port: int | None = None) -> None:
        """A web process (uvicorn): the machine's port by default; more for tests."""
        self.start(
            proc,
            [
                PY,
                "-m",
                "uvicorn",
                "controlplane.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(port or self.port),
                "--no-access-log",
                # SIGTERM: open streams finish for up to 8 s (within the 10 s `stop` waits),
                # then pending usage records are written (controlplane.asgi.lifespan).
                "--timeout-graceful-shutdown",
                "8",
                "--log-level",
                "warning",  # uvicorn logs websocket URLs at info, query-string keys included
            ],
        )

    def control_plane(self) -> None:
        """The web process, the Celery worker and beat (no agent, nothing deployed)."""
        self.web()
        self.start(
            "worker",
            [
                PY,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "-Q",
                "liveness,control,jobs",
                "-c",
                "2",
                "-n",
                f"worker-{self.port}@%h",
                "--loglevel",
                "INFO",
            ],
        )
        self.start(
            "beat",
            [
                PY,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "beat",
                "--loglevel",
                "INFO",
                "-s",
                str(self.var / "celerybeat-schedule"),
            ],
        )

    def agent(
        self,
        proc: str = "agent",
        name: str = "",
        port: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        """A node agent (the machine's own by default; others for tests of several nodes)."""
        self.start(
            proc,
            [
                PY,
                "-m",
                "workers",
                "agent",
                "--name",
                name or socket.gethostname(),
                "--listen",
                f"127.0.0.1:{port or self.agent_port}",
                "--control-plane",
                self.url,
                "--models-dir",
                str(self.var / ("models" if proc == "agent" else f"models-{proc}")),
                "--metrics-listen",
                f"127.0.0.1:{metrics_port or self.metrics_port}",
                "--drain-seconds",  # within the 10 s `stop` waits before SIGKILL
                "8",
            ],
        )

    def up(self, model: str, wait: float) -> None:
        print("Starting LlamaFleet:")
        check = subprocess.run([PY, "scripts/check_engine.py"], cwd=ROOT)
        if check.returncode:
            sys.exit(1)
        self.ensure_redis()
        self.manage("migrate", "-v0")
        key = self.env["LLAMAFLEET_BOOTSTRAP_KEY"]
        self.manage("create_api_key", "bootstrap", "--key", key, quiet=True)
        self.control_plane()
        self.agent()
        _wait(lambda: _http_ok(self.url + "/healthz"), 60, "web")
        # Deploy only once the agent has reported: its first report after a restart is what
        # tells the control plane that replicas it held before are gone.
        started = time.time()
        node_url = f"{self.url}/api/v1/nodes/{socket.gethostname()}/"
        _wait(lambda: _heartbeat_after(node_url, key, started), 60, "agent registration")
        print(f"Pulling {model}:")
        self.manage("pull_model", model, "--if-missing")
        print(f"Deploying {model}:")
        self.manage("deploy", model, "--wait", str(wait))
        if self.env.get("LLAMAFLEET_SUPERVISE", "1") != "0":
            self.supervisor()
        print(f"""
LlamaFleet is up at {self.url}
  API key:   {key}
  Console:   {self.url}/console/   (create a staff login: make superuser)
  API docs:  {self.url}/api/v1/docs
  Admin:     {self.url}/admin/

Try it:
  curl -N {self.url}/v1/chat/completions \\
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "stream": true,
         "messages": [{{"role": "user", "content": "Say hello in five words."}}]}}'

Stop it with: make stop""")

    def processes(self) -> list[str]:
        """Every process this stack started (more agents or web processes a test added
        included), in the order they stop: agents first (they drain), Redis last."""
        names = {p.stem for p in self.run_dir.glob("*.pid")} | set(PROCESSES)
        order = (SUPERVISOR, *PROCESSES[::-1])  # the supervisor first: it restarts the rest
        return sorted(
            names, key=lambda n: (next(i for i, o in enumerate(order) if n.startswith(o)), n)
        )

    def down(self) -> None:
        print("Stopping LlamaFleet:")
        for name in self.processes():
            self.stop(name)

    def status(self) -> None:
        for name in self.processes():
            pid = self.pid(name)
            print(f"  {name:10s} {f'running (pid {pid})' if pid else 'stopped'}")


def _exited(pid: int) -> bool:
    """A process that has exited but not been reaped (a zombie still answers kill 0): the
    supervisor's own children, or a test's. Reaped here when it is ours."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] != "Z":
                return False
    except OSError:  # gone meanwhile, or no /proc: kill 0 said it runs
        return not os.path.exists(f"/proc/{pid}") and os.path.isdir("/proc")
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # another process's child: its parent reaps it
        pass
    return True


def _redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _heartbeat_after(url: str, key: str, since: float) -> bool:
    from datetime import datetime

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as resp:
            last = json.load(resp).get("last_heartbeat_at")
    except (OSError, ValueError):
        return False
    return bool(last) and datetime.fromisoformat(last.replace("Z", "+00:00")).timestamp() >= since


def _wait(ready, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    sys.exit(f"{what} did not come up within {seconds:.0f} s; see its log under var/log/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "supervise"])
    parser.add_argument(
        "--model", default=os.environ.get("LLAMAFLEET_DEFAULT_MODEL", DEFAULT_MODEL)
    )
    parser.add_argument("--wait", type=float, default=300)
    parser.add_argument("--var", help="the stack's var directory (default: LLAMAFLEET_VAR_DIR)")
    args = parser.parse_args()
    var = Path(args.var or os.environ.get("LLAMAFLEET_VAR_DIR", ROOT / "var")).resolve()
    stack = Stack(
        var,
        port=int(os.environ.get("PORT", "8000")),
        agent_port=int(os.environ.get("LLAMAFLEET_AGENT_PORT", "50051")),
        metrics_port=int(os.environ.get("LLAMAFLEET_AGENT_METRICS_PORT", "9464")),
    )
    if args.command == "up":
        stack.up(args.model, args.wait)
    elif args.command == "down":
        stack.down()
    elif args.command == "supervise":
        stack.supervise()
    else:
        stack.status()


if __name__ == "__main__":
    main()
