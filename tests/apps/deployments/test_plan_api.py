"""Plans through the API: preview (nothing stored), stored plans on deployments, refusals
with numbers, pins and forced modes, partial offload on a (reported) accelerator."""

from __future__ import annotations

import pytest

import workers
from apps.nodes.models import Node
from apps.nodes.services import record_heartbeat

GiB = 2**30


def node(name: str, free_gib: float, **extra) -> Node:
    """A node as its agent reports itself (today's agent's features unless `extra` says)."""
    return record_heartbeat(
        {
            "node_name": name,
            "address": f"{name}:50051",
            "memory_total_bytes": int(64 * GiB),
            "memory_available_bytes": int(free_gib * GiB),
            "features": list(workers.FEATURES),
            **extra,
        }
    )


@pytest.fixture
def small_nodes(db):
    """Three nodes, none with room for a whole copy of SmolLM2 (0.52 GiB with 4 x 2048)."""
    return [node(f"n{i}", 0.35) for i in range(3)]


def preview(ops, **body):
    resp = ops.post(
        "/api/v1/deployments/plan/",
        {"model": "smollm2-135m-instruct", "context_length": 2048, "parallel": 4, **body},
        format="json",
    )
    assert resp.status_code == 200, resp.content
    return resp.json()


def test_preview_places_replicas_when_a_node_holds_the_model(ops, smollm2_model, db):
    node("big", 8)
    node("small", 0.1)
    plan = preview(ops, replicas=2)
    assert plan["kind"] == "replicas" and plan["error"] == ""
    assert [s["node"] for s in plan["stages"]] == ["big", "big"]
    assert plan["warnings"] == [] and "no split" in plan["reasons"][0]
    assert plan["stages"][0]["total_bytes"] == plan["needed_bytes"]


def test_preview_splits_over_the_fewest_nodes_and_stores_nothing(ops, smollm2_model, small_nodes):
    from apps.deployments.models import ShardPlan

    plan = preview(ops)
    assert plan["kind"] == "split" and plan["split_mode"] == "layer"
    assert len(plan["stages"]) in (2, 3)
    assert [s["role"] for s in plan["stages"]][0] == "head"
    assert sum(s["layer_end"] - s["layer_start"] for s in plan["stages"]) == 30
    assert all(s["total_bytes"] <= 0.35 * GiB for s in plan["stages"])
    assert any("not measured" in w for w in plan["warnings"])
    assert not ShardPlan.objects.exists()


def test_preview_refuses_with_numbers(ops, smollm2_model, db):
    node("tiny", 0.05)
    node("tinier", 0.04)
    plan = preview(ops)
    assert plan["kind"] == "refused"
    assert "needs " in plan["error"] and "GiB" in plan["error"]
    assert "the largest feasible set of healthy nodes has 0.09 GiB" in plan["error"]


def test_pins_and_forced_modes_are_checked(ops, smollm2_model, small_nodes):
    plan = preview(ops, split_mode="tensor", pin_nodes=["n2", "n0", "n1"])
    assert plan["split_mode"] == "tensor" and [s["node"] for s in plan["stages"]] == [
        "n2", "n0", "n1",
    ]  # fmt: skip
    assert any("tensor parallel over RPC" in w for w in plan["warnings"])
    resp = ops.post(
        "/api/v1/deployments/plan/",
        {"model": "smollm2-135m-instruct", "pin_nodes": ["nope"]},
        format="json",
    )
    assert resp.status_code == 400 and "nope" in resp.json()["detail"]
    # Two copies of a split need two sets of nodes that do not overlap: three nodes hold one.
    plan = preview(ops, split_mode="layer", replicas=2)
    assert plan["kind"] == "refused"
    assert "copy 2 of 2" in plan["error"] and "do not overlap" in plan["error"]
    plan = preview(ops, split_mode="layer", replicas=2, pin_nodes=["n0", "n1", "n2"])
    assert plan["kind"] == "refused" and "do not divide into 2 copies" in plan["error"]


def test_a_deployment_keeps_its_plan_and_shows_it(ops, smollm2_model, small_nodes):
    from apps.deployments import services

    services.reconcile(
        ops.post("/api/v1/deployments/", {"model": "smollm2-135m-instruct"}, format="json").json()[
            "id"
        ]
    )
    d = ops.get("/api/v1/deployments/smollm2-135m-instruct/").json()
    plan = d["plan"]
    assert plan["kind"] == "split" and plan["reasons"] and len(plan["stages"]) >= 2
    assert [r["node"] for r in d["replica_set"]] == [plan["stages"][0]["node"]]
    listed = ops.get("/api/v1/deployments/smollm2-135m-instruct/plans/").json()
    assert listed["results"][0]["id"] == plan["id"]
    events = " ".join(e["message"] for e in d["recent_events"])
    assert "layer split planned: head " in events


def test_reported_accelerator_memory_takes_layers(ops, smollm2_model, db, monkeypatch):
    """Partial offload, planned from what the agent reports (here a fake accelerator: this
    machine has no GPU, and llama.cpp keeps the layers on the CPU anyway)."""
    from workers.agent import system

    monkeypatch.setenv("LLAMAFLEET_FAKE_ACCELERATOR_MIB", "40")
    [fake] = system.accelerators()
    assert "fake" in fake and fake.endswith("40 MiB")
    node("gpu", 8, accelerators=[fake])
    plan = preview(ops, context_length=512, parallel=1)
    [stage] = plan["stages"]
    assert 0 < stage["n_gpu_layers"] < 30
    assert any("n_gpu_layers" in r for r in plan["reasons"])


def test_the_deploy_command_prints_a_plan_and_deploys_nothing(smollm2_model, small_nodes):
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import CommandError

    from apps.deployments.models import Deployment

    out = StringIO()
    call_command("deploy", smollm2_model.name, "--plan", "--pin", "n1", "n0", stdout=out)
    text = out.getvalue()
    assert text.startswith("split (layer)") and "head    n1" in text and "because " in text
    assert not Deployment.objects.exists()
    with pytest.raises(CommandError, match="needs .* on one node"):
        call_command("deploy", smollm2_model.name, "--plan", "--split-mode", "none", stdout=out)


def test_preview_carries_what_its_picture_needs(ops, smollm2_model, small_nodes):
    """The console draws a plan against each node's memory and the links between its nodes;
    a refusal is drawn against the roomiest ready nodes."""
    from django.utils import timezone

    from apps.nodes.models import NodeLink

    n0, n1, n2 = small_nodes
    now = timezone.now()
    NodeLink.objects.create(source=n0, target=n1, rtt_ms=0.4, mbit_s=9000, measured_at=now)
    NodeLink.objects.create(source=n0, target=n2, rtt_ms=7.5, mbit_s=90, measured_at=now)
    plan = preview(ops, split_mode="layer", pin_nodes=["n0", "n1", "n2"])
    assert [n["name"] for n in plan["nodes"]] == ["n0", "n1", "n2"]
    assert all(n["free_bytes"] == int(0.35 * GiB) for n in plan["nodes"])
    assert all(n["memory_total_bytes"] == 64 * GiB for n in plan["nodes"])
    links = {(lk["source"], lk["target"]): lk for lk in plan["links"]}
    assert links[("n0", "n1")]["slow"] is False and links[("n0", "n1")]["rtt_ms"] == 0.4
    assert links[("n0", "n2")]["slow"] is True  # 7.5 ms, 90 Mbit/s: marked in the picture
    node("tiny", 0.05)
    refused = preview(ops, split_mode="none")
    assert refused["kind"] == "refused" and refused["needed_bytes"] > 0.35 * GiB
    assert {n["name"] for n in refused["nodes"]} == {"n0", "n1", "n2", "tiny"}
    assert refused["links"] != [] and refused["stages"] == []


@pytest.fixture
def gemma_model(db, gemma_path):
    """gemma-3-270m's facts in the catalog (the planner reads nothing else)."""
    from apps.catalog.gguf_meta import read_metadata
    from apps.catalog.models import CatalogModel

    return CatalogModel.objects.create(
        name="gemma-3-270m",
        source="test",
        state=CatalogModel.State.READY,
        sha256="0" * 64,
        size_bytes=gemma_path.stat().st_size,
        **read_metadata(gemma_path),
    )


def test_a_deployments_window_cache_lets_a_long_context_fit_where_the_full_one_does_not(
    ops, gemma_model
):
    """A deployment's swa_cache (window by default) is what its plan is sized by: at
    32,768 tokens gemma's window cache takes about a fifth of the full one's KV, so a
    node with room for it holds a replica that the full cache, or the invariant mode
    (which always keeps it), would not fit."""
    from apps.deployments import placement
    from apps.deployments import planner as P

    body = {"model": "gemma-3-270m", "context_length": 32768, "parallel": 1}
    m = placement.model_facts(gemma_model)
    sizes = [P.replica_stage(m, P.Request(32768, 1, swa_window=w)) for w in (True, False)]
    node("n0", (sizes[0].total_bytes + sizes[1].total_bytes) / 2 / GiB)
    window, full = preview(ops, **body), preview(ops, **body, swa_cache="full")
    assert window["kind"] == "replicas" and "15 of 18 layers" in window["reasons"][0]
    assert window["stages"][0]["kv_bytes"] == sizes[0].kv_bytes < 0.3 * sizes[1].kv_bytes
    assert full["kind"] == "refused" and "on one node" in full["error"]
    invariant = preview(ops, **body, batching="invariant")
    assert invariant["kind"] == "refused"
    resp = ops.post("/api/v1/deployments/", {**body, "swa_cache": "half"}, format="json")
    assert resp.status_code == 400 and "swa_cache" in resp.json()
    resp = ops.post("/api/v1/deployments/", body, format="json")
    assert resp.status_code == 202 and resp.json()["swa_cache"] == "window"


def test_an_agent_without_the_window_cache_is_planned_with_the_full_one(ops, gemma_model):
    """An agent older than swa_window ignores it and loads the full cache. The control plane
    plans by the features the agent reports: the node with room for the window cache only
    is passed over when its agent lacks "swa-window", and a replica placed on such an agent
    is sized (and booked) by the full cache, with a warning saying why."""
    from apps.deployments import placement
    from apps.deployments import planner as P

    body = {"model": "gemma-3-270m", "context_length": 32768, "parallel": 1}
    m = placement.model_facts(gemma_model)
    window, full = (P.replica_stage(m, P.Request(32768, 1, swa_window=w)) for w in (True, False))
    between = (window.total_bytes + full.total_bytes) / 2 / GiB
    old = node("old", between, features=[])
    assert old.features == []
    refused = preview(ops, **body)
    assert refused["kind"] == "refused"
    assert f"needs {P.gib(full.total_bytes)} on one node" in refused["error"]

    node("new", between)
    plan = preview(ops, **body)
    assert [s["node"] for s in plan["stages"]] == ["new"]
    assert plan["stages"][0]["kv_bytes"] == window.kv_bytes
    assert not any("predates" in w for w in plan["warnings"])

    node("old", 2 * full.total_bytes / GiB, features=[])  # now the one with the most room
    plan = preview(ops, **body, replicas=2)
    by_node = {s["node"]: s for s in plan["stages"]}
    assert by_node["old"]["kv_bytes"] == full.kv_bytes
    assert by_node["new"]["kv_bytes"] == window.kv_bytes
    assert [w for w in plan["warnings"] if "the agent on old predates the window cache" in w]
