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
    services.flush_heartbeats()  # what beat does every FLUSH_SECONDS
    [node] = ops.get("/api/v1/nodes/").json()["results"]
    assert node["name"] == "gpu-box-1" and node["address"] == "10.0.0.5:50051"
    assert node["memory_available_bytes"] == 1234 and node["in_flight"] == 3
    assert node["cpu_cores"] == 16 and node["heartbeat_age_seconds"] < 5
    assert node["load_average"] == 1.5
    bad = c.post("/api/v1/agent/heartbeat", {"node_name": ""}, format="json")
    assert bad.status_code == 400 and "required" in bad.json()["detail"]


def test_a_heartbeat_that_says_nothing_new_is_buffered_and_written_in_bulk(settings):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from apps.usage.models import NodeUsage

    c = agent_client(settings.NODE_TOKEN)
    assert c.post("/api/v1/agent/heartbeat", REPORT, format="json").status_code == 200
    first = Node.objects.get().last_heartbeat_at
    with CaptureQueriesContext(connection) as queries:
        r = c.post("/api/v1/agent/heartbeat", REPORT | {"in_flight": 7}, format="json")
    assert r.json() == {"node": "gpu-box-1", "state": "ready"}
    assert not [q for q in queries.captured_queries if "nodes_node" in q["sql"]]
    assert Node.objects.get().in_flight == 0  # not yet written
    assert services.flush_heartbeats() == 1
    node = Node.objects.get()
    assert node.in_flight == 7 and node.last_heartbeat_at > first
    # The time in between is credited to the node's hour, as a full heartbeat would.
    assert NodeUsage.objects.get(node=node).seconds > 0
    assert services.flush_heartbeats() == 0  # nothing left


def test_a_report_with_news_is_recorded_at_once(settings):
    c = agent_client(settings.NODE_TOKEN)
    c.post("/api/v1/agent/heartbeat", REPORT, format="json")
    moved = REPORT | {"address": "10.0.0.6:50051"}
    c.post("/api/v1/agent/heartbeat", moved, format="json")
    assert Node.objects.get().address == "10.0.0.6:50051"  # no flush needed


def test_a_buffered_heartbeat_of_a_swept_node_brings_it_back(settings):
    c = agent_client(settings.NODE_TOKEN)
    c.post("/api/v1/agent/heartbeat", REPORT, format="json")
    c.post("/api/v1/agent/heartbeat", REPORT, format="json")  # buffered
    Node.objects.update(state=Node.State.UNREACHABLE)  # swept meanwhile
    services.flush_heartbeats()
    assert Node.objects.get().state == Node.State.READY


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


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_lane_of_the_asgi_server_answers_as_the_view_does(settings, asgi_server):
    """In production the path is answered before Django's middleware (controlplane/asgi.py)."""
    import httpx

    url = f"{asgi_server}/api/v1/agent/heartbeat"
    good = {"Authorization": f"Bearer {settings.NODE_TOKEN}"}
    assert httpx.post(url, json=REPORT, headers={"Authorization": "Bearer no"}).status_code == 403
    r = httpx.post(url, json=REPORT, headers=good)
    assert r.status_code == 200 and r.json() == {"node": "gpu-box-1", "state": "ready"}
    assert Node.objects.get().address == "10.0.0.5:50051"
    bad = httpx.post(url, content=b"{nope", headers=good)
    assert bad.status_code == 400 and "body" in bad.json()["detail"]
    assert httpx.post(url, json={"node_name": ""}, headers=good).status_code == 400
    assert httpx.get(url, headers=good).status_code == 405
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    big = httpx.post(url, json=REPORT | {"version": "x" * 2000}, headers=good)
    assert big.status_code == 413
