"""The NodeAgent gRPC servicer: converts messages at the edge, the engines do the work."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import uuid
from collections.abc import Callable

import grpc
from llamafleet.agent.v1 import agent_pb2 as pb
from llamafleet.agent.v1 import agent_pb2_grpc

import workers
from workers.agent import quantize, rpc_servers, system
from workers.agent.ledger import Ledger
from workers.agent.metrics import AgentMetrics
from workers.agent.rpc_servers import RpcServer
from workers.agent.store import ModelStore
from workers.engine import errors
from workers.engine.errors import EngineError
from workers.engine.events import Token
from workers.engine.process import PROMPT_CACHE_MIB, EngineConfig, EngineProcess

log = logging.getLogger(__name__)

_STATES = {
    "loading": pb.REPLICA_STATE_LOADING,
    "ready": pb.REPLICA_STATE_READY,
    "failed": pb.REPLICA_STATE_FAILED,
    "stopping": pb.REPLICA_STATE_STOPPING,
    "stopped": pb.REPLICA_STATE_STOPPING,
}
_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
}
_STATUS = {
    errors.CONTEXT_LENGTH_EXCEEDED: grpc.StatusCode.INVALID_ARGUMENT,
    errors.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    errors.INVALID_SCHEMA: grpc.StatusCode.INVALID_ARGUMENT,
    errors.REPLICA_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    errors.ENGINE_FAILED: grpc.StatusCode.UNAVAILABLE,
    errors.BAD_MODEL_FILE: grpc.StatusCode.FAILED_PRECONDITION,
    errors.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DRAINING: grpc.StatusCode.UNAVAILABLE,
    errors.ENDPOINT_IN_USE: grpc.StatusCode.ALREADY_EXISTS,
}


async def abort(context: grpc.aio.ServicerContext, exc: EngineError):
    """Translate a domain error to a gRPC status with its machine-readable code."""
    await context.abort(
        _STATUS.get(exc.code, grpc.StatusCode.INTERNAL),
        exc.message,
        trailing_metadata=((errors.METADATA_KEY, exc.name),),
    )


class Replica:
    """One loaded model on this agent: its engine process and its identity."""

    def __init__(self, request: pb.LoadModelRequest, engine: EngineProcess):
        self.replica_id = request.replica_id
        self.model_name = request.model_name
        self.engine = engine
        #: The agent chooses its threads (LoadModelRequest.threads is 0): they follow the load.
        self.shares_cores = not request.threads
        self.loaded = asyncio.Event()
        self.load_seconds = 0.0

    def host_cache_unfilled(self) -> int:
        """Host RAM this replica's prompt cache may still take (its budget less what it
        holds): reported as not available, so the planner does not give it to a new
        replica that the cache would later crowd out. Splits and the invariant mode keep
        no cache (BatchEngine)."""
        c = self.engine.config
        if c.rpc_servers or c.batch_invariant or self.engine.state not in ("loading", "ready"):
            return 0
        return max(0, c.host_cache_bytes - self.engine.host_cache_bytes)

    def status(self) -> pb.ReplicaStatus:
        e = self.engine
        return pb.ReplicaStatus(
            replica_id=self.replica_id,
            model_name=self.model_name,
            state=_STATES[e.state],
            error=e.error,
            memory_bytes=e.memory_bytes(),
            in_flight=e.in_flight,
            pid=e.pid,
            context_length=e.config.context_length,
            parallel=e.config.parallel,
            threads=e.threads,
        )


class NodeAgentService(agent_pb2_grpc.NodeAgentServicer):
    """Holds the replicas of this node and serves the NodeAgent contract."""

    def __init__(
        self,
        node_name: str,
        store: ModelStore,
        threads: int = 0,
        on_change: Callable[[], None] | None = None,
        stream_interval: float = 0.0,
        rpc_host: str = "127.0.0.1",
        prompt_cache_bytes: int = PROMPT_CACHE_MIB << 20,
        tls_files=None,
        flash_attn: str = "auto",
    ):
        self.node_name = node_name
        self.store = store
        self.threads = threads or system.cpu_cores()
        self.stream_interval = stream_interval
        self.prompt_cache_bytes = prompt_cache_bytes  # per replica, see BatchEngine
        self.flash_attn = flash_attn  # for whole replicas, see BatchEngine
        self.rpc_host = rpc_host
        self.tls_files = tls_files  # for calls to other agents (link measurement)
        self.rpc_servers: dict[int, RpcServer] = {}
        self.replicas: dict[str, Replica] = {}
        #: Set on SIGTERM: no new generations; those in flight finish (see Agent.drain).
        self.draining = False
        #: This start of the agent; engines and rpc servers do not outlive it.
        self.boot_id = uuid.uuid4().hex
        #: Read once: devices do not come and go under a running agent, and nvidia-smi
        #: takes a tenth of a second, too much for every status and heartbeat.
        self.accelerators = system.accelerators()
        self._on_change = on_change or (lambda: None)
        self.metrics = AgentMetrics(self)
        self.ledger = Ledger()  # tokens per recent request, for the usage sweeper

    def _replica(self, replica_id: str) -> Replica:
        replica = self.replicas.get(replica_id)
        if replica is None:
            raise EngineError(
                errors.REPLICA_NOT_FOUND, f"replica {replica_id} is not loaded on {self.node_name}"
            )
        return replica

    def _load_response(self, replica: Replica) -> pb.LoadModelResponse:
        e = replica.engine
        return pb.LoadModelResponse(
            state=_STATES[e.state],
            error=e.error,
            memory_bytes=e.memory_bytes(),
            load_seconds=replica.load_seconds,
        )

    async def LoadModel(self, request, context):
        if not request.replica_id:
            await abort(context, EngineError(errors.INVALID_ARGUMENT, "replica_id is required"))
        existing = self.replicas.get(request.replica_id)
        if existing is not None and existing.engine.state in ("loading", "ready"):
            await existing.loaded.wait()  # another call is loading it: answer with its outcome
            return self._load_response(existing)
        if existing is not None:
            await existing.engine.stop()
        started = time.monotonic()
        config = EngineConfig(
            model_path="",
            context_length=request.context_length or 2048,
            parallel=request.parallel or 1,
            threads=request.threads or self.threads,
            chat_template=request.chat_template,
            stream_interval=self.stream_interval,
            host_cache_bytes=self.prompt_cache_bytes,
            flash_attn=self.flash_attn,
            swa_full=not request.swa_window,
            rpc_servers=list(request.rpc_servers),
            n_gpu_layers=request.n_gpu_layers
            if request.rpc_servers or request.n_gpu_layers
            else -1,
            split_mode=request.split_mode or pb.SPLIT_MODE_LAYER,
            tensor_split=list(request.tensor_split),
            batch_invariant=request.batch_invariant,
        )
        engine = EngineProcess(
            config,
            on_state_change=lambda _e: self._on_change(),
            on_busy_change=lambda _e: self._share_cores(),
        )
        replica = Replica(request, engine)
        self.replicas[request.replica_id] = replica
        try:
            files = list(request.files) or [
                pb.ModelFile(
                    sha256=request.sha256,
                    size_bytes=request.size_bytes,
                    download_url=request.download_url,
                )
            ]
            config.model_path = str(await self.store.ensure_model(files))
            info = await engine.start()
            log.info(
                "replica %s (%s) loaded in %.1f s: %d slots of %d tokens, flash attention %s, "
                "sliding-window cache %s",
                replica.replica_id,
                replica.model_name,
                info.get("load_seconds", 0.0),
                info.get("parallel", 0),
                info.get("context_length", 0),
                info.get("flash_attn", "?"),
                "full" if info.get("swa_full", True) else "window",
            )
        except EngineError as exc:
            engine.state, engine.error = "failed", exc.message
            self._on_change()
        finally:
            replica.load_seconds = time.monotonic() - started
            replica.loaded.set()
        return self._load_response(replica)

    def _share_cores(self) -> None:
        """Divide the node's threads among the engines generating now, each time one starts
        or stops: an engine alone decodes with all of them, and two busy ones no longer
        oversubscribe the cores (their OpenMP threads spin at every barrier: two SmolLM2
        replicas with all cores each decoded at a seventh of their speed with one each,
        bench/cores.py). An idle engine takes no share; it gets one before its first request
        is sent. An engine loaded with a count of its own (LoadModelRequest.threads) keeps
        it, and that count is taken off the shared budget while it is busy."""
        busy = [
            r for r in self.replicas.values() if r.engine.state == "ready" and r.engine.generating
        ]
        shared = [r.engine for r in busy if r.shares_cores]
        if not shared:
            return
        budget = self.threads - sum(r.engine.threads for r in busy if not r.shares_cores)
        each, extra = divmod(max(budget, len(shared)), len(shared))
        for i, engine in enumerate(shared):
            engine.set_threads(each + (1 if i < extra else 0))

    async def FreeMemory(self, request, context):
        replica = self.replicas.pop(request.replica_id, None)
        if replica is None:
            return pb.FreeMemoryResponse(freed=False)
        await replica.engine.stop()
        self._on_change()
        return pb.FreeMemoryResponse(freed=True)

    async def RunInference(self, request, context):
        if self.draining:  # shutting down: the caller sends it to another replica
            await abort(context, EngineError(errors.DRAINING, f"{self.node_name} is shutting down"))
        # Headers now, while the prompt is evaluated: sent with the first token instead, the
        # caller's channel takes them and the message as two completions, one more wake-up
        # on the way to the first token (0.2 and 0.6 ms in two paired runs, 2026-12-05).
        await context.send_initial_metadata(())
        count = self.ledger.count
        try:
            replica = self._replica(request.replica_id)
            payload = inference_payload(request)
            async for event in replica.engine.generate(payload):
                if isinstance(event, Token):
                    # Counted as it goes: a caller that dies mid-stream leaves its count here.
                    count(request.request_id, event.prompt_tokens, len(event.token_ids))
                    yield pb.InferenceResponse(
                        choice=_choice(event.id),
                        text=event.text,
                        index=event.index,
                        token_ids=event.token_ids,
                        prompt_tokens=event.prompt_tokens,
                        logprobs=[
                            pb.TokenLogprob(
                                token_id=t,
                                piece=piece,
                                logprob=lp,
                                top=[pb.TopLogprob(piece=p, logprob=x) for p, x in top],
                            )
                            for t, piece, lp, top in event.logprobs
                        ],
                    )
                else:
                    self.metrics.finished(
                        replica.replica_id,
                        replica.model_name,
                        event.reason,
                        event.usage,
                        event.timings,
                    )
                    count(request.request_id, 0, 0, finished=True)
                    yield pb.InferenceResponse(
                        choice=_choice(event.id),
                        finish_reason=_FINISH[event.reason],
                        usage=pb.Usage(
                            prompt_tokens=event.usage["prompt_tokens"],
                            completion_tokens=event.usage["completion_tokens"],
                            cached_tokens=event.usage["cached_tokens"],
                        ),
                        timings=pb.Timings(**event.timings),
                    )
        except EngineError as exc:
            if exc.code != errors.REPLICA_NOT_FOUND:
                self.metrics.failed(request.replica_id, replica.model_name, exc.name)
            await abort(context, exc)

    async def GetRequestUsage(self, request, context):
        found = ((rid, self.ledger.get(rid)) for rid in request.request_ids)
        return pb.GetRequestUsageResponse(
            usage=[
                pb.RequestUsage(
                    request_id=rid,
                    prompt_tokens=c.prompt_tokens,
                    completion_tokens=c.completion_tokens,
                    finished=c.finished,
                )
                for rid, c in found
                if c is not None
            ]
        )

    async def Tokenize(self, request, context):
        try:
            replica = self._replica(request.replica_id)
            payload = {
                "messages": [chat_message(m) for m in request.messages],
                "text": request.text,
            }
            tokens, n_ctx = await replica.engine.tokenize(payload)
        except EngineError as exc:
            await abort(context, exc)
        return pb.TokenizeResponse(tokens=tokens, context_length=n_ctx)

    async def Embed(self, request, context):
        try:
            replica = self._replica(request.replica_id)
            if not request.input:
                raise EngineError(errors.INVALID_ARGUMENT, "input is empty")
            vectors, n_tokens = await replica.engine.embed(list(request.input))
        except EngineError as exc:
            await abort(context, exc)
        return pb.EmbedResponse(
            data=[pb.Embedding(values=v) for v in vectors], prompt_tokens=n_tokens
        )

    async def GetStatus(self, request, context):
        return self.status()

    async def StartRpcServer(self, request, context):
        try:
            if not 0 < request.port < 65536:
                raise EngineError(errors.INVALID_ARGUMENT, "port must be between 1 and 65535")
            server = self.rpc_servers.get(request.port)
            if server is None or not server.running:
                cache = str(self.store.root / "rpc-cache") if request.cache else ""
                server = RpcServer(
                    self.rpc_host, request.port, request.threads or self.threads, cache
                )
                await server.start()
                self.rpc_servers[request.port] = server
                self._on_change()
        except EngineError as exc:
            await abort(context, exc)
        return _rpc_status(server)

    async def StopRpcServer(self, request, context):
        server = self.rpc_servers.pop(request.port, None)
        if server is not None:
            server.stop()
            self._on_change()
        return pb.StopRpcServerResponse(stopped=server is not None)

    async def CheckRpcServers(self, request, context):
        checks = await asyncio.gather(*(rpc_servers.check(ep) for ep in request.endpoints))
        return pb.CheckRpcServersResponse(servers=checks)

    async def MeasureLink(self, request, context):
        # The caller's node token opens the other agent too (agents share it).
        auth = dict(context.invocation_metadata()).get("authorization", "")
        return await rpc_servers.measure_link(
            request.target, (("authorization", auth),), request.bytes, self.tls_files
        )

    async def Echo(self, request, context):
        return pb.EchoResponse(size=len(request.payload))

    async def Quantize(self, request, context):
        try:
            async for message in quantize.run(self.store, request, self.threads):
                yield message
        except EngineError as exc:
            await abort(context, exc)

    def status(self) -> pb.NodeStatus:
        total, available = system.meminfo()
        available = max(0, available - sum(r.host_cache_unfilled() for r in self.replicas.values()))
        replicas = [r.status() for r in self.replicas.values()]
        return pb.NodeStatus(
            node_name=self.node_name,
            version=workers.__version__,
            memory_total_bytes=total,
            memory_available_bytes=available,
            cpu_cores=system.cpu_cores(),
            accelerators=self.accelerators,
            replicas=replicas,
            memory_in_use_bytes=sum(r.memory_bytes for r in replicas),
            in_flight=sum(r.in_flight for r in replicas),
            load_average=system.load_average(),
            rpc_servers=[_rpc_status(s) for s in self.rpc_servers.values()],
            disk_free_bytes=shutil.disk_usage(self.store.root).free,
            boot_id=self.boot_id,
            features=workers.FEATURES,
        )

    def in_flight(self) -> int:
        return sum(r.engine.in_flight for r in self.replicas.values())

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.engine.stop() for r in self.replicas.values()))
        for server in self.rpc_servers.values():
            server.stop()


def _rpc_status(server: RpcServer) -> pb.RpcServerStatus:
    return pb.RpcServerStatus(
        endpoint=server.endpoint, running=server.running, pid=server.pid, error=server.error
    )


def inference_payload(request: pb.InferenceRequest) -> dict:
    """The engine's view of an InferenceRequest."""
    if request.messages and request.prompt:
        raise EngineError(errors.INVALID_ARGUMENT, "give either messages or prompt, not both")
    s = request.sampling
    sampling = {
        "temperature": s.temperature,
        "top_p": s.top_p if 0 < s.top_p < 1 else 1.0,
        "top_k": s.top_k,
        "repeat_penalty": s.repeat_penalty or 1.0,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "seed": s.seed if s.has_seed else None,
    }
    return {
        "messages": [chat_message(m) for m in request.messages],
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "sampling": sampling,
        "stop": list(request.stop),
        "resume_tokens": list(request.resume.token_ids),
        "delivered_bytes": request.resume.delivered_bytes,
        "cache_prompt": not request.no_prompt_cache,
        "json_schema": request.json_schema,
        "logprobs": request.top_logprobs if request.logprobs else -1,
        "tools": json.loads(request.tools) if request.tools else None,
        "n": request.n or 1,
    }


def _choice(engine_id: str) -> int:
    """Choice k of a request: the engine names its events "<id>#<k>"."""
    return int(engine_id.partition("#")[2] or 0)


def chat_message(m: pb.ChatMessage) -> dict:
    """A message as chat templates take it (OpenAI's shape, tool calls included)."""
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = json.loads(m.tool_calls)
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out
