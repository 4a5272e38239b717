"""A deployment split over two agents (loopback), driven by the control plane end to end:
planned, rpc stage started, checked by the head, probed, serving the single-node text;
undeployed with every stage freed; rolled back whole when a stage cannot start; failed
with the stage named when the stage dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket

import grpc
import pytest
from llamafleet.agent.v1 import agent_pb2 as pb

from tests.apps.serving_client import post
from tests.conftest import CHAT, SMOLLM2, RunningAgent, free_port_run, wait_for
from tests.workers.test_rpc_split import AUTH


@pytest.fixture
def head_and_stage(transactional_db, smollm2_model, model_store, settings):
    from apps.nodes.services import record_heartbeat

    # Room for the ports a stage may move up to (services.RPC_PORT_TRIES).
    settings.RPC_PORT_BASE = free_port_run(8)
    agents = [RunningAgent(model_store, "head"), RunningAgent(model_store, "stage")]
    for a in agents:
        a.heartbeat = lambda a=a: record_heartbeat(a.status_payload())
        a.node = a.heartbeat()
        a.channel = grpc.insecure_channel(a.address)
        from llamafleet.agent.v1 import agent_pb2_grpc

        a.stub = agent_pb2_grpc.NodeAgentStub(a.channel)
    yield agents
    for a in agents:
        a.channel.close()
        a.close()


def deploy(**kw):
    from apps.deployments import services

    return services.do_create(
        SMOLLM2, SMOLLM2, 1, 512, 2, split_mode="layer", pin_nodes=["head", "stage"], **kw
    )


def deploy_ready():
    """deploy(), then wait until it is ready (failing with its error otherwise)."""
    from apps.deployments.models import Deployment

    d = deploy()
    wait_for(lambda: settled(d), 180)
    assert d.state == Deployment.State.READY, d.error
    return d


def settled(d):
    from apps.deployments.models import Deployment

    d.refresh_from_db()
    return d.state in (Deployment.State.READY, Deployment.State.FAILED) and d


def test_split_deployment_serves_stops_and_frees_every_stage(
    head_and_stage, celery_worker_thread, reference_text, alice_key
):
    from apps.deployments import services
    from apps.deployments.models import Replica

    head, stage = head_and_stage
    d = deploy_ready()
    [r] = d.replica_set.all()
    plan = r.plan
    assert plan.kind == "split" and plan.split_mode == "layer" and r.node.name == "head"
    stages = list(plan.stages.all())
    assert [s.role for s in stages] == ["head", "stage"]
    assert stages[0].layer_start == 0 and stages[1].layer_end == 30
    assert stages[0].layer_end == stages[1].layer_start
    assert plan.n_gpu_layers == 31 - stages[0].layers and plan.reasons
    # The stage's rpc server runs and is reported; the head serves the single-node text.
    [rpc] = stage.stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).rpc_servers
    assert rpc.running and rpc.endpoint == stages[1].endpoint
    request = pb.InferenceRequest(
        replica_id=str(r.pk),
        max_tokens=48,
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT],
        sampling=pb.SamplingParams(temperature=0),
    )
    text = "".join(m.text for m in head.stub.RunInference(request, metadata=AUTH))
    assert text == reference_text(CHAT, 48)
    assert "probed" in " ".join(e.message for e in d.events.all())
    # And through the OpenAI-compatible API, routed to the head like any replica.
    body = {"model": SMOLLM2, "messages": CHAT, "max_tokens": 48, "temperature": 0}
    resp = asyncio.run(post(alice_key, body))
    assert resp.status_code == 200, resp.content
    assert json.loads(resp.content)["choices"][0]["message"]["content"] == reference_text(CHAT, 48)

    services.do_undeploy(d)
    wait_for(lambda: Replica.objects.get(pk=r.pk).state == Replica.State.STOPPED, 60)
    assert not stage.stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).rpc_servers
    assert not head.stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).replicas


def test_a_stage_that_cannot_start_rolls_the_split_back(
    head_and_stage, celery_worker_thread, settings
):
    from apps.deployments.models import Deployment
    from apps.deployments.services import RPC_PORT_TRIES

    head, stage = head_and_stage
    squatters = []  # something else holds every port the stage may try
    for port in range(settings.RPC_PORT_BASE, settings.RPC_PORT_BASE + RPC_PORT_TRIES):
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen()
        squatters.append(s)
    try:
        d = deploy()
        d = wait_for(lambda: settled(d), 120)
    finally:
        for s in squatters:
            s.close()
    assert d.state == Deployment.State.FAILED
    assert "stage node stage could not start an rpc server" in d.error
    assert "already in use" in d.error and "rolled back" in d.error
    assert not head.stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).replicas


def test_a_taken_rpc_port_is_skipped(head_and_stage, celery_worker_thread, settings):
    from apps.deployments.models import Deployment

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", settings.RPC_PORT_BASE))
        squatter.listen()
        d = deploy()
        d = wait_for(lambda: settled(d), 120)
    assert d.state == Deployment.State.READY, d.error
    stage = d.replica_set.get().plan.stages.get(role="stage")
    assert stage.rpc_port == settings.RPC_PORT_BASE + 1
    assert stage.endpoint.endswith(f":{settings.RPC_PORT_BASE + 1}")


def test_a_dead_stage_fails_the_split_naming_it_and_the_head_survives(
    head_and_stage, celery_worker_thread
):
    from apps.deployments.models import Deployment

    head, stage = head_and_stage
    d = deploy_ready()
    [rpc] = stage.stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).rpc_servers
    os.kill(rpc.pid, signal.SIGKILL)
    [r] = d.replica_set.all()
    request = pb.InferenceRequest(replica_id=str(r.pk), prompt="Hi", max_tokens=4)
    with pytest.raises(grpc.RpcError):
        list(head.stub.RunInference(request, metadata=AUTH))
    head.heartbeat()
    d.refresh_from_db()
    assert d.state == Deployment.State.FAILED
    assert "SIGABRT" in d.error and "stage stage (layers " in d.error
    assert "does not answer" in d.error, d.error
    # The head agent lives on.
    assert head.stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).node_name == "head"


def test_link_measurement_job_stores_what_agents_measure(head_and_stage, ops, smollm2_model):
    from apps.nodes.models import NodeLink
    from apps.nodes.services import measure_links

    assert measure_links() == 2  # head -> stage and stage -> head
    link = NodeLink.objects.get(source__name="head", target__name="stage")
    assert link.rtt_ms and 0 < link.rtt_ms < 100 and link.mbit_s > 10 and not link.error
    listed = ops.get("/api/v1/nodes/links/").json()["results"]
    assert {(x["source"], x["target"]) for x in listed} == {("head", "stage"), ("stage", "head")}
    # The planner sees them: no "not measured" warning between these two any more.
    from apps.deployments import placement

    plan = placement.preview(smollm2_model, 512, 2, split_mode="layer", pin_nodes=["head", "stage"])
    assert plan.kind == "split" and not any("not measured" in w for w in plan.warnings)


@pytest.fixture
def split_and_whole(head_and_stage, celery_worker_thread):
    """The split (head + stage) and, on the stage node, a whole replica of the same model."""
    from apps.deployments import services
    from apps.deployments.models import Deployment

    # Invariant batching: the moved stream must have the solo text. Least connections: the
    # test needs requests spread over both (prefix routing would keep one prompt on one).
    same = {"batching": "invariant", "routing_policy": "least_connections"}
    split = deploy(**same)
    whole = services.do_create(
        "smollm2-whole", SMOLLM2, 1, 512, 2, split_mode="none", pin_nodes=["stage"], **same
    )
    for d in (split, whole):
        wait_for(lambda d=d: settled(d), 180)
        assert d.state == Deployment.State.READY, d.error
    return head_and_stage, split.replica_set.get()


@pytest.mark.django_db(transaction=True)
async def test_a_stream_on_a_split_moves_on_when_its_stage_dies(
    split_and_whole, alice_key, reference_text
):
    """The stage's rpc server is killed mid-stream: the head aborts, and the stream goes on
    on the whole replica with nothing lost or repeated (greedy: the solo text)."""
    from tests.apps.serving.test_routing import STORY, metric, text_of
    from tests.apps.serving_client import sse_payloads

    (head, stage), split_replica = split_and_whole
    migrated_before = metric("llamafleet_migrations_total", model=SMOLLM2)
    body = {"model": SMOLLM2, "messages": STORY, "max_tokens": 120, "temperature": 0}
    for _ in range(8):  # until the router picks the split (it spreads between the two)
        resp = await post(alice_key, {**body, "stream": True})
        if resp["X-LlamaFleet-Replica"] == str(split_replica.pk):
            break
        [c async for c in resp.streaming_content]
    else:
        pytest.fail("the router never picked the split")
    [rpc] = stage.stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).rpc_servers
    chunks = []
    async for chunk in resp.streaming_content:
        chunks.append(chunk)
        if len(chunks) == 12:
            os.kill(rpc.pid, signal.SIGKILL)
    payloads = sse_payloads(chunks)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    assert text_of(payloads) == reference_text(STORY, 120)
    assert metric("llamafleet_migrations_total", model=SMOLLM2) == migrated_before + 1


def test_a_stage_whose_agent_no_longer_runs_its_rpc_server_fails_the_split(
    head_and_stage, celery_worker_thread
):
    """As after an agent restart on the stage node: its report lacks the rpc server."""
    from apps.deployments.models import Deployment

    head, stage = head_and_stage
    d = deploy_ready()
    stage.heartbeat()  # running as planned: nothing changes
    d.refresh_from_db()
    assert d.state == Deployment.State.READY
    endpoint = d.replica_set.get().plan.stages.get(role="stage").endpoint
    port = int(endpoint.rpartition(":")[2])
    stage.stub.StopRpcServer(pb.StopRpcServerRequest(port=port), metadata=AUTH)
    stage.heartbeat()
    d.refresh_from_db()
    assert d.state == Deployment.State.FAILED
    assert f"the rpc server of stage stage ({endpoint}) is gone" in d.error


@pytest.fixture
def four_nodes(transactional_db, smollm2_model, model_store, settings):
    """Four real agents (loopback): room for two copies of a two-node split."""
    from apps.nodes.services import record_heartbeat

    settings.RPC_PORT_BASE = free_port_run(8)
    agents = {name: RunningAgent(model_store, name) for name in ("h1", "s1", "h2", "s2")}
    for a in agents.values():
        a.heartbeat = lambda a=a: record_heartbeat(a.status_payload())
        a.node = a.heartbeat()
    yield agents
    for a in agents.values():
        a.close()


def test_two_copies_of_a_split_on_separate_nodes_and_a_stream_moves_between_them(
    four_nodes, celery_worker_thread, reference_llama
):
    from apps.deployments import services
    from apps.deployments.models import Deployment
    from apps.serving.services import GenerationParams
    from tests.apps.serving.test_routing import STORY, generate_killing_replica

    d = services.do_create(
        SMOLLM2, SMOLLM2, 2, 512, 2, split_mode="layer", pin_nodes=["h1", "s1", "h2", "s2"]
    )
    wait_for(lambda: settled(d), 180)
    assert d.state == Deployment.State.READY, d.error
    replicas = list(d.replica_set.filter(state="ready").select_related("plan", "node"))
    assert sorted(r.node.name for r in replicas) == ["h1", "h2"]
    parts = [[(s.node_name, s.role) for s in r.plan.stages.all()] for r in replicas]
    assert sorted(parts) == [[("h1", "head"), ("s1", "stage")], [("h2", "head"), ("s2", "stage")]]

    # A stream whose head dies continues on the other copy, losing and repeating nothing.
    heads = {str(r.pk): four_nodes[r.node.name] for r in replicas}
    for rid, a in heads.items():
        a.replica_id = rid
    params = GenerationParams(model=SMOLLM2, messages=STORY, max_tokens=60, temperature=0)
    gen, text, finished = asyncio.run(generate_killing_replica(params, heads, after=8))
    assert finished.migrations == 1 and finished.completion_tokens == 60
    assert {t.replica_id for t in gen.served} == set(heads)
    expected = reference_llama.detokenize(gen.token_ids).decode("utf-8", errors="replace")
    assert "".join(text) == expected

    # Scaling to one copy frees the other copy (the one that failed goes first).
    services.do_scale(d, 1)
    wait_for(lambda: d.replica_set.exclude(state="stopped").count() == 1, 60)
    [kept] = d.replica_set.exclude(state="stopped")
    kept_nodes = {s.node_name for s in kept.plan.stages.all()}
    wait_for(
        lambda: (
            {n for n, a in four_nodes.items() if a.agent.service.replicas}
            | {n for n, a in four_nodes.items() if a.agent.service.rpc_servers}
            <= kept_nodes
        ),
        60,
    )
