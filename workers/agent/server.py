"""The agent process: gRPC server, health service, registration and heartbeats."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from dataclasses import dataclass

import grpc
import httpx
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from llamafleet.agent.v1 import agent_pb2_grpc

from workers.agent.metrics import serve_metrics
from workers.agent.service import NodeAgentService
from workers.agent.store import ModelStore

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
    metrics_listen: str = ""  # host:port of GET /metrics (node token as Bearer); "" for none
    stream_interval_ms: float = 20.0  # pieces of one stream closer than this are merged
    rpc_host: str = ""  # where rpc servers listen; "" for the host of `advertise`


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
        self.heartbeats: Heartbeats | None = None
        self.service = NodeAgentService(
            settings.name,
            ModelStore(settings.models_dir, settings.node_token),
            threads=settings.threads,
            on_change=self._changed,
            stream_interval=settings.stream_interval_ms / 1000,
            # The ggml RPC protocol has no authentication: the cluster address, never all.
            rpc_host=settings.rpc_host or settings.advertise.rpartition(":")[0].strip("[]"),
        )
        self.server = grpc.aio.server(interceptors=[TokenInterceptor(settings.node_token)])
        agent_pb2_grpc.add_NodeAgentServicer_to_server(self.service, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self._tasks: list[asyncio.Task] = []
        self.metrics_server: asyncio.AbstractServer | None = None

    def _changed(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.poke()

    async def start(self) -> int:
        self.port = self.server.add_insecure_port(self.settings.listen)
        if not self.port:
            raise RuntimeError(f"cannot listen on {self.settings.listen}")
        await self.server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.settings.advertise.endswith(":0"):
            self.settings.advertise = self.settings.advertise[:-1] + str(self.port)
        if self.settings.metrics_listen:
            try:
                self.metrics_server = await serve_metrics(
                    self.service.metrics, self.settings.metrics_listen, self.settings.node_token
                )
            except OSError as exc:  # serving matters more than being scraped
                log.error("no metrics: cannot listen on %s: %s", self.settings.metrics_listen, exc)
        if self.settings.control_plane:
            self.heartbeats = Heartbeats(self.settings, self.service)
            self._tasks.append(asyncio.create_task(self.heartbeats.run()))
        log.info("agent %s serving on port %d", self.settings.name, self.port)
        return self.port

    async def stop(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for task in self._tasks:
            task.cancel()
        if self.metrics_server is not None:
            self.metrics_server.close()
        await self.server.stop(grace=2)
        await self.service.shutdown()


async def serve(settings: AgentSettings) -> None:
    """Run an agent until SIGTERM or SIGINT."""
    agent = Agent(settings)
    await agent.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping agent %s", settings.name)
    await agent.stop()
