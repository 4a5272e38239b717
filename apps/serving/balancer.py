"""Replica choice shared by every control-plane process, through Redis.

In-flight generations of a replica are a sorted set of request ids scored by start time, so a
process that dies mid-request does not inflate a count for ever: entries older than the
request timeout no longer count. Round-robin is one shared counter per model. Both cost one
round trip each on the hot path. When Redis is unreachable, routing falls back to this
process's own counter rather than refusing to serve.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from django.conf import settings
from redis.exceptions import RedisError

from apps.serving import metrics
from controlplane.redis import client as _redis

log = logging.getLogger(__name__)

ROUND_ROBIN = "round_robin"
LEAST_CONNECTIONS = "least_connections"

_local_counter = itertools.count()
_background: set[asyncio.Task] = set()


def _key(replica_id: str) -> str:
    return f"llamafleet:inflight:{replica_id}"


async def order(targets: list, policy: str, model: str) -> list:
    """Targets in the order to try them under the policy."""
    if len(targets) < 2:
        return list(targets)
    try:
        pipe = _redis().pipeline(transaction=False)
        pipe.incr(f"llamafleet:rr:{model}")
        if policy == LEAST_CONNECTIONS:
            floor = time.time() - settings.REQUEST_TIMEOUT_SECONDS
            for t in targets:
                pipe.zcount(_key(t.replica_id), floor, "+inf")
        turn, *counts = await pipe.execute()
    except (RedisError, OSError) as exc:
        log.warning("routing without Redis (%s): round-robin in this process only", exc)
        metrics.ROUTING_FALLBACKS.inc()
        turn, counts = next(_local_counter), []
    k = turn % len(targets)
    rotated = targets[k:] + targets[:k]
    if counts:
        load = {t.replica_id: c for t, c in zip(targets, counts, strict=True)}
        rotated.sort(key=lambda t: load[t.replica_id])  # stable: ties keep round-robin order
    return rotated


async def in_flight(replica_ids: list[str]) -> dict[str, int]:
    """Shared in-flight counts (for the API and tests)."""
    floor = time.time() - settings.REQUEST_TIMEOUT_SECONDS
    pipe = _redis().pipeline(transaction=False)
    for rid in replica_ids:
        pipe.zcount(_key(rid), floor, "+inf")
    return dict(zip(replica_ids, await pipe.execute(), strict=True))


async def acquire(replica_id: str, request_id: str) -> None:
    """Count a generation against a replica."""
    try:
        pipe = _redis().pipeline(transaction=False)
        pipe.zadd(_key(replica_id), {request_id: time.time()})
        pipe.expire(_key(replica_id), int(settings.REQUEST_TIMEOUT_SECONDS) + 60)
        await pipe.execute()
    except (RedisError, OSError) as exc:
        log.warning("could not count a request in Redis: %s", exc)


def release(replica_id: str, request_id: str) -> None:
    """Stop counting it; runs in the background so that a cancelled stream still releases."""

    async def _release():
        try:
            await _redis().zrem(_key(replica_id), request_id)
        except (RedisError, OSError) as exc:
            log.warning("could not release a request in Redis: %s", exc)

    task = asyncio.get_running_loop().create_task(_release())
    _background.add(task)
    task.add_done_callback(_background.discard)
