"""How agents' reports change replicas, without engines: a report is a snapshot that may
arrive late, so a ready replica missing from one report is not yet gone."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

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


def test_a_replica_missing_for_the_grace_period_fails(ready_replica):
    rid = str(ready_replica.pk)
    record_heartbeat(report([]))
    Replica.objects.filter(pk=rid).update(
        missing_since=timezone.now() - timedelta(seconds=services.REPORT_GRACE_SECONDS + 1)
    )
    record_heartbeat(report([]))
    r = Replica.objects.get(pk=rid)
    assert r.state == "failed" and "no longer holds" in r.error


def test_a_restart_fails_it_at_once(ready_replica):
    rid = str(ready_replica.pk)
    record_heartbeat(report([]) | {"boot_id": "boot-2"})
    assert Replica.objects.get(pk=rid).state == "failed"
