"""Requests for a model scaled to zero wait for its first replica (as KubeAI's gateway does).

A request that finds no ready replica asks the autoscaler to wake the model's deployments
(autoscaling.wake). If one is autoscaled, the request is counted in Redis as waiting (the
autoscaler adds it to the load, so a crowd at zero brings more than one replica) and polls
the routing table until a replica is ready or COLD_START_TIMEOUT passes: then 503 with
Retry-After. Beyond COLD_START_MAX_WAITING waiting requests per model, 503 at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from asgiref.sync import sync_to_async
from django.conf import settings
from redis.exceptions import RedisError

from apps.deployments import autoscaling
from controlplane.redis import client as _redis

log = logging.getLogger(__name__)

#: Seconds between looks at the routing table while waiting (it is not cached while empty).
POLL_SECONDS = 0.25
#: Waiting requests of this process, per model, for when Redis does not answer.
_local: dict[str, int] = {}


class ColdStartError(Exception):
    """Waiting is refused (too many waiting) or ran out; the caller answers 503."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.message, self.retry_after = message, retry_after


async def wait_for_targets(model: str, lookup) -> list:
    """Targets from `lookup()` once a replica is ready; [] at once when no autoscaled
    deployment serves the model (nothing would come)."""
    if not await sync_to_async(autoscaling.wake)(model):
        return []
    key, rid = autoscaling.waiting_key(model), uuid.uuid4().hex
    _local[model] = _local.get(model, 0) + 1
    try:
        waiting = await _count_in(key, rid, model)
        if waiting > settings.COLD_START_MAX_WAITING:
            raise ColdStartError(
                f"'{model}' is starting and {waiting - 1} requests already wait for it",
                retry_after=10,
            )
        deadline = time.monotonic() + settings.COLD_START_TIMEOUT
        log.info("request waits for a replica of %s (%d waiting)", model, waiting)
        while time.monotonic() < deadline:
            targets = await lookup()
            if targets:
                return targets
            await asyncio.sleep(POLL_SECONDS)
        raise ColdStartError(
            f"no replica of '{model}' was ready within {settings.COLD_START_TIMEOUT:.0f} s",
            retry_after=30,
        )
    finally:
        _local[model] -= 1
        try:
            await _redis().zrem(key, rid)
        except (RedisError, OSError):
            pass


async def _count_in(key: str, rid: str, model: str) -> int:
    now = time.time()
    try:
        pipe = _redis().pipeline(transaction=False)
        pipe.zadd(key, {rid: now})
        pipe.zremrangebyscore(key, "-inf", now - settings.COLD_START_TIMEOUT)
        pipe.expire(key, int(settings.COLD_START_TIMEOUT) + 60)
        pipe.zcard(key)
        return (await pipe.execute())[-1]
    except (RedisError, OSError) as exc:
        log.warning("counting waiting requests in this process only: %s", exc)
        return _local[model]
