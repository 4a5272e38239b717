"""Routing a generation to a replica and streaming it back; shared by HTTP and websockets.

The hot path: one indexed query for ready replicas, then a gRPC stream straight from this
process to the agent. Celery is never on it.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from llamafleet.agent.v1 import agent_pb2 as pb

from apps.catalog.models import CatalogModel
from apps.deployments.models import Deployment, Replica
from apps.nodes import agent_client
from apps.nodes.models import Node

#: Attempts on other replicas when one fails before sending a token.
MAX_ATTEMPTS = 3
_round_robin = itertools.count()

_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}


class ServingError(Exception):
    """An error for the caller, in OpenAI's vocabulary."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )
        self.retry_after = retry_after

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class GenerationParams:
    """A validated generation request, independent of the wire it came on."""

    model: str
    messages: list[dict] = field(default_factory=list)
    prompt: str = ""
    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    repeat_penalty: float = 1.0

    def to_request(self, replica_id: str, request_id: str) -> pb.InferenceRequest:
        return pb.InferenceRequest(
            replica_id=replica_id,
            request_id=request_id,
            messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in self.messages],
            prompt=self.prompt,
            max_tokens=self.max_tokens,
            sampling=pb.SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed or 0,
                has_seed=self.seed is not None,
                repeat_penalty=self.repeat_penalty,
            ),
            stop=self.stop,
        )


@dataclass
class Target:
    """Where a generation runs."""

    replica_id: str
    node_name: str
    address: str
    deployment: str


@dataclass
class Piece:
    """A piece of generated text."""

    text: str
    index: int


@dataclass
class Finished:
    """The end of a generation."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float
    decode_seconds: float


@dataclass
class Generation:
    """A running generation: where it runs and its events."""

    id: str
    target: Target | None = None
    events: AsyncIterator[Piece | Finished] | None = None


async def ready_targets(model_name: str) -> list[Target]:
    """Ready replicas on ready nodes serving the model, in round-robin order."""
    rows = [
        Target(str(pk), node, address, dep)
        async for pk, node, address, dep in Replica.objects.filter(
            state=Replica.State.READY,
            node__state=Node.State.READY,
            deployment__model__name=model_name,
            deployment__state__in=[Deployment.State.READY, Deployment.State.DEGRADED],
        )
        .order_by("pk")
        .values_list("pk", "node__name", "node__address", "deployment__name")
    ]
    if rows:
        k = next(_round_robin) % len(rows)
        rows = rows[k:] + rows[:k]
    return rows


async def served_models() -> list[dict]:
    """Models with at least one ready replica, for /v1/models."""
    names = set()
    async for name in Replica.objects.filter(
        state=Replica.State.READY, node__state=Node.State.READY
    ).values_list("deployment__model__name", flat=True):
        names.add(name)
    out = []
    async for m in CatalogModel.objects.filter(name__in=names).order_by("name"):
        out.append(
            {
                "id": m.name,
                "object": "model",
                "created": int(m.created_at.timestamp()),
                "owned_by": "llamafleet",
            }
        )
    return out


def _error_from_rpc(exc: grpc.aio.AioRpcError) -> ServingError:
    code = agent_client.error_code(exc)
    if code == "CONTEXT_LENGTH_EXCEEDED":
        return ServingError(400, exc.details(), code="context_length_exceeded", param="messages")
    if code == "INVALID_ARGUMENT":
        return ServingError(400, exc.details())
    if code == "OVERLOADED":
        return ServingError(429, exc.details(), "rate_limit_error", "overloaded", retry_after=1)
    return ServingError(
        503,
        f"the replica failed: {exc.details() or exc.code().name}",
        "server_error",
        "replica_failed",
    )


def _retryable(exc: grpc.aio.AioRpcError) -> bool:
    code = agent_client.error_code(exc)
    if code in ("ENGINE_FAILED", "REPLICA_NOT_FOUND"):
        return True
    return not code and exc.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )


async def start_generation(params: GenerationParams) -> Generation:
    """Route to a replica and return once the first event is in hand.

    Failures before the first event are retried on other replicas; they surface here as
    ServingError so that an HTTP caller still gets a proper status code.
    """
    targets = await ready_targets(params.model)  # the one query on the hot path
    if not targets and not await CatalogModel.objects.filter(name=params.model).aexists():
        raise ServingError(
            404, f"The model '{params.model}' does not exist", code="model_not_found", param="model"
        )
    if not targets:
        raise ServingError(
            503,
            f"no ready replica serves '{params.model}'; deploy it first",
            "server_error",
            "no_replica",
            retry_after=5,
        )
    gen_id = uuid.uuid4().hex
    last: ServingError | None = None
    for target in targets[:MAX_ATTEMPTS]:
        call = agent_client.aio_stub(target.address).RunInference(
            params.to_request(target.replica_id, gen_id), metadata=agent_client.metadata()
        )
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            last = _error_from_rpc(exc)
            if _retryable(exc):
                continue
            raise last from None
        if first is grpc.aio.EOF:
            last = ServingError(
                503, "the replica closed the stream", "server_error", "replica_failed"
            )
            continue
        return Generation(gen_id, target, _events(call, first))
    raise last or ServingError(503, "no replica could serve the request", "server_error")


async def _events(call, first) -> AsyncIterator[Piece | Finished]:
    """Convert agent messages to events; cancels the call when the consumer stops early."""
    msg = first
    done = False
    try:
        while True:
            if msg.finish_reason:
                done = True
                yield Finished(
                    _FINISH.get(msg.finish_reason, "stop"),
                    msg.usage.prompt_tokens,
                    msg.usage.completion_tokens,
                    msg.timings.time_to_first_token,
                    msg.timings.decode_seconds,
                )
                return
            if msg.text:
                yield Piece(msg.text, msg.index)
            try:
                msg = await call.read()
            except grpc.aio.AioRpcError as exc:
                raise _error_from_rpc(exc) from None
            if msg is grpc.aio.EOF:
                raise ServingError(
                    503, "the replica ended the stream early", "server_error", "replica_failed"
                )
    finally:
        if not done:
            call.cancel()  # the agent frees the sequence's slot at once


def now() -> int:
    return int(time.time())
