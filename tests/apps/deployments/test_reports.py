"""How agents' reports change replicas, without engines: a report is a snapshot that may
arrive late, so a ready replica missing from one report is not yet gone."""

from __future__ import annotations

import pytest

from apps.deployments import services
from apps.deployments.models import Deployment, Replica
from apps.nodes.services import record_heartbeat

pytestmark = pytest.mark.django_db(transaction=True)  # reactions run on commit


def report(replicas: list[str]) -> dict:
    return {
        "node_name": "n1",
        "address": "10.0.0.1:50051",
        "memory_total_bytes": 8 << 30,
        "memory_available_bytes": 6 << 30,
        "boot_id": "boot-1",
        "replicas": [
            {"replica_id": r, "model_name": "m", "state": "REPLICA_STATE_READY", "memory_bytes": 1}
            for r in replicas
        ],
    }


@pytest.fixture
def ready_replica(smollm2_model):
    node = record_heartbeat(report([]))
    d = Deployment.objects.create(
        name="d", model=smollm2_model, replicas=1, context_length=512, parallel=2,
        state=Deployment.State.READY,
    )  # fmt: skip
    return Replica.objects.create(deployment=d, node=node, state=Replica.State.READY)


def test_a_replica_missing_from_one_late_report_stays_ready(ready_replica):
    rid = str(ready_replica.pk)
    record_heartbeat(report([]))  # taken before the replica was ready
    r = Replica.objects.get(pk=rid)
    assert r.state == "ready" and r.missing_since is not None
    record_heartbeat(report([rid]))  # the next one has it
    r = Replica.objects.get(pk=rid)
    assert r.state == "ready" and r.missing_since is None


def test_a_replica_missing_for_the_grace_period_fails(ready_replica, clock):
    rid = str(ready_replica.pk)
    record_heartbeat(report([]))
    clock.shift(services.REPORT_GRACE_SECONDS - 1)
    record_heartbeat(report([]))
    assert Replica.objects.get(pk=rid).state == "ready"  # not yet
    clock.shift(2)
    record_heartbeat(report([]))
    r = Replica.objects.get(pk=rid)
    assert r.state == "failed" and "no longer holds" in r.error


def test_a_restart_fails_it_at_once(ready_replica):
    rid = str(ready_replica.pk)
    record_heartbeat(report([]) | {"boot_id": "boot-2"})
    assert Replica.objects.get(pk=rid).state == "failed"


def test_a_late_reaction_from_a_replaced_boot_stands_down(ready_replica, clock):
    """Reactions take the node's id and read it afresh: one from boot-1 that runs after boot-2
    registered must not judge boot-2's replicas by boot-1's snapshot."""
    rid = str(ready_replica.pk)
    record_heartbeat(report([rid]) | {"boot_id": "boot-2"})  # boot-2 holds it
    record_heartbeat(report([]) | {"boot_id": "boot-2"})  # a late snapshot: missing since now
    clock.shift(services.REPORT_GRACE_SECONDS + 1)
    services.react_to_report(ready_replica.node_id, "boot-1", [])  # late, from the old boot
    assert Replica.objects.get(pk=rid).state == "ready"
    services.react_to_report(ready_replica.node_id, "boot-2", [])  # the same from boot-2 counts
    assert Replica.objects.get(pk=rid).state == "failed"
