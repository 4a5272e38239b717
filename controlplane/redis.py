"""One asyncio Redis client per event loop, for the serving path (routing, quotas), behind a
circuit breaker.

asyncio connections belong to the loop that opened them; tests and the ASGI server run
several loops, so each gets its own client, forgotten with its loop.

Callers fall back when Redis fails (per-process routing, quotas not enforced). A Redis that
hangs rather than refusing would still cost each call its whole timeout, on every request's
way to its first token; so after a failure the breaker fails calls at once for OPEN_SECONDS,
then lets one through to see whether Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

import redis.asyncio as aioredis
from django.conf import settings
from redis import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: Seconds calls fail fast after Redis failed (then one is let through).
OPEN_SECONDS = 5.0
_FAILURES = (RedisConnectionError, RedisTimeoutError, OSError)


class CircuitOpen(RedisConnectionError):
    """Redis failed less than OPEN_SECONDS ago: not tried."""


class _Breaker:
    def __init__(self):
        self.open_until = 0.0

    def check(self) -> None:
        if time.monotonic() < self.open_until:
            raise CircuitOpen("Redis failed moments ago; not tried (circuit open)")

    def failed(self, exc: Exception) -> None:
        if time.monotonic() >= self.open_until:
            log.warning("Redis failed (%s): failing fast for %.0f s", exc, OPEN_SECONDS)
        self.open_until = time.monotonic() + OPEN_SECONDS

    def succeeded(self) -> None:
        self.open_until = 0.0


breaker = _Breaker()


class _BreakerPipeline(Pipeline):
    async def execute(self, raise_on_error: bool = True):
        breaker.check()
        try:
            result = await super().execute(raise_on_error)
        except _FAILURES as exc:
            breaker.failed(exc)
            raise
        breaker.succeeded()
        return result


class _BreakerRedis(aioredis.Redis):
    async def execute_command(self, *args, **options):
        breaker.check()
        try:
            result = await super().execute_command(*args, **options)
        except _FAILURES as exc:
            breaker.failed(exc)
            raise
        breaker.succeeded()
        return result

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        return _BreakerPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )


def client() -> aioredis.Redis:
    """The running loop's client; short timeouts, because callers fall back without Redis."""
    loop = asyncio.get_running_loop()
    found = _clients.get(loop)
    if found is None:
        found = _clients[loop] = _BreakerRedis.from_url(
            settings.REDIS_URL, socket_timeout=1.0, socket_connect_timeout=1.0
        )
    return found


_sync: Redis | None = None


def sync_client() -> Redis:
    """The process's synchronous client (thread-safe pool), for sync code: tasks, the
    heartbeat API. Short timeouts: callers fall back without Redis."""
    global _sync
    if _sync is None:
        _sync = Redis.from_url(settings.REDIS_URL, socket_timeout=2.0, socket_connect_timeout=2.0)
    return _sync


def key(*parts) -> str:
    """A Redis key of this stack: its namespace, then the parts (see REDIS_NAMESPACE)."""
    return ":".join([settings.REDIS_NAMESPACE, *map(str, parts)])
