"""The control plane at fleet scale: simulated agents against the real web process, Celery
worker and beat, PostgreSQL and Redis.

    python bench/fleet.py [--nodes 1000] [--deployments 200] [--replicas 25] [--steady 60]

Each simulated node is its own gRPC server on its own port speaking the real NodeAgent
contract (GetStatus, LoadModel, FreeMemory; a load "succeeds" at once and holds nothing), and
reports to the real heartbeat API every LLAMAFLEET_HEARTBEAT_SECONDS with the replicas it
was given, as an agent does. All of them run in this process (asyncio), beside the stack, on
the same cores: every figure is a floor of what dedicated machines would give.

Measured and written to bench/results/fleet.json:
- deploying: every deployment through the REST API until every replica is ready;
- heartbeats one web process absorbs: at the default interval (steady), then as fast as 64
  concurrent senders can (capacity), with latencies;
- database writes per minute at steady state (pg_stat_database);
- sweep and reconcile times (the Celery worker's task times);
- a routing decision's p99 (the web path's ready_rows + balancer.order, in this process,
  against the same database and Redis);
- a node killed (heartbeats and gRPC stop): time from its deadline to its replicas leaving
  routing.

Needs PostgreSQL (a database llamafleet_fleet is dropped and made afresh) and Redis (database
12), and the test model cache (run `make test` once): the catalog model is SmolLM2's file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "proto")]
from llamafleet.agent.v1 import agent_pb2 as pb  # noqa: E402
from llamafleet.agent.v1 import agent_pb2_grpc  # noqa: E402

OUT = ROOT / "bench/results/fleet.json"
VAR = ROOT / "var/bench-fleet"
DB = "llamafleet_fleet"
PG = "postgres://postgres@127.0.0.1:5432"
MODEL = "smollm2-135m-instruct"
GiB = 1 << 30


def pctl(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ---- simulated agents --------------------------------------------------------------------


class SimNode(agent_pb2_grpc.NodeAgentServicer):
    """One node: a gRPC server of its own, replicas that load at once, heartbeats."""

    def __init__(self, name: str):
        self.name = name
        self.replicas: dict[str, str] = {}  # id -> model name
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.boot_id = os.urandom(8).hex()
        self.alive = True
        self._body: bytes | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server()
        agent_pb2_grpc.add_NodeAgentServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"

    async def kill(self) -> None:
        self.alive = False
        await self.server.stop(None)

    def status(self) -> pb.NodeStatus:
        return pb.NodeStatus(
            node_name=self.name,
            version="sim",
            memory_total_bytes=64 * GiB,
            memory_available_bytes=64 * GiB - len(self.replicas) * GiB // 2,
            cpu_cores=32,
            replicas=[
                pb.ReplicaStatus(
                    replica_id=rid,
                    model_name=m,
                    state=pb.REPLICA_STATE_READY,
                    memory_bytes=GiB // 2,
                    context_length=512,
                    parallel=4,
                )
                for rid, m in self.replicas.items()
            ],
            memory_in_use_bytes=len(self.replicas) * GiB // 2,
            disk_free_bytes=500 * GiB,
            boot_id=self.boot_id,
        )

    async def GetStatus(self, request, context):
        return self.status()

    async def LoadModel(self, request, context):
        self.replicas[request.replica_id] = request.model_name
        self._body = None
        return pb.LoadModelResponse(
            state=pb.REPLICA_STATE_READY, memory_bytes=GiB // 2, load_seconds=0.01
        )

    async def FreeMemory(self, request, context):
        self._body = None
        return pb.FreeMemoryResponse(freed=self.replicas.pop(request.replica_id, None) is not None)

    def payload(self) -> dict:
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(
            self.status(),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        ) | {"address": self.address}

    def body(self) -> bytes:
        """The report as sent, made again only when the replicas change (the simulator must
        cost less per heartbeat than the server it measures)."""
        if self._body is None:
            self._body = json.dumps(self.payload()).encode()
        return self._body


class RawPoster:
    """Keep-alive HTTP/1.1 POSTs over asyncio streams, a pool of connections: an HTTP client
    library costs more per request than the heartbeat lane it would measure."""

    def __init__(self, url: str, path: str, token: str, connections: int = 32):
        u = httpx.URL(url)
        self.host, self.port, self.path, self.token = u.host, u.port, path, token
        self.free: asyncio.Queue = asyncio.Queue()
        for _ in range(connections):
            self.free.put_nowait(None)  # opened on first use

    async def post(self, body: bytes) -> int:
        conn = await self.free.get()
        try:
            if conn is None:
                conn = await asyncio.open_connection(self.host, self.port)
            reader, writer = conn
            writer.write(
                f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            await reader.readexactly(length)
            return status
        except (OSError, asyncio.IncompleteReadError, ValueError, AttributeError):
            if conn is not None:
                conn[1].close()
            conn = None
            return 0
        finally:
            self.free.put_nowait(conn)


class Heartbeats:
    """Every node reports every `interval` seconds (phases spread at random), as agents do."""

    def __init__(self, nodes: list[SimNode], url: str, token: str, interval: float):
        self.nodes, self.interval = nodes, interval
        self.poster = RawPoster(url, "/api/v1/agent/heartbeat", token)
        self.latencies: list[float] = []
        self.errors = 0
        self.sent = 0
        self.running = True

    async def one(self, node: SimNode) -> None:
        began = time.perf_counter()
        ok = await self.poster.post(node.body()) == 200
        self.sent += 1
        if ok:
            self.latencies.append(time.perf_counter() - began)
        else:
            self.errors += 1

    async def node_loop(self, node: SimNode) -> None:
        await asyncio.sleep(random.uniform(0, self.interval))
        while self.running and node.alive:
            began = time.monotonic()
            await self.one(node)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - began)))

    def reset(self) -> None:
        self.latencies, self.errors, self.sent = [], 0, 0

    def figures(self, seconds: float) -> dict:
        return {
            "sent": self.sent,
            "per_second": round(len(self.latencies) / seconds, 1),
            "errors": self.errors,
            "latency_p50_ms": round(pctl(self.latencies, 0.5) * 1000, 1),
            "latency_p99_ms": round(pctl(self.latencies, 0.99) * 1000, 1),
        }


async def capacity(hb: Heartbeats, nodes: list[SimNode], seconds: float, senders: int) -> dict:
    """Heartbeats as fast as `senders` concurrent clients can send them."""
    hb.reset()
    end = time.monotonic() + seconds

    async def sender(k: int):
        i = k
        while time.monotonic() < end:
            await hb.one(nodes[i % len(nodes)])
            i += senders

    began = time.monotonic()
    await asyncio.gather(*(sender(k) for k in range(senders)))
    return hb.figures(time.monotonic() - began)


# ---- the stack -----------------------------------------------------------------------------


def fresh_database() -> None:
    import psycopg

    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB}")


def db_counters() -> dict:
    import psycopg

    with psycopg.connect(f"{PG}/{DB}", autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted "
            "FROM pg_stat_database WHERE datname = %s",
            (DB,),
        ).fetchone()
    return dict(zip(("commits", "inserted", "updated", "deleted"), row, strict=True))


def task_times(log: Path, since: int) -> dict:
    """Per task name: count, p50 and max seconds, from the worker's log after byte `since`."""
    pattern = re.compile(r"Task ([\w.]+)\[[\w-]+\] succeeded in ([\d.e-]+)s")
    times: dict[str, list[float]] = {}
    with open(log, "rb") as f:
        f.seek(since)
        for line in f.read().decode(errors="replace").splitlines():
            m = pattern.search(line)
            if m:
                times.setdefault(m.group(1).rsplit(".", 1)[-1], []).append(float(m.group(2)))
    return {
        k: {"count": len(v), "p50_s": round(pctl(v, 0.5), 4), "max_s": round(max(v), 4)}
        for k, v in sorted(times.items())
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children that were waited for."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def setup_django(env: dict) -> None:
    os.environ.update(
        {k: v for k, v in env.items() if k.startswith(("LLAMAFLEET_", "DATABASE_", "REDIS_"))}
    )
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import logging

    import django

    django.setup()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per heartbeat otherwise


async def wait_healthy(url: str) -> None:
    async with httpx.AsyncClient(timeout=1) as client:
        for _ in range(300):
            try:
                if (await client.get(url + "/healthz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise SystemExit("the web process did not start: see var/bench-fleet/log/web.log")


def clone_models(n: int) -> None:
    from apps.catalog.models import CatalogModel

    src = CatalogModel.objects.get(name=MODEL)
    files = list(src.files.all())
    for i in range(n):
        m = CatalogModel.objects.get(pk=src.pk)
        m.pk, m.name = None, f"m{i:03d}"
        m.save()
        for f in files:
            f.pk, f.model = None, m
            f.save()


async def routing_p99(n: int) -> dict:
    """One routing decision as the web process makes it: the cached table of ready replicas,
    then one Redis round trip to order them (least connections), over a deployment of the
    fleet. In this process, against the same database and Redis."""
    from apps.serving import routing_table
    from apps.serving.services import ready_targets

    times = []
    misses = []
    for i in range(n):
        if i % 1000 == 0:
            routing_table.invalidate()  # a change: the next decision reads the table afresh
            began = time.perf_counter()
            await ready_targets("m000")
            misses.append(time.perf_counter() - began)
            continue
        began = time.perf_counter()
        targets = await ready_targets("m000")
        times.append(time.perf_counter() - began)
    return {
        "decisions": len(times),
        "ready_replicas_of_the_model": len(targets),
        "p50_ms": round(pctl(times, 0.5) * 1000, 3),
        "p99_ms": round(pctl(times, 0.99) * 1000, 3),
        "table_reload_p50_ms": round(pctl(misses, 0.5) * 1000, 2),
    }


async def run(args) -> dict:
    from stack import Stack

    random.seed(1)
    fresh_database()
    VAR.mkdir(parents=True, exist_ok=True)
    port = 8471
    os.environ.update(
        DATABASE_URL=f"{PG}/{DB}",
        REDIS_URL="redis://127.0.0.1:6379/12",
        LLAMAFLEET_HEARTBEAT_SECONDS=str(args.heartbeat),
    )
    stack = Stack(VAR, port, 0)
    for k in ("LLAMAFLEET_TLS_CA", "LLAMAFLEET_TLS_CERT", "LLAMAFLEET_TLS_KEY"):
        stack.env.pop(k)  # the simulated agents listen on loopback, in plaintext
    for log in stack.log_dir.glob("*.log"):
        log.unlink()
    import redis

    redis.Redis.from_url(stack.env["REDIS_URL"]).flushdb()
    stack.manage("migrate", "-v0")
    key = stack.env["LLAMAFLEET_BOOTSTRAP_KEY"]
    stack.manage("create_api_key", "bootstrap", "--key", key, quiet=True)
    from apps.catalog.sources import KNOWN_MODELS

    cached = ROOT / f"var/test-cache/sha256-{KNOWN_MODELS[MODEL].sha256}.gguf"
    if not cached.exists():
        sys.exit(f"{cached} is missing: run `make test` once (it fetches SmolLM2)")
    stack.manage("pull_model", MODEL, "--path", str(cached), quiet=True)
    stack.control_plane()
    url = stack.url
    await wait_healthy(url)
    result: dict = {
        "nodes": args.nodes,
        "deployments": args.deployments,
        "replicas": args.deployments * args.replicas,
        "heartbeat_interval_s": args.heartbeat,
        "machine": f"{os.cpu_count()} cores, shared by the stack, PostgreSQL, Redis and the "
        "simulated agents",
    }
    try:
        nodes = [SimNode(f"sim-{i:04d}") for i in range(args.nodes)]
        began = time.monotonic()
        for n in nodes:
            await n.start()
        print(f"{len(nodes)} simulated agents listening ({time.monotonic() - began:.1f} s)")
        hb = Heartbeats(nodes, url, stack.env["LLAMAFLEET_NODE_TOKEN"], args.heartbeat)
        began = time.monotonic()
        await asyncio.gather(*(hb.one(n) for n in nodes))
        if hb.errors:  # timed out under the rush: once more, as an agent would
            hb.errors = 0
            await asyncio.gather(*(hb.one(n) for n in nodes))
        result["registration_s"] = round(time.monotonic() - began, 1)
        print(f"registered in {result['registration_s']} s ({hb.errors} errors)")
        loops = [asyncio.create_task(hb.node_loop(n)) for n in nodes]

        # One catalog model per deployment (the same file under other names), then deploy
        # through the API and wait for every replica to be ready.
        setup_django(stack.env)
        from asgiref.sync import sync_to_async

        from apps.deployments.models import Replica

        await sync_to_async(clone_models)(args.deployments)
        api = httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        began = time.monotonic()
        for i in range(args.deployments):
            r = await api.post(
                "/api/v1/deployments/",
                json={"model": f"m{i:03d}", "name": f"d{i:03d}", "replicas": args.replicas,
                      "context_length": 512, "parallel": 4},
            )  # fmt: skip
            assert r.status_code == 202, r.text

        target = args.deployments * args.replicas
        count = sync_to_async(lambda: Replica.objects.filter(state="ready").count())
        ready = 0
        while time.monotonic() - began < args.deploy_timeout:
            ready = await count()
            if ready >= target:
                break
            await asyncio.sleep(1)
        result["deploy"] = {
            "ready_replicas": ready,
            "seconds": round(time.monotonic() - began, 1),
        }
        print(f"deployed: {ready}/{target} replicas ready in {result['deploy']['seconds']} s")

        # Steady state at the default interval.
        worker_log = stack.log_dir / "worker.log"
        log_at = worker_log.stat().st_size
        db0, web0 = db_counters(), cpu_seconds(stack.pid("web"))
        hb.reset()
        began = time.monotonic()
        await asyncio.sleep(args.steady)
        seconds = time.monotonic() - began
        db1, web1 = db_counters(), cpu_seconds(stack.pid("web"))
        result["steady"] = hb.figures(seconds) | {
            "expected_per_second": round(args.nodes / args.heartbeat, 1),
            "web_cpu_share": round((web1 - web0) / seconds, 2),
            "db_per_minute": {k: round((db1[k] - db0[k]) * 60 / seconds) for k in db0},
            "worker_tasks": task_times(worker_log, log_at),
        }
        print("steady:", json.dumps(result["steady"]))

        # Routing decisions, over the fleet's table, in a process of their own (this one's
        # loop is busy with a thousand agents), while the heartbeats go on.
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, __file__, "--routing", str(args.decisions)],
            env=os.environ | stack.env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        result["routing"] = json.loads(out.stdout.strip().splitlines()[-1])
        print("routing:", result["routing"])

        # A node dies: time from its deadline to its replicas leaving routing.
        from django.conf import settings

        from apps.nodes.models import Node

        victim = max(nodes, key=lambda n: len(n.replicas))
        held = len(victim.replicas)
        last = sync_to_async(
            lambda: (
                Node.objects.filter(name=victim.name)
                .values_list("last_heartbeat_at", "state")
                .get()
            )
        )
        await victim.kill()
        killed_at = time.time()
        while True:
            beat_at, state = await last()
            if state != "ready":
                out_at = time.time()
                break
            await asyncio.sleep(0.05)
        deadline = beat_at.timestamp() + settings.HEARTBEAT_TIMEOUT_SECONDS
        # The web process may route from its table for up to ROUTING_CACHE_SECONDS more.
        result["dead_node"] = {
            "replicas_held": held,
            "silent_for_s": round(out_at - killed_at, 1),
            "after_deadline_s": round(out_at - deadline, 2),
            "plus_routing_cache_s": settings.ROUTING_CACHE_SECONDS,
        }
        print("dead node:", result["dead_node"])

        # Capacity: heartbeats as fast as 64 senders manage (the periodic ones keep going).
        hb.running = False
        for t in loops:
            t.cancel()
        web0 = cpu_seconds(stack.pid("web"))
        alive = [n for n in nodes if n.alive]
        result["capacity"] = await capacity(hb, alive, args.capacity_seconds, 64)
        result["capacity"]["web_cpu_share"] = round(
            (cpu_seconds(stack.pid("web")) - web0) / args.capacity_seconds, 2
        )
        result["capacity"]["headroom_x"] = round(
            result["capacity"]["per_second"] / (args.nodes / args.heartbeat), 2
        )
        print("capacity:", result["capacity"])
        await api.aclose()
    finally:
        for name in ("beat", "worker", "web"):
            stack.stop(name)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--deployments", type=int, default=200)
    p.add_argument("--replicas", type=int, default=25, help="per deployment")
    p.add_argument("--heartbeat", type=float, default=5.0, help="seconds between heartbeats")
    p.add_argument("--steady", type=float, default=60.0, help="seconds of steady state")
    p.add_argument("--capacity-seconds", type=float, default=20.0)
    p.add_argument("--decisions", type=int, default=20000)
    p.add_argument("--deploy-timeout", type=float, default=1800.0)
    p.add_argument("--routing", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.routing:  # the child that measures routing decisions
        setup_django(dict(os.environ))
        import gc

        gc.freeze()  # as controlplane/asgi.py does in the web process
        print(json.dumps(asyncio.run(routing_p99(args.routing))))
        return
    result = asyncio.run(run(args))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {OUT}")


if __name__ == "__main__":
    main()
