"""A Redis that hangs (accepts, never answers) costs one timeout, not one per request: the
breaker then fails calls without touching the network, and lets one through once it is time
to look again. Serving goes on either way (quotas and routing fall back)."""

from __future__ import annotations

import asyncio

from apps.usage.services import Caller, check_quota
from controlplane import redis as R


async def test_a_hanging_redis_costs_one_timeout_then_fails_fast(settings):
    accepted = []

    async def hang(reader, writer):
        accepted.append(writer)
        await asyncio.sleep(60)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    settings.REDIS_URL = f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
    R._clients.clear()
    R.breaker.succeeded()
    caller = Caller(user_id=1, key_id=1, requests_per_minute=5)
    try:
        await check_quota(caller, "first")  # times out; the request passes (logged)
        assert len(accepted) == 1 and R.breaker.open_until > 0
        for i in range(5):  # open: nobody dials the hanging server again
            await check_quota(caller, f"fast-{i}")
        assert len(accepted) == 1
        R.breaker.open_until = 0.0  # the open period is over: one call goes through again
        await check_quota(caller, "probe")
        assert len(accepted) == 2 and R.breaker.open_until > 0
    finally:
        server.close()
        for w in accepted:
            w.close()
        R._clients.clear()
        R.breaker.succeeded()
