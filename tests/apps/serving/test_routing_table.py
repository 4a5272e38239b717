"""The web process's table of ready replicas: fresh, stale while a background read runs, read
again when too old, and read afresh when every replica it named is gone. "Another process"
changes the database here as this process's signals do not see."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.db.models import QuerySet
from llamafleet.agent.v1 import agent_pb2 as pb

from apps.deployments import services as deployments
from apps.deployments.models import Replica
from apps.nodes import agent_client
from apps.serving import routing_table
from tests.apps.serving_client import post
from tests.conftest import CHAT, SMOLLM2

pytestmark = pytest.mark.django_db(transaction=True)


@sync_to_async
def set_state_elsewhere(replica_id: str, state: str) -> None:
    """What another web process or a worker would do: no signal reaches this process (a
    plain QuerySet's update, not the models' signalling one)."""
    QuerySet(Replica).filter(pk=replica_id).update(state=state)


@pytest.fixture
def clock(monkeypatch):
    """The table's clock, moved by hand."""
    now = [1000.0]
    monkeypatch.setattr(routing_table, "_now", lambda: now[0])
    routing_table.invalidate()
    yield now
    routing_table.invalidate()


@pytest.fixture
def one_ready(smollm2_model, fake_agent):
    d = deployments.do_create("chat", smollm2_model.name, replicas=1, context_length=512,
                              parallel=2)  # fmt: skip
    deployments.reconcile(d.pk)
    replica = d.replica_set.get()
    deployments.load(str(replica.pk))
    return str(replica.pk)


async def test_a_table_past_its_second_routes_at_once_while_a_read_brings_it_up_to_date(
    one_ready, clock, settings
):
    assert [r[0] for r in await routing_table.ready_rows(SMOLLM2)] == [one_ready]
    await set_state_elsewhere(one_ready, Replica.State.STOPPED)
    clock[0] += settings.ROUTING_CACHE_SECONDS / 2
    assert [r[0] for r in await routing_table.ready_rows(SMOLLM2)] == [one_ready]  # fresh
    assert not routing_table._refreshing
    clock[0] += settings.ROUTING_CACHE_SECONDS
    # Stale: the answer comes without waiting for the database, and one read starts.
    assert [r[0] for r in await routing_table.ready_rows(SMOLLM2)] == [one_ready]
    await routing_table.ready_rows(SMOLLM2)  # a second request starts no second read
    assert len(routing_table._refreshing) == 1
    await routing_table._refreshing[SMOLLM2]
    assert await routing_table.ready_rows(SMOLLM2) == []  # the read saw the change


async def test_a_table_older_than_the_stale_bound_is_read_before_routing(
    one_ready, clock, settings
):
    assert [r[0] for r in await routing_table.ready_rows(SMOLLM2)] == [one_ready]
    await set_state_elsewhere(one_ready, Replica.State.STOPPED)
    clock[0] += settings.ROUTING_CACHE_SECONDS + routing_table.ROUTING_STALE_SECONDS + 1
    assert await routing_table.ready_rows(SMOLLM2) == []
    assert not routing_table._refreshing


async def test_a_read_that_an_invalidation_overtook_is_not_cached(one_ready, clock):
    query = routing_table._query

    async def slow_query(model):
        rows = await query(model)
        routing_table.invalidate()  # a change lands while the rows travel back
        return rows

    routing_table._query = slow_query
    try:
        assert [r[0] for r in await routing_table.ready_rows(SMOLLM2)] == [one_ready]
    finally:
        routing_table._query = query
    assert SMOLLM2 not in routing_table._cache


async def test_a_request_whose_known_replicas_are_all_gone_goes_to_one_read_afresh(
    two_replicas, alice_key, clock
):
    """This process's table names only replica A; elsewhere A was freed and B became ready.
    The request fails on A (not found), then reads the table again and is served by B."""
    _, agents = two_replicas
    a, b = sorted(agents)
    await set_state_elsewhere(b, Replica.State.LOADING)
    assert [r[0] for r in await routing_table.ready_rows(SMOLLM2)] == [a]
    await set_state_elsewhere(b, Replica.State.READY)
    await set_state_elsewhere(a, Replica.State.STOPPED)
    await sync_to_async(agent_client.stub(agents[a].address).FreeMemory)(
        pb.FreeMemoryRequest(replica_id=a), metadata=agent_client.metadata()
    )
    assert [r[0] for r in await routing_table.ready_rows(SMOLLM2)] == [a]  # still cached
    resp = await post(alice_key, {"model": SMOLLM2, "messages": CHAT, "max_tokens": 4})
    assert resp.status_code == 200, resp.content
    assert resp["X-LlamaFleet-Replica"] == b


async def test_when_no_replica_is_left_the_request_gets_no_replica_and_retry_after(
    two_replicas, alice_key, clock
):
    """Both replicas the cached table names were freed elsewhere and nothing replaced them:
    the answer is what an empty table gives (503 no_replica, Retry-After), not a failure."""
    _, agents = two_replicas
    assert sorted(r[0] for r in await routing_table.ready_rows(SMOLLM2)) == sorted(agents)
    for replica_id, agent in agents.items():
        await set_state_elsewhere(replica_id, Replica.State.STOPPED)
        await sync_to_async(agent_client.stub(agent.address).FreeMemory)(
            pb.FreeMemoryRequest(replica_id=replica_id), metadata=agent_client.metadata()
        )
    resp = await post(alice_key, {"model": SMOLLM2, "messages": CHAT, "max_tokens": 4})
    assert resp.status_code == 503 and resp["Retry-After"], resp.content
    assert resp.json()["error"]["code"] == "no_replica"
