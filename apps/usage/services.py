"""Metering, node-hours, quotas and reports.

Usage records go straight to the database from a background task of the web process: not
through Redis or Celery, so a Redis restart or a dead worker loses none, and not on the
token stream's path. Quotas count in Redis and rebuild their counts from those records when
Redis has lost them.
"""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, F, Q, Sum
from django.db.models.functions import TruncDay, TruncHour
from redis.exceptions import RedisError

from apps.deployments.models import Replica
from apps.usage.models import NodeUsage, Report, UsageRecord
from controlplane.db import bulk_update, in_pool_thread, relaxed_commit
from controlplane.redis import client as _redis
from controlplane.redis import key as redis_key

log = logging.getLogger(__name__)

_pending: set[asyncio.Task] = set()


# ---- who is asking ------------------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """The identity and limits of a request's API key (or a console user without one)."""

    user_id: int | None
    staff: bool = False
    key_id: int | None = None
    app: str = ""
    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None

    @classmethod
    def from_key(cls, key) -> Caller:
        return cls(
            user_id=key.owner_id,
            staff=key.owner.is_staff,
            key_id=key.pk,
            app=key.app or key.name,
            requests_per_minute=key.requests_per_minute,
            tokens_per_day=key.tokens_per_day,
            tokens_per_month=key.tokens_per_month,
        )


# ---- metering ------------------------------------------------------------------------------


@dataclass
class Usage:
    """What one request used, as the serving path saw it."""

    request_id: str
    caller: Caller | None
    endpoint: str
    model: str
    started: float = field(default_factory=time.time)  # epoch seconds
    deployment: str = ""
    replicas: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token: float | None = None
    outcome: str = UsageRecord.Outcome.CANCELLED
    error_code: str = ""
    duration: float = 0.0
    reserved: int = 0  # tokens reserved against the quotas at admission


def _fields(u: Usage) -> dict:
    c = u.caller
    return {
        "api_key_id": c.key_id if c else None,
        "app": c.app if c else "",
        "user_id": c.user_id if c else None,
        "endpoint": u.endpoint,
        "model": u.model[:100],
        "deployment": u.deployment,
        "replicas": u.replicas,
        "nodes": u.nodes,
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "time_to_first_token_ms": (
            None if u.time_to_first_token is None else 1000 * u.time_to_first_token
        ),
        "duration_ms": 1000 * u.duration,
        "outcome": u.outcome,
        "error_code": u.error_code[:64],
        "started_at": datetime.fromtimestamp(u.started, UTC),
        "finished_at": datetime.fromtimestamp(u.started + u.duration, UTC),
    }


def admit(u: Usage) -> None:
    """The record of a request just admitted, written before its stream ends: a web process
    killed mid-stream leaves it RUNNING, where settle_interrupted() finds it."""
    fields = _fields(u) | {"outcome": UsageRecord.Outcome.RUNNING, "finished_at": None}
    try:
        with transaction.atomic():
            UsageRecord.objects.create(request_id=u.request_id, **fields)
    except IntegrityError:
        pass  # its final record got there first (the two are written by parallel tasks)


def record(u: Usage) -> None:
    """Complete a request's record (or store it, if it was never admitted). The first final
    record stays: recording the same request twice keeps the first. One UPDATE as a rule,
    and nothing read back: this runs once per request."""
    fields = _fields(u)
    running = UsageRecord.objects.filter(
        request_id=u.request_id, outcome=UsageRecord.Outcome.RUNNING
    )
    if not running.update(**fields):
        try:
            with transaction.atomic():
                UsageRecord.objects.create(request_id=u.request_id, **fields)
        except IntegrityError:  # admitted meanwhile, or already final
            running.update(**fields)


def settle_interrupted(older_than: float | None = None) -> int:
    """Complete records left RUNNING longer than any stream may last (their web process
    died): outcome error, code "interrupted", ended now, with the tokens the agents say they
    took in and generated for them (GetRequestUsage; a request no agent remembers keeps 0).
    Returns how many."""
    older_than = settings.REQUEST_TIMEOUT_SECONDS + 60 if older_than is None else older_than
    now = datetime.now(UTC)
    stale = UsageRecord.objects.filter(
        outcome=UsageRecord.Outcome.RUNNING, started_at__lt=now - timedelta(seconds=older_than)
    )
    ids = list(stale.values_list("request_id", flat=True)[:SETTLE_BATCH])
    if not ids:
        return 0
    counted = _agents_counts(ids)
    settled = {
        "outcome": UsageRecord.Outcome.ERROR,
        "error_code": "interrupted",
        "finished_at": now,
    }
    n = 0
    with transaction.atomic():
        for rid, (prompt, completion, nodes) in counted.items():
            n += stale.filter(request_id=rid).update(
                **settled, prompt_tokens=prompt, completion_tokens=completion, nodes=nodes
            )
        n += stale.filter(request_id__in=ids).update(**settled)  # the ones nobody counted
    if n:
        log.warning(
            "usage: %d record(s) of streams whose web process died, settled (%d with the "
            "agents' token counts)",
            n,
            len(counted),
        )
    return n


#: Records settled per sweep (the next sweep, a minute later, takes the rest).
SETTLE_BATCH = 1000


def _agents_counts(request_ids: list[str]) -> dict[str, tuple[int, int, list[str]]]:
    """request id -> (prompt tokens, completion tokens, node names), from every ready
    node's agent; an agent that does not answer counts nothing."""
    import grpc
    from llamafleet.agent.v1 import agent_pb2 as pb

    from apps.nodes import agent_client
    from apps.nodes.models import Node

    def ask(node: Node):
        try:
            return node.name, agent_client.stub(node.address).GetRequestUsage(
                pb.GetRequestUsageRequest(request_ids=request_ids),
                metadata=agent_client.metadata(),
                timeout=agent_client.STATUS_TIMEOUT,
            )
        except grpc.RpcError as exc:
            log.info("usage: %s did not give its counts (%s)", node.name, exc.code())
            return node.name, None

    nodes = list(Node.objects.filter(state=Node.State.READY))
    counts: dict[str, tuple[int, int, list[str]]] = {}
    if not nodes:
        return counts
    with ThreadPoolExecutor(max_workers=min(16, len(nodes))) as pool:
        for name, answer in pool.map(ask, nodes):
            for u in answer.usage if answer is not None else ():
                prompt, completion, names = counts.get(u.request_id, (0, 0, []))
                counts[u.request_id] = (
                    max(prompt, u.prompt_tokens),
                    completion + u.completion_tokens,
                    [*names, name],
                )
    return counts


#: How long a record waits for a database that is down or restarting before it is given up.
STORE_PATIENCE_SECONDS = 180.0


async def _store(fn, u: Usage) -> None:
    """fn(u) in a pool thread, retried with backoff while the database is away (held in
    memory meanwhile; a graceful shutdown waits for them in flush())."""
    deadline = time.monotonic() + STORE_PATIENCE_SECONDS
    pause = 0.5
    while True:
        try:
            await in_pool_thread(fn)(u)
            return
        except Exception:  # a busy, restarting or stopped database: try again, then say so
            if time.monotonic() + pause > deadline:
                log.exception("usage record %s lost (%s): %s", u.request_id, fn.__name__, u)
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)


def _in_background(coro) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _pending.add(task)
    task.add_done_callback(_pending.discard)


def admit_soon(u: Usage) -> None:
    """admit() from a background task: the first token never waits for the database."""
    _in_background(_store(admit, u))


def record_soon(u: Usage) -> None:
    """Store the record and count its tokens against the key's quotas, from a background
    task: the stream never waits for the database."""

    async def write():
        await consume_tokens(u.caller, u.prompt_tokens + u.completion_tokens, u.reserved)
        await _store(record, u)

    _in_background(write())


async def flush(timeout: float = 10.0) -> None:
    """Wait for records still being written, from any event loop (tests, shutdown)."""
    # Polled: tasks of another loop (another thread) cannot be awaited from this one.
    for _ in range(int(timeout / 0.01)):
        if not _pending:
            return
        await asyncio.sleep(0.01)


# ---- node-hours ----------------------------------------------------------------------------


def account_heartbeat(node, reported: list[dict], previous: datetime | None, now: datetime):
    """Credit the time since the node's previous heartbeat to its hour, with who held it."""
    account_heartbeats([(node, reported, previous, now)])


def account_heartbeats(items: list[tuple]) -> None:
    """Credit each (node, reported replicas, previous heartbeat, this heartbeat): the time in
    between goes to the node's hour, split by who held its memory. Any number of nodes in a
    few queries (buffered heartbeats arrive by the thousand).

    A gap longer than the heartbeat timeout counts only up to the timeout: the node was not
    known to be up in between.
    """
    work = []
    for node, reported, previous, now in items:
        if previous is None:
            continue
        seconds = min((now - previous).total_seconds(), settings.HEARTBEAT_TIMEOUT_SECONDS)
        if seconds > 0:
            hour = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
            work.append((node, reported, seconds, hour))
    if not work:
        return
    ids = {
        r["replica_id"]
        for _, reported, _, _ in work
        for r in reported
        if r.get("memory_bytes") and _is_uuid(r["replica_id"])
    }
    owners = {
        str(pk): (dep, model)
        for pk, dep, model in Replica.objects.filter(pk__in=ids).values_list(
            "pk", "deployment__name", "deployment__model__name"
        )
    }
    with transaction.atomic():
        relaxed_commit()  # if lost, the next heartbeat credits from the last one stored
        keys = {(node.pk, hour): node for node, _, _, hour in work}
        NodeUsage.objects.bulk_create(
            [
                NodeUsage(node=node, hour=hour, currency=node.currency, node_name=node.name)
                for (_, hour), node in keys.items()
            ],
            ignore_conflicts=True,
        )
        rows = {
            (row.node_id, row.hour): row
            for row in NodeUsage.objects.select_for_update().filter(
                node_id__in={pk for pk, _ in keys}, hour__in={h for _, h in keys}
            )
        }
        for node, reported, seconds, hour in work:
            row = rows[(node.pk, hour)]
            row.seconds += seconds
            row.cost += (Decimal(str(seconds)) * node.price_per_hour / 3600).quantize(
                Decimal("1e-6")
            )
            row.memory_total_bytes = max(row.memory_total_bytes, node.memory_total_bytes)
            for r in reported:
                owner = owners.get(r["replica_id"])
                if owner is None:
                    continue
                entry = row.held.setdefault(owner[0], {"model": owner[1], "byte_seconds": 0})
                entry["byte_seconds"] += int(r["memory_bytes"] * seconds)
        touched = [rows[(node.pk, hour)] for (node_pk, hour), node in keys.items()]
        bulk_update(NodeUsage, touched, ["seconds", "cost", "memory_total_bytes", "held"])


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(str(value))
        return True
    except ValueError:
        return False


# ---- quotas ----------------------------------------------------------------------------------


class QuotaExceeded(Exception):
    """A key is over one of its limits; the serving path answers 429."""

    def __init__(self, type_: str, code: str, message: str, retry_after: int):
        super().__init__(message)
        self.type, self.code, self.message, self.retry_after = type_, code, message, retry_after


def _periods(now: datetime) -> dict[str, tuple[str, datetime, datetime]]:
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    month = day.replace(day=1)
    next_month = (month + timedelta(days=32)).replace(day=1)
    return {
        "day": (day.strftime("%Y%m%d"), day, day + timedelta(days=1)),
        "month": (month.strftime("%Y%m"), month, next_month),
    }


def _tokens_between(user_id: int, start: datetime, end: datetime) -> int:
    total = UsageRecord.objects.filter(
        user_id=user_id, started_at__gte=start, started_at__lt=end
    ).aggregate(n=Sum(F("prompt_tokens") + F("completion_tokens")))["n"]
    return int(total or 0)


async def check_quota(caller: Caller | None, request_id: str, reserve: int = 0) -> int:
    """Raise QuotaExceeded when the key's application is over one of the key's limits; count
    the request otherwise, and reserve `reserve` tokens (its max_tokens) against the token
    quotas until it ends (consume_tokens settles). Returns the tokens reserved. Counts are per
    application (the keys' owner), so minting more keys does not multiply a quota; checks and
    reservations are atomic, so parallel requests see each other.

    When Redis does not answer, requests pass (logged): serving matters more than a limit.
    """
    if caller is None or caller.key_id is None:
        return 0
    limits = (caller.requests_per_minute, caller.tokens_per_day, caller.tokens_per_month)
    if all(v is None for v in limits):
        return 0
    try:
        return await _check(caller, request_id, reserve)
    except (RedisError, OSError) as exc:
        log.warning("quotas not enforced (Redis: %s)", exc)
        return 0


async def _check(caller: Caller, request_id: str, reserve: int) -> int:
    r = _redis()
    now = time.time()
    utc = datetime.fromtimestamp(now, UTC)
    periods = [
        (name, limit, *_periods(utc)[name])
        for name, limit in (("day", caller.tokens_per_day), ("month", caller.tokens_per_month))
        if limit is not None
    ]
    keys = [redis_key("tokens", "app", caller.user_id, label) for _, _, label, _, _ in periods]
    for key, (_, _, _, start, end) in zip(keys, periods, strict=True):
        if await r.get(key) is None:  # Redis lost it (or a new period): rebuild from records
            used = await in_pool_thread(_tokens_between)(caller.user_id, start, end)
            await r.set(key, used, nx=True, exat=int(end.timestamp()) + 86400)
    reserved = 0
    if periods:
        refused, used = await r.eval(
            _TOKENS_SCRIPT, len(keys), *keys, reserve, *[limit for _, limit, *_ in periods]
        )
        if int(refused):
            name, limit, _, _, end = periods[int(refused) - 1]
            raise QuotaExceeded(
                "insufficient_quota",
                "insufficient_quota",
                f"this application has used {int(used)} of this key's {limit} tokens per "
                f"{name}; it resets at {end:%Y-%m-%d %H:%M} UTC",
                max(int(end.timestamp() - now), 1),
            )
        reserved = reserve
    if caller.requests_per_minute is not None:
        # Check and count in one step (a script runs atomically): parallel requests cannot
        # all see room for one more.
        admitted, oldest = await r.eval(
            _RPM_SCRIPT,
            1,
            redis_key("rpm", "app", caller.user_id),
            now,
            caller.requests_per_minute,
            request_id,
        )
        if not int(admitted):
            if reserved:
                await _add_tokens(caller, -reserved)  # not admitted after all
            wait = min(math.ceil(float(oldest) + 60 - now), 60)  # oldest may be a later now
            raise QuotaExceeded(
                "rate_limit_error",
                "rate_limit_exceeded",
                f"this key is limited to {caller.requests_per_minute} requests per minute "
                "across its application's keys",
                max(wait, 1),
            )
    return reserved


#: Token quotas: refuse (with the 1-based index of the period) when a count is already at its
#: limit, else reserve ARGV[1] tokens on every period. KEYS: the counts; ARGV[2..]: limits.
_TOKENS_SCRIPT = """
for i, key in ipairs(KEYS) do
  local used = tonumber(redis.call('get', key) or '0')
  if used >= tonumber(ARGV[i + 1]) then return {i, used} end
end
for _, key in ipairs(KEYS) do
  if redis.call('exists', key) == 1 then redis.call('incrby', key, ARGV[1]) end
end
return {0, 0}
"""


#: A sliding 60 s window: drop old entries; refuse when full (with the oldest entry's time),
#: else add this request.
_RPM_SCRIPT = """
redis.call('zremrangebyscore', KEYS[1], 0, tonumber(ARGV[1]) - 60)
if redis.call('zcard', KEYS[1]) >= tonumber(ARGV[2]) then
  local oldest = redis.call('zrange', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, oldest[2] or ARGV[1]}
end
redis.call('zadd', KEYS[1], ARGV[1], ARGV[3])
redis.call('expire', KEYS[1], 61)
return {1, '0'}
"""


async def consume_tokens(caller: Caller | None, tokens: int, reserved: int = 0) -> None:
    """Settle a finished request: its tokens replace what was reserved at admission in its
    application's running day and month counts."""
    if caller is None or caller.key_id is None or tokens == reserved:
        return
    if caller.tokens_per_day is None and caller.tokens_per_month is None:
        return
    try:
        await _add_tokens(caller, tokens - reserved)
    except (RedisError, OSError) as exc:
        log.warning("token count not updated (Redis: %s)", exc)


async def _add_tokens(caller: Caller, delta: int) -> None:
    pipe = _redis().pipeline(transaction=False)
    for label, _, _ in _periods(datetime.now(UTC)).values():
        # Only where the count exists: a missing one is rebuilt from the records.
        pipe.eval(
            "if redis.call('exists', KEYS[1]) == 1 then "
            "return redis.call('incrby', KEYS[1], ARGV[1]) end return nil",
            1,
            redis_key("tokens", "app", caller.user_id, label),
            delta,
        )
    await pipe.execute()


# ---- reports ---------------------------------------------------------------------------------


def _money(d: Decimal) -> float:
    return float(d.quantize(Decimal("1e-6")))


def _per_million(cost: Decimal, tokens: int) -> float | None:
    return _money(cost * 1_000_000 / tokens) if tokens else None


#: A report's usage figures per group, before costs.
_EMPTY = {"requests": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0, "tokens": 0}


def _usage_rows(records, *group) -> dict:
    """Requests, errors and tokens of the records, per value (or tuple) of `group`."""
    fields = {
        "requests": Count("id"),
        "errors": Count(
            "id", filter=Q(outcome__in=[UsageRecord.Outcome.ERROR, UsageRecord.Outcome.REJECTED])
        ),
        "prompt_tokens": Sum("prompt_tokens"),
        "completion_tokens": Sum("completion_tokens"),
    }
    out = {}
    for row in records.values(*group).annotate(**fields).order_by(*group):
        name = tuple(row.pop(g) for g in group)
        row = {k: int(v or 0) for k, v in row.items()}
        row["tokens"] = row["prompt_tokens"] + row["completion_tokens"]
        out[name if len(name) > 1 else name[0]] = row
    return out


def _served_by_node(records) -> dict[str, dict]:
    """Requests and completion tokens each node took part in."""
    out: dict[str, dict] = {}
    for nodes, n in records.values_list("nodes", "completion_tokens"):
        for name in set(nodes or []):
            entry = out.setdefault(name, {"requests": 0, "completion_tokens": 0})
            entry["requests"] += 1
            entry["completion_tokens"] += n
    return out


@dataclass
class _NodeCosts:
    """Node-hours and their cost, split among the deployments that held memory on them."""

    dep_cost: dict[str, Decimal] = field(default_factory=dict)
    dep_hours: dict[str, float] = field(default_factory=dict)
    dep_model: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, dict] = field(default_factory=dict)
    idle: Decimal = Decimal(0)
    warnings: list[str] = field(default_factory=list)

    @staticmethod
    def blank_node() -> dict:
        return {"node_hours": 0.0, "cost": Decimal(0), "idle_cost": Decimal(0), "held_hours": 0.0}


def _node_costs(start: datetime, end: datetime, currency: str) -> _NodeCosts:
    """Each node-hour's cost, split by the memory-time each deployment's replicas held on the
    node; what none held is idle cost."""
    c = _NodeCosts()
    for u in NodeUsage.objects.filter(hour__gte=start, hour__lt=end):
        if u.currency != currency:
            c.warnings.append(f"{u.node_name}: priced in {u.currency}, not {currency}; left out")
            continue
        capacity = u.memory_total_bytes * u.seconds
        shares = {
            dep: (h["byte_seconds"] / capacity if capacity else 0.0) for dep, h in u.held.items()
        }
        total = sum(shares.values())
        if total > 1:  # never bill more than the node
            shares = {dep: s / total for dep, s in shares.items()}
            total = 1.0
        for dep, share in shares.items():
            c.dep_cost[dep] = c.dep_cost.get(dep, Decimal(0)) + u.cost * Decimal(str(share))
            c.dep_hours[dep] = c.dep_hours.get(dep, 0.0) + u.seconds / 3600 * share
            c.dep_model[dep] = u.held[dep]["model"]
        node_idle = u.cost * Decimal(str(1 - total))
        c.idle += node_idle
        n = c.nodes.setdefault(u.node_name, _NodeCosts.blank_node())
        n["node_hours"] += u.seconds / 3600
        n["cost"] += u.cost
        n["idle_cost"] += node_idle
        n["held_hours"] += u.seconds / 3600 * total
    return c


def _with_cost(row: dict, cost: Decimal, hours: float | None = None) -> dict:
    row = dict(row)
    row["cost"] = _money(cost)
    row["cost_per_million_tokens"] = _per_million(cost, row.get("tokens", 0))
    if hours is not None:
        row["node_hours"] = round(hours, 6)
    return row


def _key_rows(records, by_key: dict, by_deployment: dict, dep_cost: dict) -> list[dict]:
    """Each key's usage, and each deployment's cost by the key's share of its tokens."""
    key_cost: dict[tuple, Decimal] = {}
    for (key_id, app, dep), row in _usage_rows(records, "api_key_id", "app", "deployment").items():
        dep_tokens = by_deployment.get(dep, {}).get("tokens", 0)
        if dep_tokens and dep in dep_cost:
            share = Decimal(row["tokens"]) / Decimal(dep_tokens)
            key_cost[(key_id, app)] = (
                key_cost.get((key_id, app), Decimal(0)) + dep_cost[dep] * share
            )
    return [
        {"api_key_id": key_id, "app": app}
        | _with_cost(row, key_cost.get((key_id, app), Decimal(0)))
        for (key_id, app), row in sorted(
            by_key.items(), key=lambda kv: (str(kv[0][1]), str(kv[0][0]))
        )
    ]


def _node_rows(costs: _NodeCosts, served: dict[str, dict]) -> dict[str, dict]:
    rows = {}
    for name in sorted(set(costs.nodes) | set(served)):
        n = costs.nodes.get(name, _NodeCosts.blank_node())
        s = served.get(name, {"requests": 0, "completion_tokens": 0})
        rows[name] = {
            "node_hours": round(n["node_hours"], 6),
            "cost": _money(n["cost"]),
            "idle_cost": _money(n["idle_cost"]),
            "utilisation": round(n["held_hours"] / n["node_hours"], 6) if n["node_hours"] else 0.0,
            "requests": s["requests"],
            "completion_tokens": s["completion_tokens"],
        }
    return rows


def _over_time(records, start: datetime, end: datetime, currency: str) -> list[dict]:
    """Cost and tokens per hour for a day or less, per day beyond."""
    step = timedelta(hours=1) if end - start <= timedelta(days=1) else timedelta(days=1)
    trunc = TruncHour if step == timedelta(hours=1) else TruncDay
    cost_at: dict[datetime, Decimal] = {}
    for u in NodeUsage.objects.filter(hour__gte=start, hour__lt=end, currency=currency):
        at = u.hour if step == timedelta(hours=1) else u.hour.replace(hour=0)
        cost_at[at] = cost_at.get(at, Decimal(0)) + u.cost
    tokens_at = dict(
        records.annotate(at=trunc("started_at", tzinfo=UTC))
        .values("at")
        .annotate(n=Sum(F("prompt_tokens") + F("completion_tokens")))
        .values_list("at", "n")
    )
    series, at = [], start
    while at < end:
        series.append(
            {
                "at": at.isoformat(),
                "cost": _money(cost_at.get(at, Decimal(0))),
                "tokens": int(tokens_at.get(at) or 0),
            }
        )
        at += step
    return series


def build_report(start: datetime, end: datetime) -> dict:
    """Usage and cost over [start, end) from stored records only (so it is reproducible).

    Node cost is split among deployments by the memory-time their replicas held on the node;
    what no replica held is idle cost, shown apart. A deployment's cost is split among keys
    by their share of its tokens.
    """
    currency = settings.BILLING_CURRENCY
    records = UsageRecord.objects.filter(started_at__gte=start, started_at__lt=end)
    by_model, by_deployment = _usage_rows(records, "model"), _usage_rows(records, "deployment")
    costs = _node_costs(start, end, currency)
    deployments = {
        dep: _with_cost(
            by_deployment.get(dep, _EMPTY),
            costs.dep_cost.get(dep, Decimal(0)),
            costs.dep_hours.get(dep, 0.0),
        )
        for dep in sorted(set(by_deployment) | set(costs.dep_cost))
        if dep
    }
    model_cost: dict[str, Decimal] = {}
    for dep, cost in costs.dep_cost.items():
        m = costs.dep_model[dep]
        model_cost[m] = model_cost.get(m, Decimal(0)) + cost
    models = {
        m: _with_cost(by_model.get(m, _EMPTY), model_cost.get(m, Decimal(0)))
        for m in sorted(set(by_model) | set(model_cost))
    }
    by_key = _usage_rows(records, "api_key_id", "app")
    total_cost = sum((n["cost"] for n in costs.nodes.values()), Decimal(0))
    all_tokens = sum(r["tokens"] for r in by_model.values())
    return {
        "start": start.isoformat(),
        "end": end.isoformat(),
        "currency": currency,
        "totals": {
            "requests": sum(r["requests"] for r in by_model.values()),
            "errors": sum(r["errors"] for r in by_model.values()),
            "tokens": all_tokens,
            "node_hours": round(sum(n["node_hours"] for n in costs.nodes.values()), 6),
            "cost": _money(total_cost),
            "idle_cost": _money(costs.idle),
            "cost_per_million_tokens": _per_million(total_cost, all_tokens),
        },
        "by_model": models,
        "by_deployment": deployments,
        "by_key": _key_rows(records, by_key, by_deployment, costs.dep_cost),
        "by_node": _node_rows(costs, _served_by_node(records)),
        "series": _over_time(records, start, end, currency),
        "warnings": costs.warnings,
    }


def save_report(kind: str, start: datetime, end: datetime) -> Report:
    """Compute and store (or recompute in place) the report of a period."""
    data = build_report(start, end)
    report, _ = Report.objects.update_or_create(
        kind=kind, start=start, end=end, defaults={"data": data}
    )
    return report


def period(kind: str, now: datetime | None = None) -> tuple[datetime, datetime]:
    """The last complete day (UTC) or ISO week (Monday to Monday) before now."""
    now = (now or datetime.now(UTC)).astimezone(UTC)
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if kind == Report.Kind.DAILY:
        return today - timedelta(days=1), today
    monday = today - timedelta(days=today.weekday())
    return monday - timedelta(days=7), monday


CSV_COLUMNS = [
    "section",
    "name",
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "tokens",
    "node_hours",
    "cost",
    "idle_cost",
    "cost_per_million_tokens",
    "utilisation",
]


def report_csv(report: Report) -> str:
    """One table of every section of a report."""
    out = io.StringIO()
    w = csv.DictWriter(out, CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    d = report.data
    w.writerow({"section": "totals", "name": "all"} | d["totals"])
    for section in ("by_model", "by_deployment", "by_node"):
        for name, row in d[section].items():
            w.writerow({"section": section.removeprefix("by_"), "name": name} | row)
    for row in d["by_key"]:
        w.writerow({"section": "key", "name": f"{row['app']} (key {row['api_key_id']})"} | row)
    return out.getvalue()


# ---- applications at a glance ----------------------------------------------------------------


def usage_by_key(hours: int = 24, now: datetime | None = None) -> dict:
    """Tokens and requests per API key for each of the last `hours` whole hours up to now
    (the current hour last): the operators' view of every application. Requests made
    without a key (the console) are under key None."""
    now = now or datetime.now(UTC)
    first = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=hours - 1)
    slots = [first + timedelta(hours=i) for i in range(hours)]
    index = {at: i for i, at in enumerate(slots)}
    rows = (
        UsageRecord.objects.filter(started_at__gte=first)
        .annotate(at=TruncHour("started_at", tzinfo=UTC))
        .values("api_key", "app", "user__username", "at")
        .annotate(n=Count("id"), tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
    )
    keys: dict = {}
    for r in rows:
        k = keys.setdefault(
            r["api_key"],
            {
                "api_key": r["api_key"],
                "app": r["app"],
                "owner": r["user__username"] or "",
                "tokens": [0] * hours,
                "requests": [0] * hours,
            },
        )
        i = index.get(r["at"])
        if i is not None:
            k["tokens"][i] += int(r["tokens"] or 0)
            k["requests"][i] += r["n"]
    for k in keys.values():
        k["total_tokens"], k["total_requests"] = sum(k["tokens"]), sum(k["requests"])
    return {
        "hours": [at.isoformat() for at in slots],
        "keys": sorted(keys.values(), key=lambda k: -k["total_tokens"]),
    }
