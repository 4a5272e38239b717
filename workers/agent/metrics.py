"""Prometheus metrics of one agent, served over HTTP with the node token as Bearer.

Each agent has its own registry (several agents may share a process in tests). Gauges of
what the replicas hold are read at scrape time; counters move as generations end.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
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
        self.prompt_tokens = Counter(
            "llamafleet_agent_prompt_tokens",
            "Prompt tokens of generations that ended (cached ones included).",
            ["replica", "model"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "llamafleet_agent_time_to_first_token_seconds",
            "From the engine receiving a request to its first token (queueing included).",
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
        if n:
            self.time_to_first_token.labels(model).observe(timings["time_to_first_token"])
        if n > 1 and timings["decode_seconds"] > 0:
            self.tokens_per_second.labels(model).observe((n - 1) / timings["decode_seconds"])

    def failed(self, replica_id: str, model: str, code: str):
        self.generations.labels(replica_id, model, code.lower()).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaCollector:
    """In-flight, queued, memory and state of each replica, as they are now."""

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
        for r in list(self.service.replicas.values()):
            labels = [r.replica_id, r.model_name]
            e = r.engine
            in_flight.add_metric(labels, e.in_flight)
            queued.add_metric(labels, max(e.in_flight - e.config.parallel, 0))
            memory.add_metric(labels, e.memory_bytes())
            ready.add_metric(labels, 1 if e.state == "ready" else 0)
        yield from (in_flight, queued, memory, ready)


async def serve_metrics(metrics: AgentMetrics, listen: str, token: str) -> asyncio.AbstractServer:
    """A minimal HTTP server for GET /metrics; anything else is 404, no token is 401."""
    expected = f"Bearer {token}".encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            lines = head.split(b"\r\n")
            method, path, _ = (lines[0].split(b" ") + [b"", b""])[:3]
            auth = b""
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"authorization":
                    auth = value.strip()
            if method != b"GET" or path.split(b"?")[0] != b"/metrics":
                status, body, ctype = b"404 Not Found", b"not found\n", b"text/plain"
            elif not hmac.compare_digest(auth, expected):
                status, body, ctype = (
                    b"401 Unauthorized",
                    b"metrics token required\n",
                    b"text/plain",
                )
            else:
                status, body = b"200 OK", metrics.render()
                ctype = b"text/plain; version=0.0.4; charset=utf-8"
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
                + b"\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n" + body
            )  # fmt: skip
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            pass
        finally:
            writer.close()

    host, _, port = listen.rpartition(":")
    server = await asyncio.start_server(handle, host.strip("[]") or "127.0.0.1", int(port))
    log.info("agent metrics on http://%s/metrics", listen)
    return server
