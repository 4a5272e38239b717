"""Quotas under concurrency: the per-minute window and token reservations are checked and
counted in one atomic step, so parallel requests cannot all see room for one more; every key
of an application shares them."""

from __future__ import annotations

import asyncio
import uuid

import pytest

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


@pytest.mark.django_db(transaction=True)
async def test_parallel_requests_reserve_tokens_so_a_quota_is_not_overrun():
    from apps.usage.services import consume_tokens

    caller = Caller(user_id=10_003, key_id=4, tokens_per_day=100)
    admitted = []

    async def one(i: int) -> None:
        try:
            admitted.append(await check_quota(caller, f"r{i}", reserve=40))
        except QuotaExceeded as exc:
            assert exc.code == "insufficient_quota"

    await asyncio.gather(*(one(i) for i in range(8)))
    assert admitted == [40, 40, 40]  # 0, 40, 80 were under 100; the rest saw 120
    # Each used 10 in the end: settling returns the rest, and there is room again.
    for reserved in admitted:
        await consume_tokens(caller, 10, reserved)
    assert await check_quota(caller, "later", reserve=40) == 40
