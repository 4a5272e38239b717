"""One asyncio Redis client per event loop, for the serving path (routing, quotas).

asyncio connections belong to the loop that opened them; tests and the ASGI server run
several loops, so each gets its own client, forgotten with its loop.
"""

from __future__ import annotations

import asyncio
import weakref

import redis.asyncio as aioredis
from django.conf import settings

_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def client() -> aioredis.Redis:
    """The running loop's client; short timeouts, because callers fall back without Redis."""
    loop = asyncio.get_running_loop()
    found = _clients.get(loop)
    if found is None:
        found = _clients[loop] = aioredis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=1.0, socket_connect_timeout=1.0
        )
    return found
