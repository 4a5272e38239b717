"""The fleet page's charts: a rolling hour of per-deployment figures, one point every STEP.

A beat task takes each point (record()) and keeps the last hour in one Redis list, so the
charts need no new service and every console shares the work: a console gets the whole
list when it connects, then each new point through the Channels group as it is taken.
Where Prometheus scrapes the control plane, README.md gives the same figures as queries.
"""

from __future__ import annotations

import json
import logging
import math
import time
from datetime import UTC, datetime, timedelta

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db.models import Avg, Count, Sum
from redis.exceptions import RedisError

from apps.console import live
from apps.deployments.autoscaling import load
from apps.deployments.models import Deployment
from apps.usage.models import UsageRecord
from controlplane.redis import key as redis_key
from controlplane.redis import sync_client as _redis

log = logging.getLogger(__name__)

#: Seconds between points, and points kept (an hour).
STEP = 10.0
KEEP = 360


def _key() -> str:
    return redis_key("console", "series")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def point(now: float | None = None) -> dict:
    """Each live deployment's figures over the STEP that ends `now` (epoch seconds)."""
    now = time.time() if now is None else now
    end = datetime.fromtimestamp(now, UTC)
    finished: dict[str, list[tuple]] = {}
    for row in UsageRecord.objects.filter(
        finished_at__gt=end - timedelta(seconds=STEP), finished_at__lte=end
    ).values_list("deployment", "outcome", "completion_tokens", "time_to_first_token_ms"):
        finished.setdefault(row[0], []).append(row[1:])
    out = {}
    for d in Deployment.objects.exclude(state=Deployment.State.STOPPED).select_related("model"):
        rows = finished.get(d.name, [])
        ttfts = [t for outcome, _, t in rows if t is not None and outcome != "error"]
        now_load = load(d)
        slots = d.parallel * now_load.ready
        out[d.name] = {
            "tokens_per_s": round(sum(n for _, n, _ in rows) / STEP, 2),
            "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p95_ms": percentile(ttfts, 95),
            "requests": len(rows),
            "errors": sum(1 for outcome, _, _ in rows if outcome == UsageRecord.Outcome.ERROR),
            "in_flight": min(now_load.in_flight, slots),
            "queue": now_load.waiting + max(0, now_load.in_flight - slots),
            "replicas": now_load.ready,
            "desired": d.replicas,
        }
    return {"t": round(now, 3), "deployments": out, "figures": figures(end)}


#: The deployments table's figures (throughput, time to first token) cover this much traffic.
WINDOW = timedelta(minutes=5)


def figures(end: datetime) -> dict[str, dict]:
    """Each deployment's requests, tokens/s and mean time to first token over WINDOW; sent
    with every point, so that no console queries usage itself."""
    return {
        row["deployment"]: {
            "requests": row["n"],
            "ttft_ms": row["ttft"],
            "tokens_per_s": (row["tokens"] / (row["seconds"] / 1000)) if row["seconds"] else None,
        }
        for row in UsageRecord.objects.filter(
            started_at__gte=end - WINDOW, started_at__lte=end, outcome__in=["ok", "migrated"]
        )
        .values("deployment")
        .annotate(
            n=Count("id"),
            ttft=Avg("time_to_first_token_ms"),
            tokens=Sum("completion_tokens"),
            seconds=Sum("duration_ms"),
        )
    }


def history() -> list[dict]:
    """The points of the last hour, oldest first ([] when Redis does not answer)."""
    try:
        raw = _redis().lrange(_key(), 0, -1)
    except RedisError as exc:
        log.warning("console charts: no history (%s)", exc)
        return []
    return [json.loads(r) for r in raw]


def record(now: float | None = None) -> dict:
    """Take a point, keep it, and send it to every open dashboard."""
    p = point(now)
    pipe = _redis().pipeline(transaction=False)
    pipe.rpush(_key(), json.dumps(p))
    pipe.ltrim(_key(), -KEEP, -1)
    pipe.execute()
    async_to_sync(get_channel_layer().group_send)(live.GROUP, {"type": "series.point", "point": p})
    return p
