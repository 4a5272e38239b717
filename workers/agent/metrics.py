"""Prometheus metrics of one agent: prometheus_client's ASGI app behind the scrape-only token.

Each agent has its own registry (several agents may share a process in tests). Gauges of
what the replicas hold are read at scrape time; counters move as generations end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, make_asgi_app
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)


class AgentMetrics:
    """Counters updated by the service, gauges collected from it on each scrape."""

    def __init__(self, service):
        self.registry = CollectorRegistry(auto_describe=True)
        self.generations = Counter(
            "llamafleet_agent_generations",
            "Generations that ended, by replica and finish reason (or error code).",
            ["replica", "model", "outcome"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "llamafleet_agent_completion_tokens",
            "Tokens generated.",
            ["replica", "model"],
            registry=self.registry,
        )
        self.prompt_cache_hits = Counter(
            "llamafleet_agent_prompt_cache_hits",
            "Generations that reused a cached prompt prefix.",
            ["replica", "model"],
            registry=self.registry,
        )
        self.prompt_cache_tokens = Counter(
            "llamafleet_agent_prompt_cache_tokens",
            "Prompt tokens taken from the cache instead of being evaluated.",
            ["replica", "model"],
            registry=self.registry,
        )
        self.prompt_cache_host_hits = Counter(
            "llamafleet_agent_prompt_cache_host_hits",
            "Generations whose cached prefix was restored from host RAM (it had been pushed "
            "out of the slots).",
            ["replica", "model"],
            registry=self.registry,
        )
        self.prompt_cache_host_tokens = Counter(
            "llamafleet_agent_prompt_cache_host_tokens",
            "Prompt tokens restored from host RAM instead of being evaluated.",
            ["replica", "model"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "llamafleet_agent_prompt_tokens",
            "Prompt tokens of generations that ended (cached ones included).",
            ["replica", "model"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "llamafleet_agent_time_to_first_token_seconds",
            "From the agent handing a request to its engine to its first token (the wait for "
            "the step in progress and for a slot included).",
            ["model"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 1, 2, 5, 10, 30),
            registry=self.registry,
        )
        self.tokens_per_second = Histogram(
            "llamafleet_agent_decode_tokens_per_second",
            "Decode speed of one generation after its first token.",
            ["model"],
            buckets=(1, 5, 10, 20, 40, 60, 80, 100, 130, 160, 200, 300),
            registry=self.registry,
        )
        self.registry.register(_ReplicaCollector(service))

    def finished(self, replica_id: str, model: str, reason: str, usage: dict, timings: dict):
        self.generations.labels(replica_id, model, reason).inc()
        n = usage.get("completion_tokens", 0)
        self.tokens.labels(replica_id, model).inc(n)
        self.prompt_tokens.labels(replica_id, model).inc(usage.get("prompt_tokens", 0))
        cached = usage.get("cached_tokens", 0)
        if cached:
            self.prompt_cache_hits.labels(replica_id, model).inc()
            self.prompt_cache_tokens.labels(replica_id, model).inc(cached)
        restored = usage.get("host_cached_tokens", 0)
        if restored:
            self.prompt_cache_host_hits.labels(replica_id, model).inc()
            self.prompt_cache_host_tokens.labels(replica_id, model).inc(restored)
        if n:
            self.time_to_first_token.labels(model).observe(timings["time_to_first_token"])
        if n > 1 and timings["decode_seconds"] > 0:
            self.tokens_per_second.labels(model).observe((n - 1) / timings["decode_seconds"])

    def failed(self, replica_id: str, model: str, code: str):
        self.generations.labels(replica_id, model, code.lower()).inc()


class _ReplicaCollector:
    """In-flight, queued, memory, state and threads of each replica, as they are now."""

    def __init__(self, service):
        self.service = service

    def describe(self):
        return []

    def collect(self):
        in_flight = GaugeMetricFamily(
            "llamafleet_agent_in_flight", "Generations on the replica.", labels=["replica", "model"]
        )
        queued = GaugeMetricFamily(
            "llamafleet_agent_queue_depth",
            "Generations waiting for a free slot of the replica.",
            labels=["replica", "model"],
        )
        memory = GaugeMetricFamily(
            "llamafleet_agent_replica_memory_bytes",
            "Resident memory of the replica's engine process.",
            labels=["replica", "model"],
        )
        ready = GaugeMetricFamily(
            "llamafleet_agent_replica_ready",
            "1 when the replica serves, 0 otherwise.",
            labels=["replica", "model"],
        )
        threads = GaugeMetricFamily(
            "llamafleet_agent_replica_threads",
            "Threads the replica's engine decodes with (the agent divides its cores among "
            "busy engines).",
            labels=["replica", "model"],
        )
        host_cache = GaugeMetricFamily(
            "llamafleet_agent_prompt_cache_host_bytes",
            "Host RAM the replica's prompt cache holds (as of its last generation's end or "
            "its last copy made while idle).",
            labels=["replica", "model"],
        )
        for r in list(self.service.replicas.values()):
            labels = [r.replica_id, r.model_name]
            e = r.engine
            in_flight.add_metric(labels, e.in_flight)
            queued.add_metric(labels, max(e.in_flight - e.config.parallel, 0))
            memory.add_metric(labels, e.memory_bytes())
            ready.add_metric(labels, 1 if e.state == "ready" else 0)
            threads.add_metric(labels, e.threads)
            host_cache.add_metric(labels, e.host_cache_bytes)
        yield from (in_flight, queued, memory, ready, threads, host_cache)


class MetricsServer:
    """The agent's /metrics: prometheus_client's ASGI app, behind the scrape-only token,
    served by uvicorn on the agent's own loop (its socket bound here, so that a busy port
    is an OSError for the caller, and uvicorn leaves the agent's signals alone)."""

    def __init__(self, metrics: AgentMetrics, listen: str, token: str):
        import socket

        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # SIGTERM belongs to the agent (it drains)
                yield

        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        family, kind, proto, _, address = socket.getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self.sockets = [sock]
        config = uvicorn.Config(
            guarded(make_asgi_app(metrics.registry), token),
            lifespan="off",
            log_level="warning",
            access_log=False,
        )
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        log.info("agent metrics on http://%s/metrics", listen)

    def close(self) -> None:
        self._server.should_exit = True


def guarded(app, token: str):
    """GET /metrics with the token as Bearer, else 401; any other path is 404."""
    expected = f"Bearer {token}".encode()

    async def asgi(scope, receive, send):
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if scope["method"] != "GET" or scope["path"] != "/metrics":
                return await _plain(send, 404, b"not found\n")
            if not hmac.compare_digest(auth, expected):
                return await _plain(send, 401, b"metrics token required\n")
        await app(scope, receive, send)

    return asgi


async def _plain(send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
