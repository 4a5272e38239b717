"""Agents register and report with the node token; quiet nodes are marked unreachable."""

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from apps.nodes import services
from apps.nodes.models import Node

pytestmark = pytest.mark.django_db

REPORT = {
    "node_name": "gpu-box-1",
    "address": "10.0.0.5:50051",
    "version": "0.1.0",
    "memory_total_bytes": 64 * 2**30,
    "memory_available_bytes": 60 * 2**30,
    "cpu_cores": 16,
    "accelerators": ["fake GPU (no GPU on the test machine)"],
    "replicas": [],
    "in_flight": 0,
}


def agent_client(token):
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return c


def test_heartbeat_needs_the_node_token(settings, alice_key):
    assert (
        agent_client("wrong").post("/api/v1/agent/heartbeat", REPORT, format="json").status_code
        == 403
    )
    # An API key is for clients, not agents.
    assert (
        agent_client(alice_key).post("/api/v1/agent/heartbeat", REPORT, format="json").status_code
        == 403
    )
    ok = agent_client(settings.NODE_TOKEN).post("/api/v1/agent/heartbeat", REPORT, format="json")
    assert ok.status_code == 200 and ok.json() == {"node": "gpu-box-1", "state": "ready"}


def test_first_heartbeat_registers_and_later_ones_refresh(settings, ops):
    c = agent_client(settings.NODE_TOKEN)
    c.post("/api/v1/agent/heartbeat", REPORT, format="json")
    c.post(
        "/api/v1/agent/heartbeat",
        REPORT | {"memory_available_bytes": 1234, "in_flight": 3, "load_average": 1.5},
        format="json",
    )
    [node] = ops.get("/api/v1/nodes/").json()["results"]
    assert node["name"] == "gpu-box-1" and node["address"] == "10.0.0.5:50051"
    assert node["memory_available_bytes"] == 1234 and node["in_flight"] == 3
    assert node["cpu_cores"] == 16 and node["heartbeat_age_seconds"] < 5
    assert node["load_average"] == 1.5
    bad = c.post("/api/v1/agent/heartbeat", {"node_name": ""}, format="json")
    assert bad.status_code == 400 and "required" in bad.json()["detail"]


def test_sweep_marks_quiet_nodes_unreachable_once(settings):
    node = services.record_heartbeat(REPORT)
    assert services.sweep_stale_nodes() == []
    Node.objects.filter(pk=node.pk).update(
        last_heartbeat_at=timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT_SECONDS + 1)
    )
    assert services.sweep_stale_nodes() == ["gpu-box-1"]
    assert services.sweep_stale_nodes() == []  # already marked: nothing to do
    node.refresh_from_db()
    assert node.state == Node.State.UNREACHABLE
    services.record_heartbeat(REPORT)  # it came back
    node.refresh_from_db()
    assert node.state == Node.State.READY


def test_drain_and_undrain_survive_heartbeats(settings, ops):
    agent_client(settings.NODE_TOKEN).post("/api/v1/agent/heartbeat", REPORT, format="json")
    assert APIClient().post("/api/v1/nodes/gpu-box-1/drain/").status_code in (401, 403)
    drained = ops.post("/api/v1/nodes/gpu-box-1/drain/")
    assert drained.status_code == 200 and drained.json()["draining"] is True
    # The agent's next report refreshes liveness but leaves the operator's drain alone.
    agent_client(settings.NODE_TOKEN).post("/api/v1/agent/heartbeat", REPORT, format="json")
    assert Node.objects.get(name="gpu-box-1").draining is True
    assert ops.post("/api/v1/nodes/gpu-box-1/undrain/").json()["draining"] is False
    assert ops.post("/api/v1/nodes/nope/drain/").status_code == 404
