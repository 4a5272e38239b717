"""The agent process: gRPC server, health service, registration and heartbeats."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import signal
import socket
from dataclasses import dataclass

import grpc
import httpx
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from llamafleet.agent.v1 import agent_pb2_grpc

from workers import tls
from workers.agent.metrics import MetricsServer
from workers.agent.service import NodeAgentService
from workers.agent.store import ModelStore
from workers.engine.process import PROMPT_CACHE_MIB, STREAM_INTERVAL_MS
from workers.tls import TLSFiles

log = logging.getLogger(__name__)

SERVICE_NAME = "llamafleet.agent.v1.NodeAgent"


@dataclass
class AgentSettings:
    """How an agent is started (from the command line or the environment)."""

    name: str
    listen: str  # host:port the gRPC server binds
    advertise: str  # host:port the control plane dials; defaults to listen
    control_plane: str  # base URL of the control plane, "" to run without one
    node_token: str
    models_dir: str
    threads: int = 0
    heartbeat_seconds: float = 5.0
    metrics_listen: str = ""  # host:port of GET /metrics (metrics token as Bearer); "" for none
    metrics_token: str = ""  # scrape-only: it opens /metrics and nothing else
    #: host:port of a plaintext server with only the gRPC health service, for probes that
    #: cannot speak mutual TLS (Kubernetes' grpc probe); "" for none.
    health_listen: str = ""
    stream_interval_ms: float = STREAM_INTERVAL_MS  # a stream's pieces closer are merged
    prompt_cache_mib: int = PROMPT_CACHE_MIB  # host RAM per replica; 0 for none
    flash_attn: str = "auto"  # auto, on or off, for whole replicas (see BatchEngine)
    drain_seconds: float = 30.0  # on SIGTERM, how long generations in flight may finish
    rpc_host: str = ""  # where rpc servers listen; "" for the host of `advertise`
    allow_public_rpc: bool = False  # let rpc servers bind a wildcard or public address
    tls: TLSFiles | None = None  # mutual TLS under the cluster CA; plaintext only on loopback


def check_rpc_host(host: str, allow_public: bool) -> None:
    """Refuse to expose the ggml RPC protocol (no authentication, arbitrary tensor writes) on a
    wildcard or public address: it belongs on a private network between nodes."""
    if allow_public:
        return
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise RuntimeError(f"rpc host {host!r} does not resolve: {exc}") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if ip.is_unspecified or ip.is_global or ip.is_multicast:
            raise RuntimeError(
                f"rpc servers would listen on {host} ({ip}), a wildcard or public address; "
                "the ggml RPC protocol has no authentication. Give a private --rpc-host (or "
                "--advertise), or force it with --allow-public-rpc"
            )


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Require the node token on every call except the standard health service."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid node token is required")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return await continuation(details)
        if details.method.endswith("/RunInference"):
            return self._deny_stream
        return self._deny


class Heartbeats:
    """Registers the node and reports its status; a change is reported at once."""

    def __init__(self, settings: AgentSettings, service: NodeAgentService):
        self.settings = settings
        self.service = service
        self._wake = asyncio.Event()
        self.last_error = ""

    def poke(self) -> None:
        self._wake.set()

    def payload(self) -> dict:
        status = MessageToDict(
            self.service.status(),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )
        status["address"] = self.settings.advertise
        return status

    async def run(self) -> None:
        url = self.settings.control_plane.rstrip("/") + "/api/v1/agent/heartbeat"
        headers = {"Authorization": f"Bearer {self.settings.node_token}"}
        async with httpx.AsyncClient(timeout=10.0) as client:
            while True:
                try:
                    resp = await client.post(url, json=self.payload(), headers=headers)
                    if resp.status_code != 200:
                        self._report(
                            f"heartbeat rejected: HTTP {resp.status_code} {resp.text[:200]}"
                        )
                    else:
                        self._report("")
                except httpx.HTTPError as exc:
                    self._report(f"control plane unreachable at {url}: {exc}")
                try:
                    await asyncio.wait_for(self._wake.wait(), self.settings.heartbeat_seconds)
                except TimeoutError:
                    pass
                self._wake.clear()

    def _report(self, error: str) -> None:
        if error != self.last_error:
            (log.warning if error else log.info)(error or "registered with the control plane")
        self.last_error = error


class Agent:
    """Everything one agent runs; start() binds, stop() frees every engine."""

    def __init__(self, settings: AgentSettings):
        self.settings = settings
        rpc_host = settings.rpc_host or settings.advertise.rpartition(":")[0].strip("[]")
        check_rpc_host(rpc_host, settings.allow_public_rpc)
        self.heartbeats: Heartbeats | None = None
        self.service = NodeAgentService(
            settings.name,
            ModelStore(settings.models_dir, settings.node_token),
            threads=settings.threads,
            on_change=self._changed,
            stream_interval=settings.stream_interval_ms / 1000,
            prompt_cache_bytes=settings.prompt_cache_mib << 20,
            flash_attn=settings.flash_attn,
            rpc_host=rpc_host,
            tls_files=settings.tls,
        )
        self.server = grpc.aio.server(interceptors=[TokenInterceptor(settings.node_token)])
        agent_pb2_grpc.add_NodeAgentServicer_to_server(self.service, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self._tasks: list[asyncio.Task] = []
        self.metrics_server: MetricsServer | None = None
        self.health_server: grpc.aio.Server | None = None

    def _changed(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.poke()

    async def start(self) -> int:
        self.port = tls.add_port(self.server, self.settings.listen, self.settings.tls)
        if not self.port:
            raise RuntimeError(f"cannot listen on {self.settings.listen}")
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.settings.health_listen:
            # Health only, so nothing but SERVING/NOT_SERVING is readable without TLS.
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            if not self.health_server.add_insecure_port(self.settings.health_listen):
                raise RuntimeError(f"cannot listen on {self.settings.health_listen}")
            await self.health_server.start()
        if self.settings.advertise.endswith(":0"):
            self.settings.advertise = self.settings.advertise[:-1] + str(self.port)
        if self.settings.metrics_listen and not self.settings.metrics_token:
            log.warning("no metrics: set LLAMAFLEET_METRICS_TOKEN (scrape-only) to serve them")
        elif self.settings.metrics_listen:
            try:
                self.metrics_server = MetricsServer(
                    self.service.metrics, self.settings.metrics_listen, self.settings.metrics_token
                )
            except OSError as exc:  # serving matters more than being scraped
                log.error("no metrics: cannot listen on %s: %s", self.settings.metrics_listen, exc)
        if self.settings.control_plane:
            self.heartbeats = Heartbeats(self.settings, self.service)
            self._tasks.append(asyncio.create_task(self.heartbeats.run()))
        log.info("agent %s serving on port %d", self.settings.name, self.port)
        return self.port

    async def drain(self, grace: float) -> None:
        """Take no new generations (callers retry on another replica) and let those in
        flight finish, for up to `grace` seconds. What still runs after that is cut when the
        engines stop, and the web process moves it to another replica."""
        self.service.draining = True
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if self.service.in_flight():
            log.info("draining: %d generation(s) in flight", self.service.in_flight())
        # The engines own the count and signal nothing on change: a short poll is simplest.
        while self.service.in_flight() and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for task in self._tasks:
            task.cancel()
        if self.metrics_server is not None:
            self.metrics_server.close()
        # Engines first, while the server still answers: a generation they cut ends with
        # ENGINE_FAILED, which the web process answers by moving it to another replica.
        await self.service.shutdown()
        await self.server.stop(grace=2)
        if self.health_server is not None:
            await self.health_server.stop(grace=None)


async def serve(settings: AgentSettings) -> None:
    """Run an agent until SIGTERM or SIGINT: then drain (a second signal cuts it short)."""
    agent = Agent(settings)
    await agent.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    stop.clear()
    log.info("stopping agent %s: draining for up to %.0f s", settings.name, settings.drain_seconds)
    drain = asyncio.ensure_future(agent.drain(settings.drain_seconds))
    await asyncio.wait([drain, asyncio.ensure_future(stop.wait())], return_when="FIRST_COMPLETED")
    drain.cancel()
    await agent.stop()
