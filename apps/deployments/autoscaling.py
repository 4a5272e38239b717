"""Autoscaling: a deployment's replica count follows its load, down to zero if allowed.

Every TICK_SECONDS (beat) each autoscaled deployment takes one sample of its load: the
requests in flight on its replicas, from the routing counters in Redis that every web
process shares (raised to what the agents last reported, when higher: a web process that
lost Redis still counts there), plus the requests held waiting for a first replica. The
samples are kept in Redis for the longest window.

- Up: as soon as the mean load over the window needs more replicas than there are.
- Down: only when every sample of the scale-down delay needed fewer, and the whole delay
  has been observed (a fresh autoscaler never scales down on a short history).
- Two changes are at least the cooldown apart, except a start from zero: a request waiting
  at zero replicas starts the first ones at once (wake(), called by the web process).

In shadow mode the decisions are recorded as deployment events and nothing changes. Changes
are events too, with the figures behind them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from redis.exceptions import RedisError

from apps.deployments.models import Deployment, Replica, ScalingPolicy
from controlplane.errors import Conflict, DomainError
from controlplane.redis import key as redis_key
from controlplane.redis import sync_client as _redis

log = logging.getLogger(__name__)
D = Deployment.State
P = ScalingPolicy

#: Seconds between samples (the beat schedule).
TICK_SECONDS = 5.0


def waiting_key(model_name: str) -> str:
    """Requests held by web processes until a replica of the model is ready (a sorted set
    of request ids by arrival)."""
    return redis_key("waiting", model_name)


def _samples_key(deployment_id: int) -> str:
    return redis_key("autoscale", str(deployment_id))


# ---- settings ------------------------------------------------------------------------------


#: A policy's settings, in the order the API shows them.
FIELDS = (
    "mode",
    "min_replicas",
    "max_replicas",
    "metric",
    "target",
    "window_seconds",
    "scale_down_delay_seconds",
    "cooldown_seconds",
)


def check_policy(d: Deployment, values: dict) -> dict:
    """Validate a policy's fields (merged over the current ones); returns them cleaned."""
    if d.split_mode in (Deployment.SplitMode.LAYER, Deployment.SplitMode.TENSOR):
        raise Conflict(f"{d.name} is split over several nodes and runs one copy: not autoscaled")
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise DomainError(f"unknown autoscaling field(s): {', '.join(sorted(unknown))}")
    v = dict(values)
    if v.get("mode", P.Mode.ON) not in P.Mode.values:
        raise DomainError(f"mode must be one of {', '.join(P.Mode.values)}")
    if v.get("metric", P.Metric.IN_FLIGHT_PER_SLOT) not in P.Metric.values:
        raise DomainError(f"metric must be one of {', '.join(P.Metric.values)}")
    lo, hi = v.get("min_replicas", 1), v.get("max_replicas", 4)
    if not (
        isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= Deployment.MAX_REPLICAS
    ):
        raise DomainError(
            f"min_replicas and max_replicas must be whole numbers with "
            f"0 <= min <= max <= {Deployment.MAX_REPLICAS}"
        )
    if hi < 1:
        raise DomainError("max_replicas must be at least 1")
    target = v.get("target", 0.75)
    if not isinstance(target, int | float) or not 0 < target <= 1000:
        raise DomainError("target must be a number above 0")
    for name, top in (
        ("window_seconds", 3600),
        ("scale_down_delay_seconds", 86400),
        ("cooldown_seconds", 3600),
    ):
        n = v.get(name, 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= top:
            raise DomainError(f"{name} must be a whole number of seconds, 0..{top}")
    if v.get("window_seconds", TICK_SECONDS) < TICK_SECONDS:
        raise DomainError(f"window_seconds must be at least {TICK_SECONDS:.0f} (one sample)")
    return v


def do_set_policy(d: Deployment, values: dict) -> ScalingPolicy:
    """Create or change a deployment's policy; with mode on, its replica count moves into
    the new bounds at once."""
    current = ScalingPolicy.objects.filter(deployment=d).first()
    merged = {f: getattr(current, f) for f in FIELDS} if current else {}
    merged.update(values)
    cleaned = check_policy(d, merged)
    from apps.deployments.services import record_event

    with transaction.atomic():
        policy, _ = ScalingPolicy.objects.update_or_create(deployment=d, defaults=cleaned)
        record_event(
            d,
            f"autoscaling {policy.mode}: {policy.min_replicas}..{policy.max_replicas} replicas, "
            f"target {policy.target:g} {_unit(policy)}, window {policy.window_seconds} s, "
            f"scale-down delay {policy.scale_down_delay_seconds} s, "
            f"cooldown {policy.cooldown_seconds} s",
        )
        if policy.mode == P.Mode.ON:
            bounded = min(max(d.replicas, policy.min_replicas), policy.max_replicas)
            if bounded != d.replicas:
                _set_replicas(d, policy, bounded, "to fit the new bounds")
    return policy


def _unit(p: ScalingPolicy) -> str:
    return "in flight per slot" if p.metric == P.Metric.IN_FLIGHT_PER_SLOT else "queued per replica"


def _set_replicas(d: Deployment, policy: ScalingPolicy, n: int, why: str) -> None:
    """Change the desired count (under the caller's transaction) and reconcile after it."""
    from apps.deployments.services import record_event
    from apps.deployments.tasks import reconcile_deployment

    before = d.replicas
    Deployment.objects.filter(pk=d.pk).update(replicas=n)
    ScalingPolicy.objects.filter(pk=policy.pk).update(
        last_scaled_at=timezone.now(), last_desired=n, last_reason=why
    )
    d.replicas = n
    record_event(d, f"autoscaler: {before} -> {n} replica(s): {why}")
    reconcile_deployment.delay_on_commit(d.pk)


# ---- waking from zero ----------------------------------------------------------------------


def wake(model_name: str) -> list[str]:
    """Deployments of the model that the autoscaler runs (mode on, not stopped); those at zero
    replicas get their first ones now. Called by the web process for a request that found no
    ready replica: [] means nothing will come, so the request is refused at once."""
    names = []
    for d in (
        Deployment.objects.filter(model__name=model_name, autoscaling__mode=P.Mode.ON)
        .exclude(state__in=[D.STOPPING, D.STOPPED])
        .select_related("autoscaling")
    ):
        names.append(d.name)
        if d.replicas:
            continue
        with transaction.atomic():
            locked = Deployment.objects.select_for_update().get(pk=d.pk)
            if locked.replicas == 0:  # another request may have woken it meanwhile
                n = max(1, d.autoscaling.min_replicas)
                _set_replicas(locked, d.autoscaling, n, "a request is waiting")
    return names


# ---- sampling and deciding -----------------------------------------------------------------


@dataclass
class Sample:
    at: float
    load: float  # requests in flight plus waiting
    ready: int  # ready replicas when sampled

    def encode(self) -> str:
        return f"{self.at:.3f}:{self.load:g}:{self.ready}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Sample:
        at, load, ready = (raw.decode() if isinstance(raw, bytes) else raw).split(":")
        return cls(float(at), float(load), int(ready))


def per_replica(p: ScalingPolicy, parallel: int) -> float:
    """The load one replica should carry under the policy."""
    if p.metric == P.Metric.IN_FLIGHT_PER_SLOT:
        return p.target * parallel
    return parallel + p.target  # its slots full, plus `target` queued


@dataclass
class Decision:
    desired: int
    reason: str


def decide(
    p: ScalingPolicy,
    current: int,
    parallel: int,
    samples: list[Sample],
    now: float,
    last_scaled: float | None,
) -> Decision | None:
    """The replica count to move to, or None to stay. Pure: tested on its own."""
    if not samples:
        return None
    cap = per_replica(p, parallel)

    def need(load: float) -> int:
        return min(max(math.ceil(load / cap - 1e-9), p.min_replicas), p.max_replicas)

    in_window = [s for s in samples if s.at >= now - p.window_seconds] or samples[-1:]
    mean = sum(s.load for s in in_window) / len(in_window)
    latest = samples[-1]
    cooled = last_scaled is None or now - last_scaled >= p.cooldown_seconds
    if current < p.min_replicas:
        return Decision(p.min_replicas, f"below the minimum of {p.min_replicas}")
    if current > p.max_replicas:
        return Decision(p.max_replicas, f"above the maximum of {p.max_replicas}")
    if current == 0 and latest.load > 0:
        return Decision(
            max(need(latest.load), 1), f"{latest.load:g} request(s) waiting at zero replicas"
        )
    up = need(mean)
    if up > current and cooled:
        return Decision(
            up,
            f"load {mean:.2f} over {p.window_seconds} s, {cap:g} per replica "
            f"(target {p.target:g} {_unit(p)})",
        )
    observed = samples[0].at <= now - p.scale_down_delay_seconds
    delay = [s for s in samples if s.at >= now - p.scale_down_delay_seconds]
    if observed and delay and cooled:
        peak = max(s.load for s in delay)
        down = need(peak)
        if down < current:
            return Decision(
                down,
                f"load at most {peak:g} for {p.scale_down_delay_seconds} s, {cap:g} per replica "
                f"(target {p.target:g} {_unit(p)})",
            )
    return None


@dataclass(frozen=True)
class Load:
    """A deployment's load now: requests on its ready replicas (streaming or queued in an
    engine), requests held waiting for a first replica, and its ready replicas."""

    in_flight: int
    waiting: int
    ready: int


def load(d: Deployment) -> Load:
    """Read from the routing counters in Redis, raised to the agents' last reports."""
    from apps.nodes.models import Node

    live = list(
        Replica.objects.filter(deployment=d, state=Replica.State.READY).values_list("pk", "node_id")
    )
    reported: dict[str, int] = {}
    for reports in Node.objects.filter(pk__in={n for _, n in live}).values_list(
        "reported_replicas", flat=True
    ):
        for r in reports or ():
            reported[str(r.get("replica_id"))] = int(r.get("in_flight") or 0)
    floor = time.time() - settings.REQUEST_TIMEOUT_SECONDS
    counted: list[int] = []
    waiting = 0
    try:
        pipe = _redis().pipeline(transaction=False)
        for pk, _ in live:
            pipe.zcount(redis_key("inflight", str(pk)), floor, "+inf")
        pipe.zcount(waiting_key(d.model.name), time.time() - settings.COLD_START_TIMEOUT, "+inf")
        *counted, waiting = pipe.execute()
    except RedisError as exc:
        log.warning("autoscaler: no routing counters (%s): agents' reports only", exc)
        counted = [0] * len(live)
    in_flight = sum(
        max(c, reported.get(str(pk), 0)) for (pk, _), c in zip(live, counted, strict=True)
    )
    return Load(in_flight=in_flight, waiting=int(waiting), ready=len(live))


def measure(d: Deployment) -> tuple[float, int]:
    """(requests in flight on the deployment's replicas plus those waiting, ready replicas)."""
    now = load(d)
    return float(now.in_flight + now.waiting), now.ready


def _history(d: Deployment, p: ScalingPolicy, sample: Sample) -> list[Sample]:
    keep = max(p.window_seconds, p.scale_down_delay_seconds) + 2 * TICK_SECONDS
    key = _samples_key(d.pk)
    try:
        pipe = _redis().pipeline(transaction=False)
        pipe.zadd(key, {sample.encode(): sample.at})
        pipe.zremrangebyscore(key, "-inf", sample.at - keep)
        pipe.expire(key, int(keep) + 60)
        pipe.zrange(key, 0, -1)
        return [Sample.decode(raw) for raw in pipe.execute()[-1]]
    except RedisError as exc:
        log.warning("autoscaler: no sample history (%s)", exc)
        return [sample]


def forget(deployment_id: int) -> None:
    """Drop a deployment's samples (its policy changed or it stopped)."""
    try:
        _redis().delete(_samples_key(deployment_id))
    except RedisError:
        pass


def tick() -> dict[str, int]:
    """One sample and decision per autoscaled deployment; returns the changes made."""
    changed = {}
    for p in ScalingPolicy.objects.exclude(mode=P.Mode.OFF).select_related("deployment__model"):
        d = p.deployment
        if d.state in (D.STOPPING, D.STOPPED):
            continue
        load, ready = measure(d)
        now = time.time()
        samples = _history(d, p, Sample(now, load, ready))
        last = p.last_scaled_at.timestamp() if p.last_scaled_at else None
        decision = decide(p, d.replicas, d.parallel, samples, now, last)
        if decision is None:
            continue
        if p.mode == P.Mode.SHADOW:
            if decision.desired != p.last_desired:
                from apps.deployments.services import record_event

                ScalingPolicy.objects.filter(pk=p.pk).update(
                    last_desired=decision.desired, last_reason=decision.reason
                )
                record_event(
                    d,
                    f"autoscaler (shadow): would scale {d.replicas} -> {decision.desired} "
                    f"replica(s): {decision.reason}",
                )
            continue
        with transaction.atomic():
            locked = Deployment.objects.select_for_update().get(pk=d.pk)
            if locked.replicas == d.replicas and locked.state not in (D.STOPPING, D.STOPPED):
                _set_replicas(locked, p, decision.desired, decision.reason)
                changed[d.name] = decision.desired
    return changed
