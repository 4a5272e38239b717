"""Database queries made by open consoles, with the fleet idle and with the fleet changing.

    python bench/console.py [--consoles 10] [--seconds 20] [--out bench/results/console.json]

The real ASGI application under uvicorn, in this process, on a database of its own (a new
PostgreSQL database beside DATABASE_URL's, or SQLite), with a small fleet: 4 nodes, 2
models, 2 deployments of 2 replicas. `--consoles` websocket clients log in as an operator
and keep the dashboard open. Every query any thread of this process sends is counted by a
wrapper on each database connection, apart from those of the thread that changes the fleet.
Two phases of `--seconds` each:
- idle: nothing changes;
- changing: one node's free memory changes once a second (as a heartbeat would change it).
It also measures how long a change takes to reach every console. Run it on two commits to
compare them (the console's code is all that differs); the JSON keeps one run per label.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))


def _database() -> str:
    """A fresh database for this run; returns its URL."""
    url = os.environ.get("DATABASE_URL", "")
    if url.startswith("postgres"):
        import psycopg

        name = f"lf_bench_console_{os.getpid()}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return url.rsplit("/", 1)[0] + "/" + name
    return "sqlite:///" + tempfile.mkdtemp(prefix="lf-bench-console-") + "/db.sqlite3"


def _drop(url: str, admin_url: str) -> None:
    if url.startswith("postgres"):
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Counter:
    """Queries per thread kind, counted by a wrapper on every connection of this process."""

    def __init__(self):
        self.lock = threading.Lock()
        self.count = 0
        self.writer = None  # the thread that changes the fleet: not counted

    def __call__(self, execute, sql, params, many, context):
        if threading.current_thread() is not self.writer:
            with self.lock:
                self.count += 1
        return execute(sql, params, many, context)


def fleet() -> None:
    from apps.catalog.models import CatalogModel
    from apps.deployments.models import Deployment, Replica
    from apps.nodes.models import Node

    nodes = [
        Node.objects.create(
            name=f"n{i}", address=f"10.0.0.{i}:50051", state=Node.State.READY,
            memory_total_bytes=16 << 30, memory_available_bytes=12 << 30, cpu_cores=8,
        )
        for i in range(4)
    ]  # fmt: skip
    for k in range(2):
        m = CatalogModel.objects.create(
            name=f"model-{k}", source="bench", state=CatalogModel.State.READY,
            size_bytes=100 << 20, n_layers=30, context_length=2048,
        )  # fmt: skip
        d = Deployment.objects.create(
            name=f"chat-{k}", model=m, replicas=2, context_length=2048, parallel=4,
            state=Deployment.State.READY,
        )  # fmt: skip
        for n in nodes[2 * k : 2 * k + 2]:
            Replica.objects.create(deployment=d, node=n, state=Replica.State.READY)


async def consoles(port: int, cookie: str, n: int, phases: list[tuple[str, float]], change):
    """Open n dashboards; per phase, the queries counted and each change's arrival times."""
    import websockets

    headers = {"Cookie": f"sessionid={cookie}", "Origin": f"http://127.0.0.1:{port}"}
    socks = [
        await websockets.connect(f"ws://127.0.0.1:{port}/ws/v1/console", additional_headers=headers)
        for _ in range(n)
    ]
    arrivals: dict[int, list[float]] = {}
    marker = {"value": None, "sent_at": 0.0}

    async def read(ws):
        async for raw in ws:
            msg = json.loads(raw)
            snap = msg.get("delta", msg)
            for node in snap.get("nodes") or ():
                if node["name"] == "n0" and node["memory_available_bytes"] == marker["value"]:
                    arrivals.setdefault(marker["value"], []).append(
                        time.monotonic() - marker["sent_at"]
                    )

    readers = [asyncio.create_task(read(ws)) for ws in socks]
    await asyncio.sleep(3.0)  # every console has its snapshot and the charts' hour
    out = {}
    for name, seconds in phases:
        before = COUNTER.count
        started = time.monotonic()
        changes = 0
        while time.monotonic() - started < seconds:
            if name == "changing":
                marker["value"] = (12 << 30) - changes - 1
                marker["sent_at"] = time.monotonic()
                await asyncio.to_thread(change, marker["value"])
                changes += 1
            await asyncio.sleep(1.0)
        await asyncio.sleep(1.5 if name == "changing" else 0)  # the last change arrives
        elapsed = time.monotonic() - started
        queries = COUNTER.count - before
        latencies = sorted(max(v) for v in arrivals.values() if len(v) == n)
        out[name] = {
            "seconds": round(elapsed, 1),
            "queries": queries,
            "queries_per_s": round(queries / elapsed, 2),
            "changes": changes,
            "queries_per_change": round(queries / changes, 2) if changes else None,
        }
        if changes:
            out[name]["changes_seen_by_every_console"] = len(latencies)
            out[name]["median_ms_to_every_console"] = (
                round(1000 * latencies[len(latencies) // 2], 1) if latencies else None
            )
        arrivals.clear()
    for r in readers:
        r.cancel()
    for ws in socks:
        await ws.close()
    return out


COUNTER = Counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--consoles", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", default=str(ROOT / "bench/results/console.json"))
    args = ap.parse_args()

    admin_url = os.environ.get("DATABASE_URL", "")
    url = _database()
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("LLAMAFLEET_SECRET_KEY", "bench")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    try:
        run(args, url)
    finally:
        from django.db import connections

        connections.close_all()
        _drop(url, admin_url)


def run(args, url: str) -> None:
    import django

    django.setup()
    import uvicorn
    from django.contrib.auth import get_user_model
    from django.contrib.sessions.backends.db import SessionStore
    from django.core.management import call_command
    from django.db import connection
    from django.db.backends.signals import connection_created

    call_command("migrate", verbosity=0)
    fleet()
    user = get_user_model().objects.create_user("ops", password="bench-password-1", is_staff=True)
    session = SessionStore()
    session["_auth_user_id"] = str(user.pk)
    session["_auth_user_backend"] = "django.contrib.auth.backends.ModelBackend"
    session["_auth_user_hash"] = user.get_session_auth_hash()
    session.create()

    def hook(sender, connection, **kwargs):
        if COUNTER not in connection.execute_wrappers:
            connection.execute_wrappers.append(COUNTER)

    connection_created.connect(hook)
    connection.close()  # from here on every connection (re)opens with the counter

    def change(value: int) -> None:
        from apps.nodes.models import Node

        COUNTER.writer = threading.current_thread()
        Node.objects.filter(name="n0").update(memory_available_bytes=value)

    from controlplane.asgi import application

    port = 18000 + os.getpid() % 1000
    server = uvicorn.Server(
        uvicorn.Config(application, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    phases = [("idle", args.seconds), ("changing", args.seconds)]
    result = asyncio.run(consoles(port, session.session_key, args.consoles, phases, change))
    server.should_exit = True
    thread.join(10)
    result.update(consoles=args.consoles, database=url.split(":", 1)[0])
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.exists() else {}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    saved[args.label] = {**result, "measured_at": stamp}
    out.write_text(json.dumps(saved, indent=1) + "\n")
    print(json.dumps(saved[args.label], indent=1))


if __name__ == "__main__":
    main()
