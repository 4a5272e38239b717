"""Replica choice against the real Redis: bursts, and prompts no replica holds yet."""

from __future__ import annotations

import asyncio
import time
import uuid

from apps.serving import balancer
from apps.serving.services import Target


def two_targets() -> list[Target]:
    deployment = f"dep-{uuid.uuid4().hex[:8]}"
    return [
        Target(f"r-{uuid.uuid4().hex[:8]}", "node", "addr", deployment, balancer.PREFIX, 8)
        for _ in range(2)
    ]


async def forget(targets: list[Target], hashes: list[str] = ()) -> None:
    keys = [balancer._key(t.replica_id) for t in targets]
    keys += [balancer._prefix_key(targets[0].deployment, h) for h in hashes]
    await balancer._redis().delete(*keys)


async def test_a_burst_of_the_same_new_prompt_is_spread_before_its_counts_reach_redis():
    """8 requests decided at once, before any of their counts is written to Redis: each
    decision sees the ones this process made before it."""
    targets = two_targets()
    hashes = balancer.prefix_hashes([{"role": "user", "content": "What is new?"}], "")
    picked = []

    async def route(i: int) -> None:
        first = (await balancer.order(targets, balancer.PREFIX, "m", hashes))[0]
        balancer.acquire(first.replica_id, f"req-{i}")  # at once, as the serving path does
        picked.append(first.replica_id)

    try:
        await asyncio.gather(*(route(i) for i in range(8)))
        assert sorted(picked.count(t.replica_id) for t in targets) == [4, 4]
        if balancer._background:
            await asyncio.wait(set(balancer._background))  # the counts' writes
        counts = await balancer.in_flight([t.replica_id for t in targets])
        assert sorted(counts.values()) == [4, 4]  # and every count reached Redis
        assert not any(balancer._unwritten.get(t.replica_id) for t in targets)
    finally:
        await forget(targets, hashes)


async def test_a_prompt_no_replica_holds_goes_to_the_least_loaded_one():
    """Within the load bound too: the hash would pick a replica with one stream in flight,
    the other has none, and neither holds the prompt's cache."""
    targets = two_targets()
    hashes = balancer.prefix_hashes([{"role": "user", "content": "Hello?"}], "")
    hashed = balancer._by_rendezvous(targets, hashes[0])[0]
    client = balancer._redis()
    await client.zadd(balancer._key(hashed.replica_id), {"busy": time.time()})
    try:
        order = await balancer.order(targets, balancer.PREFIX, "m", hashes)
        assert order[0] is not hashed
        # Equal loads: the hash decides, the same in every process.
        await forget(targets)
        assert (await balancer.order(targets, balancer.PREFIX, "m", hashes))[0] is hashed
        # Once a replica has served the prefix, it is preferred over an idle one.
        balancer.remember(targets[0].deployment, hashes, order[0].replica_id)
        await asyncio.wait(set(balancer._background))  # the background write
        await client.zadd(balancer._key(order[0].replica_id), {"busy": time.time()})
        assert (await balancer.order(targets, balancer.PREFIX, "m", hashes))[0] is order[0]
    finally:
        await forget(targets, hashes)


async def test_a_holder_keeps_its_prefix_until_every_slot_is_busy():
    """A turn sent elsewhere evaluates its whole history again; one more stream in a batch
    costs its own tokens: the holder keeps it with 6 of 8 slots busy against an idle
    replica, loses it with 8 of 8, and keeps it when the other has no slot free either."""
    targets = two_targets()
    holder, other = targets
    hashes = balancer.prefix_hashes([{"role": "user", "content": "Where were we?"}], "")
    client = balancer._redis()
    now = time.time()
    try:
        balancer.remember(holder.deployment, hashes, holder.replica_id)
        await asyncio.wait(set(balancer._background))
        await client.zadd(balancer._key(holder.replica_id), {f"b{i}": now for i in range(6)})
        assert (await balancer.order(targets, balancer.PREFIX, "m", hashes))[0] is holder
        await client.zadd(balancer._key(holder.replica_id), {f"b{i}": now for i in range(8)})
        assert (await balancer.order(targets, balancer.PREFIX, "m", hashes))[0] is other
        await client.zadd(balancer._key(other.replica_id), {f"b{i}": now for i in range(8)})
        assert (await balancer.order(targets, balancer.PREFIX, "m", hashes))[0] is holder
    finally:
        await forget(targets, hashes)
