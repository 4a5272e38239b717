"""The requests-per-minute window under concurrency: check and count are one atomic step, so
parallel requests cannot all see room for one more; every key of an application shares it."""

from __future__ import annotations

import asyncio
import uuid

from apps.usage.services import Caller, QuotaExceeded, check_quota


async def test_parallel_requests_admit_exactly_the_limit():
    app_a = Caller(user_id=10_001, key_id=1, requests_per_minute=5)
    same_app_other_key = Caller(user_id=10_001, key_id=2, requests_per_minute=5)

    async def one(caller) -> bool:
        try:
            await check_quota(caller, uuid.uuid4().hex)
        except QuotaExceeded as exc:
            assert exc.code == "rate_limit_exceeded" and 1 <= exc.retry_after <= 60
            return False
        return True

    results = await asyncio.gather(
        *(one(app_a if i % 2 else same_app_other_key) for i in range(40))
    )
    assert sum(results) == 5
    # Another application has its own window.
    assert await one(Caller(user_id=10_002, key_id=3, requests_per_minute=5))
