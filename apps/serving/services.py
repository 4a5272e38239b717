"""Routing a generation to a replica and streaming it back; shared by HTTP and websockets.

The hot path: the cached table of ready replicas (no query), one Redis round trip to pick
one, then a gRPC stream straight from this process to the agent. Celery is never on it, and
nothing after the first token waits for Redis.

A replica that fails before the first token is skipped for the next one. One that fails
after tokens were sent is replaced mid-stream: the prompt plus the tokens generated so far
go to another replica, which continues where the first stopped, so the client sees one
stream with nothing lost or repeated.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field, replace

import grpc
from django.conf import settings
from llamafleet.agent.v1 import agent_pb2 as pb

from apps.catalog.models import CatalogModel
from apps.deployments.models import Deployment, Replica, ScalingPolicy
from apps.nodes import agent_client
from apps.nodes.models import Node
from apps.serving import balancer, cold_start, metrics, routing_table
from apps.usage.services import (
    Caller,
    QuotaExceeded,
    Usage,
    admit_soon,
    check_quota,
    record_soon,
)
from workers.engine import errors

log = logging.getLogger(__name__)

#: Replicas tried for one request before its first token.
MAX_ATTEMPTS = 3
#: Generations streaming from this process (bounded by settings.MAX_IN_FLIGHT).
_in_flight = 0

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

    # The errors callers meet most, by name (the status and OpenAI type follow from it).
    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None):
        """400: the request itself is wrong; `param` names the field."""
        return cls(400, message, code=code, param=param)

    @classmethod
    def replica_failed(cls, message: str):
        """503: the replica serving the request failed (another may take it)."""
        return cls(503, message, "server_error", "replica_failed")

    @classmethod
    def no_replica(cls, message: str, retry_after: int | None = None):
        """503: nothing ready serves the model (yet)."""
        return cls(503, message, "server_error", "no_replica", retry_after=retry_after)

    @classmethod
    def busy(cls, message: str, code: str, retry_after: int | None = None):
        """429: a limit is reached; retry later."""
        return cls(429, message, "rate_limit_error", code, retry_after=retry_after)

    @classmethod
    def internal(cls):
        """500: a bug of ours; the details are logged, never sent."""
        return cls(500, "internal error", "server_error")

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
    presence_penalty: float = 0.0  # OpenAI's, over the last generated tokens
    frequency_penalty: float = 0.0
    cache_prompt: bool = True  # llama-server's name: reuse a cached prefix of the prompt
    json_schema: str = ""  # structured output: the schema the answer must match, as JSON
    logprobs: int = -1  # -1: none; k >= 0: each token's log-probability and the k likeliest
    tools: str = ""  # OpenAI's tools list as JSON; "" for none
    tool_choice: str = ""  # none, auto or required (a named function narrows the grammar)
    n: int = 1  # choices sampled from one evaluation of the prompt

    def to_request(
        self, replica_id: str, request_id: str, resume: pb.Continuation | None = None
    ) -> pb.InferenceRequest:
        return pb.InferenceRequest(
            replica_id=replica_id,
            request_id=request_id,
            messages=[
                pb.ChatMessage(
                    role=m["role"],
                    content=m["content"],
                    tool_calls=json.dumps(m["tool_calls"]) if m.get("tool_calls") else "",
                    tool_call_id=m.get("tool_call_id", ""),
                )
                for m in self.messages
            ],
            tools=self.tools,
            prompt=self.prompt,
            json_schema=self.json_schema,
            max_tokens=self.max_tokens,
            sampling=pb.SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed or 0,
                has_seed=self.seed is not None,
                repeat_penalty=self.repeat_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
            ),
            stop=self.stop,
            resume=resume,
            no_prompt_cache=not self.cache_prompt,
            n=self.n,
            logprobs=self.logprobs >= 0,
            top_logprobs=max(self.logprobs, 0),
        )


@dataclass
class Target:
    """Where a generation runs."""

    replica_id: str
    node_name: str
    address: str
    deployment: str
    policy: str = balancer.LEAST_CONNECTIONS
    slots: int = 0  # sequences the replica decodes at once (0: unknown)


@dataclass
class Piece:
    """A piece of generated text (with its tokens' log-probabilities, when asked)."""

    text: str
    index: int
    logprobs: list = field(default_factory=list)  # pb.TokenLogprob
    choice: int = 0  # which of the request's n choices


@dataclass
class Finished:
    """The end of a generation."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float
    decode_seconds: float
    migrations: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV the replica reused
    choice_reasons: list[str] = field(default_factory=list)  # per choice, when n > 1


async def ready_targets(
    model_name: str, exclude: set[str] = frozenset(), hashes: list[str] = (), fresh: bool = False
) -> list[Target]:
    """Ready replicas on ready, open nodes serving the model, in the order to try them
    (hashes: the prompt's prefix hashes, for the prefix policy; fresh: not from the cache)."""
    rows = [Target(*row) for row in await routing_table.ready_rows(model_name, fresh)]
    rows = [t for t in rows if t.replica_id not in exclude]
    if not rows:
        return rows
    return await balancer.order(rows, rows[0].policy, model_name, hashes)


async def served_models() -> list[dict]:
    """Models with at least one ready replica, or an autoscaled deployment that a request
    starts, for /v1/models."""
    names = set()
    async for name in Replica.objects.filter(
        state=Replica.State.READY, node__state=Node.State.READY
    ).values_list("deployment__model__name", flat=True):
        names.add(name)
    async for name in (
        Deployment.objects.filter(autoscaling__mode=ScalingPolicy.Mode.ON)
        .exclude(state__in=[Deployment.State.STOPPING, Deployment.State.STOPPED])
        .values_list("model__name", flat=True)
    ):
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
    if code == errors.CONTEXT_LENGTH_EXCEEDED:
        return ServingError.invalid(exc.details(), "messages", "context_length_exceeded")
    if code == errors.INVALID_SCHEMA:
        return ServingError.invalid(exc.details(), "response_format", "invalid_schema")
    if code == errors.INVALID_ARGUMENT:
        return ServingError.invalid(exc.details())
    if code == errors.OVERLOADED:
        return ServingError.busy(exc.details(), "overloaded", retry_after=1)
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ServingError(
            504,
            f"the request ran past its limit of {settings.REQUEST_TIMEOUT_SECONDS:.0f} s",
            "server_error",
            "timeout",
        )
    return ServingError.replica_failed(f"the replica failed: {errors.describe(exc)}")


def _replica_lost(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the replica (not the request) failed, so another replica may serve it."""
    code = agent_client.error_code(exc)
    if code in (errors.ENGINE_FAILED, errors.REPLICA_NOT_FOUND, errors.DRAINING):
        return True
    return code == errors.UNSPECIFIED and exc.code() == grpc.StatusCode.UNAVAILABLE


class Generation:
    """One request's generation: routed, retried, migrated; its events in order.

    Iterate `events()` once; leaving early (a client that disconnects) cancels the call
    on the agent, which frees the sequence's slot at once.
    """

    def __init__(self, params: GenerationParams, request_id: str = ""):
        self.id = request_id or uuid.uuid4().hex
        self.params = params
        self.target: Target | None = None
        self.served: list[Target] = []  # every replica that streamed, in order
        self.prompt_tokens = 0
        self.migrations = 0
        self.started = time.monotonic()
        self.deadline = self.started + settings.REQUEST_TIMEOUT_SECONDS
        self._tried: set[str] = set()
        self._call = None
        self._first = None
        self.token_ids: list[int] = []  # generated so far, from every replica that served
        self._delivered = 0  # UTF-8 bytes the consumer received
        self._pieces = 0
        self.first_token_at = 0.0  # time.monotonic() of the first piece
        self._logprobs: list = []  # of tokens not yet sent with a piece
        self.hashes = balancer.prefix_hashes(params.messages, params.prompt)

    async def _open(self, targets: list[Target], resume: pb.Continuation | None) -> None:
        """Start the stream on the first of `targets` that answers; raises ServingError."""
        request = self.params.to_request

        async def start(target: Target):
            self._tried.add(target.replica_id)
            call = agent_client.aio_stub(target.address).RunInference(
                request(target.replica_id, self.id, resume),
                metadata=agent_client.metadata(),
                timeout=max(self.deadline - time.monotonic(), 0.001),
            )
            first = await call.read()
            if first is grpc.aio.EOF:
                raise ServingError.replica_failed("the replica closed the stream")
            return call, first

        target, key, (call, first) = await _first_that_answers(
            self.params.model, targets, start, self.id
        )
        self.target, self._call, self._first, self._key = target, call, first, key
        self.served.append(target)
        if target.policy == balancer.PREFIX:
            balancer.remember(target.deployment, self.hashes, target.replica_id)

    def _close(self, cancel: bool) -> None:
        if self._call is not None:
            if cancel:
                self._call.cancel()
            balancer.release(self.target.replica_id, self._key)
            self._call = None

    async def _migrate(self, cause: ServingError) -> None:
        """Continue on another replica from the tokens generated so far."""
        if self.migrations >= settings.MAX_MIGRATIONS or time.monotonic() >= self.deadline:
            raise cause
        routing_table.invalidate()  # a replica failed: read the table afresh
        targets = await ready_targets(self.params.model, exclude=self._tried)
        if not targets:
            raise ServingError.replica_failed(
                f"{cause.message}; no other replica could continue the stream"
            )
        resume = pb.Continuation(token_ids=self.token_ids, delivered_bytes=self._delivered)
        log.info(
            "generation %s: %s; moving it to another replica after %d tokens",
            self.id,
            cause.message,
            len(self.token_ids),
        )
        self.migrations += 1
        metrics.MIGRATIONS.labels(self.params.model).inc()
        await self._open(targets, resume)

    async def events(self) -> AsyncIterator[Piece | Finished]:
        """Pieces of text, then one Finished; raises ServingError when it cannot go on."""
        done = False
        try:
            msg = self._first
            ended: dict[int, object] = {}  # choice -> its last message (n > 1)
            while True:
                if msg.finish_reason and self.params.n > 1:
                    ended[msg.choice] = msg
                if msg.finish_reason and (self.params.n == 1 or len(ended) == self.params.n):
                    done = True
                    self._close(cancel=False)
                    yield self._finished(msg, ended)
                    return
                self.token_ids.extend(msg.token_ids)
                self.prompt_tokens = msg.prompt_tokens or self.prompt_tokens
                self._logprobs.extend(msg.logprobs)  # tokens whose text is held back wait
                if msg.text:
                    if not self.first_token_at:
                        self.first_token_at = time.monotonic()
                    piece = Piece(msg.text, self._pieces, self._logprobs, msg.choice)
                    self._logprobs = []
                    self._pieces += 1
                    yield piece
                    self._delivered += len(msg.text.encode())
                try:
                    msg = await self._call.read()
                    if msg is grpc.aio.EOF:
                        raise ServingError.replica_failed("the replica ended the stream early")
                except grpc.aio.AioRpcError as exc:
                    self._close(cancel=False)
                    err = _error_from_rpc(exc)
                    if not _replica_lost(exc) or self.params.n > 1:
                        raise err from None  # n choices do not move (one may be done)
                    await self._migrate(err)
                    msg = self._first
                except ServingError as err:
                    self._close(cancel=False)
                    await self._migrate(err)
                    msg = self._first
        finally:
            if not done:
                self._close(cancel=True)

    def _finished(self, msg, ended: dict | None = None) -> Finished:
        """The end; with n choices, their completion tokens summed (the prompt counts once)."""
        end = time.monotonic()
        first = self.first_token_at or end
        ends = [ended[k] for k in sorted(ended)] if ended else [msg]
        return Finished(
            _FINISH.get(msg.finish_reason, "stop"),
            msg.usage.prompt_tokens,
            sum(m.usage.completion_tokens for m in ends),
            first - self.started,
            end - first,
            self.migrations,
            msg.usage.cached_tokens,
            [_FINISH.get(m.finish_reason, "stop") for m in ends],
        )


class _Slot:
    """One of this process's MAX_IN_FLIGHT generation slots."""

    def __init__(self):
        global _in_flight
        if _in_flight >= settings.MAX_IN_FLIGHT:
            raise ServingError.busy(
                f"the server is streaming its limit of {settings.MAX_IN_FLIGHT} generations; "
                "retry shortly",
                "server_busy",
                retry_after=1,
            )
        _in_flight += 1
        self.model = ""

    def routed(self, model: str) -> None:
        """Count the slot in the model's gauge once the model is known to be served."""
        self.model = model
        metrics.IN_FLIGHT.labels(model).inc()

    def free(self) -> None:
        global _in_flight
        _in_flight -= 1
        if self.model:
            metrics.IN_FLIGHT.labels(self.model).dec()


async def _targets_or_error(
    model: str, hashes: list[str] = (), exclude: set[str] = frozenset(), fresh: bool = False
) -> list[Target]:
    """Where to send a request (see ready_targets); a model with none ready wakes if it
    scales to zero, else the request ends with 503 no_replica, or 404 for no such model."""
    targets = await ready_targets(model, exclude, hashes, fresh)
    if not targets and await CatalogModel.objects.filter(name=model).aexists():
        try:  # scaled to zero? then wait for the replica the request wakes
            targets = await cold_start.wait_for_targets(
                model, lambda: ready_targets(model, exclude, hashes)
            )
        except cold_start.ColdStartError as exc:
            raise ServingError.no_replica(exc.message, exc.retry_after) from None
    elif not targets:
        raise ServingError(
            404, f"The model '{model}' does not exist", code="model_not_found", param="model"
        )
    if not targets:
        raise ServingError.no_replica(f"no ready replica serves '{model}'; deploy it first", 5)
    return targets


class _Meter:
    """One request's accounting (see metered)."""

    def __init__(self, caller: Caller | None, endpoint: str, model: str):
        self.model = model
        self.usage = Usage(uuid.uuid4().hex, caller, endpoint, model)
        self.began = time.monotonic()
        # Metric labels name only served models: a client's string must not become a label.
        self.label = metrics.model_label(model)

    def routed(self) -> None:
        """The model proved to be served: its name may label metrics."""
        self.label = metrics.known_model(self.model)

    def served_by(self, targets: list[Target]) -> None:
        self.usage.deployment = targets[0].deployment
        self.usage.replicas = [t.replica_id for t in targets]
        self.usage.nodes = [t.node_name for t in targets]


@asynccontextmanager
async def metered(caller: Caller | None, endpoint: str, model: str) -> AsyncIterator[_Meter]:
    """Every exit of a request metered the same way, whatever the endpoint: a usage record
    (written in the background), the request counter, and the error counter with its code
    when a ServingError ends it (429s count as rejected)."""
    m = _Meter(caller, endpoint, model)
    try:
        yield m
    except ServingError as err:
        m.usage.outcome = "rejected" if err.status == 429 else "error"
        m.usage.error_code = err.code or err.type
        if err.code == "no_replica":
            m.routed()
        metrics.ERRORS.labels(m.label, m.usage.error_code).inc()
        raise
    finally:
        m.usage.duration = time.monotonic() - m.began
        metrics.REQUESTS.labels(m.label, m.usage.deployment, m.usage.outcome).inc()
        record_soon(m.usage)


async def embed(
    model: str, texts: list[str], caller: Caller | None = None
) -> tuple[list[list[float]], int, Target]:
    """Embeddings of texts from one replica of the model (another if it fails), metered."""
    async with metered(caller, "embedding", model) as m:
        await check_quota_or_429(caller, m.usage.request_id)
        vectors, n_tokens, target = await _embed(model, texts)
        m.routed()
        m.served_by([target])
        m.usage.outcome, m.usage.prompt_tokens = "ok", n_tokens
        return vectors, n_tokens, target


async def _embed(model: str, texts: list[str]) -> tuple[list[list[float]], int, Target]:
    async def ask(target: Target):
        return await agent_client.aio_stub(target.address).Embed(
            pb.EmbedRequest(replica_id=target.replica_id, input=texts),
            metadata=agent_client.metadata(),
            timeout=settings.REQUEST_TIMEOUT_SECONDS,
        )

    try:
        target, key, reply = await _first_that_answers(
            model, await _targets_or_error(model), ask, "embed"
        )
    except ServingError as err:
        if err.param == "messages":  # the agent's word for what embeddings call input
            err.param = "input"
        raise
    balancer.release(target.replica_id, key)
    return [list(e.values) for e in reply.data], reply.prompt_tokens, target


async def _first_that_answers(model: str, targets: list[Target], attempt, key: str):
    """The one retry loop of generation and embeddings: `attempt(target)` on each target in
    turn (at most MAX_ATTEMPTS) until one answers. A replica that is gone, overloaded or
    that closed at once passes the request on; any other error is the request's own and is
    raised. Returns (target, balancer key, answer): the caller releases the key when done.
    """
    last: ServingError | None = None
    tried: set[str] = set()
    gone = False
    for reread in (False, True):
        if reread:
            if not gone or len(tried) >= MAX_ATTEMPTS:
                break
            # Replicas the table named were gone: it may be older than a change made
            # elsewhere (see routing_table). Once, try those of a table read afresh.
            targets = await _targets_or_error(model, exclude=tried, fresh=True)
        for target in targets[: MAX_ATTEMPTS - len(tried)]:
            tried.add(target.replica_id)
            slot = f"{key}:{len(tried)}:{uuid.uuid4().hex[:8]}"
            balancer.acquire(target.replica_id, slot)
            try:
                return target, slot, await attempt(target)
            except grpc.aio.AioRpcError as exc:
                balancer.release(target.replica_id, slot)
                last = _error_from_rpc(exc)
                lost = _replica_lost(exc)
                if not (lost or last.code == "overloaded"):
                    raise last from None
                if lost:
                    gone = True
                    routing_table.invalidate()
                metrics.RETRIES.labels(model).inc()
            except ServingError as exc:
                balancer.release(target.replica_id, slot)
                last = exc
            except BaseException:
                balancer.release(target.replica_id, slot)
                raise
    raise last or ServingError.replica_failed("no replica could serve the request")


async def check_quota_or_429(caller: Caller | None, request_id: str, reserve: int = 0) -> int:
    try:
        return await check_quota(caller, request_id, reserve)
    except QuotaExceeded as exc:
        # The quota's own type: insufficient_quota or rate_limit_error, as OpenAI answers.
        raise ServingError(
            429, exc.message, exc.type, exc.code, retry_after=exc.retry_after
        ) from None


async def start_generation(params: GenerationParams, request_id: str = "") -> Generation:
    """Route to a replica and return once its first message is in hand.

    Errors before the first message surface here as ServingError, so that an HTTP caller
    still gets a proper status code.
    """
    gen = Generation(params, request_id)
    targets = await _targets_or_error(params.model, gen.hashes)
    await gen._open(targets, None)
    return gen


async def generate(
    params: GenerationParams, caller: Caller | None = None, endpoint: str = "chat"
) -> AsyncIterator[Generation | Piece | Finished]:
    """The whole serving path with accounting: the Generation once routed, then its events.

    Every exit is metered (see metered): finished, migrated, cancelled (the consumer stopped
    early), rejected (429) or failed (ServingError propagates to the caller).
    """
    slot: _Slot | None = None
    gen: Generation | None = None
    finished: Finished | None = None
    async with metered(caller, endpoint, params.model) as m:
        usage = m.usage
        try:
            usage.reserved = await check_quota_or_429(
                caller, usage.request_id, params.max_tokens or settings.QUOTA_RESERVE_TOKENS
            )
            # Recorded on arrival, completed at the end: a web process killed while the
            # request waits for a slot or streams leaves its record, for the sweeper to settle.
            admit_soon(replace(usage))
            slot = _Slot()
            gen = await start_generation(params, usage.request_id)
            m.routed()
            slot.routed(m.label)
            yield gen
            async with aclosing(gen.events()) as events:
                async for ev in events:
                    if isinstance(ev, Finished):
                        finished = ev
                        usage.outcome = "migrated" if ev.migrations else "ok"
                        _observe(params.model, gen.target.deployment, ev)
                    yield ev
        finally:
            if slot is not None:
                slot.free()
            if gen is not None and gen.served:
                m.served_by(gen.served)
                usage.prompt_tokens = gen.prompt_tokens
                usage.completion_tokens = (
                    finished.completion_tokens if finished else len(gen.token_ids)
                )
                if gen.first_token_at:
                    usage.time_to_first_token = gen.first_token_at - m.began


def _observe(model: str, deployment: str, f: Finished) -> None:
    metrics.TIME_TO_FIRST_TOKEN.labels(model).observe(f.time_to_first_token)
    metrics.COMPLETION_TOKENS.labels(model, deployment).inc(f.completion_tokens)
    if f.completion_tokens > 1 and f.decode_seconds > 0:
        metrics.TOKENS_PER_SECOND.labels(model).observe(
            (f.completion_tokens - 1) / f.decode_seconds
        )


def now() -> int:
    return int(time.time())
