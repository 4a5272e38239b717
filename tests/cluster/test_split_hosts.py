"""One model split across hosts: agents run in their own network namespaces (separate
addresses, processes and links on this machine) and the control plane deploys over them.

- Layer split over 2 and 3 hosts: greedy text equals the single-node text.
- Tensor parallel over 2 stage hosts: the deployment serves, and the mean negative
  log-likelihood of a fixed text is within 2% of one node's.
- Killing a stage host fails the deployment with the stage named; the head's agent lives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import grpc
import pytest
from django.test import override_settings
from llamafleet.agent.v1 import agent_pb2 as pb
from llamafleet.agent.v1 import agent_pb2_grpc

from tests import hosts as H
from tests.conftest import CHAT, ROOT, SMOLLM2, wait_for
from workers import tls

pytestmark = pytest.mark.skipif(bool(H.available()), reason=H.available() or "ok")
TOKEN = os.environ.get("LLAMAFLEET_NODE_TOKEN", "")
AUTH = (("authorization", f"Bearer {TOKEN}"),)
TEXT = ROOT / "tests" / "data" / "nll_text.txt"


@pytest.fixture(scope="module")
def cluster(model_store, tmp_path_factory):
    """Three hosts with an agent each (host0, host1, host2)."""
    logs = tmp_path_factory.mktemp("host-logs")
    hosts = H.Hosts(3).up()
    files = H.pki(tmp_path_factory.mktemp("pki"), hosts)
    tls_on = override_settings(AGENT_TLS=files)  # the control plane dials them over mTLS
    tls_on.enable()
    try:
        addresses = [H.start_agent(hosts, i, model_store, logs, files=files) for i in range(3)]
        for a in addresses:
            H.wait_agent(a, TOKEN, files=files)
        channels = [tls.channel(a, files) for a in addresses]
        hosts.stubs = [agent_pb2_grpc.NodeAgentStub(c) for c in channels]
        hosts.addresses = addresses
        yield hosts
        for c in channels:
            c.close()
    finally:
        tls_on.disable()
        hosts.down()


def beat(cluster, *which):
    """Heartbeats as the agents would send them (the test's control plane has no HTTP)."""
    from google.protobuf.json_format import MessageToDict

    from apps.nodes.services import record_heartbeat

    for i in which or range(cluster.n):
        status = cluster.stubs[i].GetStatus(pb.GetStatusRequest(), metadata=AUTH, timeout=10)
        payload = MessageToDict(
            status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        record_heartbeat({**payload, "address": cluster.addresses[i]})


def deploy(cluster, pins, split_mode="layer"):
    from apps.deployments import services
    from apps.deployments.models import Deployment

    beat(cluster)
    d = services.do_create(SMOLLM2, SMOLLM2, 1, 512, 2, split_mode=split_mode, pin_nodes=pins)

    def settled():
        d.refresh_from_db()
        return d.state in (Deployment.State.READY, Deployment.State.FAILED)

    wait_for(settled, 180)
    assert d.state == Deployment.State.READY, d.error
    return d


def generate(cluster, replica, max_tokens=48) -> str:
    request = pb.InferenceRequest(
        replica_id=str(replica.pk),
        max_tokens=max_tokens,
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT],
        sampling=pb.SamplingParams(temperature=0),
    )
    head = cluster.stubs[int(replica.node.name.removeprefix("host"))]
    return "".join(m.text for m in head.RunInference(request, metadata=AUTH, timeout=120))


def undeploy(cluster, d):
    from apps.deployments import services
    from apps.deployments.models import Deployment

    services.do_undeploy(d)
    wait_for(lambda: Deployment.objects.get(pk=d.pk).state == Deployment.State.STOPPED, 60)
    services.do_delete(Deployment.objects.get(pk=d.pk))


@pytest.mark.parametrize("n_hosts", [2, 3])
def test_layer_split_over_hosts_gives_the_single_node_text(
    cluster, n_hosts, smollm2_model, celery_worker_thread, reference_text
):
    pins = [f"host{i}" for i in range(n_hosts)]
    d = deploy(cluster, pins)
    [r] = d.replica_set.all()
    stages = list(r.plan.stages.all())
    assert [s.node_name for s in stages] == pins
    assert all(s.layers >= 1 for s in stages[1:]) and stages[-1].layer_end == 30
    # rpc servers listen on each stage host's own address, not on every interface.
    for i, s in enumerate(stages[1:], start=1):
        assert s.endpoint.startswith(cluster.ip(i) + ":"), s.endpoint
    assert generate(cluster, r) == reference_text(CHAT, 48)
    undeploy(cluster, d)
    for i in range(1, n_hosts):
        status = cluster.stubs[i].GetStatus(pb.GetStatusRequest(), metadata=AUTH)
        assert not status.rpc_servers, f"host{i} still runs an rpc server"


def nll(cluster, *args) -> float:
    """Mean NLL of the fixed text, computed on host0 (its traffic crosses the links)."""
    model = str(_model_path())
    cmd = ["ip", "netns", "exec", cluster.namespaces[0], sys.executable, "-m",
           "workers.engine.nll", "--model", model, "--text-file", str(TEXT), *args]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["mean_nll"]


def _model_path():
    from tests.conftest import cached_model

    return cached_model(SMOLLM2)


def test_tensor_parallel_over_two_hosts_serves_and_keeps_quality(
    cluster, smollm2_model, celery_worker_thread
):
    d = deploy(cluster, ["host0", "host1", "host2"], split_mode="tensor")
    [r] = d.replica_set.all()
    assert r.plan.split_mode == "tensor" and r.plan.n_gpu_layers == -1
    assert sum(r.plan.tensor_split) == pytest.approx(1, abs=0.01)
    assert len(generate(cluster, r, 16)) > 0
    undeploy(cluster, d)

    # Quality, not strings: tensor parallel sums in another order.
    endpoints = []
    for i in (1, 2):
        s = cluster.stubs[i].StartRpcServer(pb.StartRpcServerRequest(port=50100), metadata=AUTH)
        endpoints.append(s.endpoint)
    try:
        single = nll(cluster)
        tensor = nll(cluster, "--rpc", *endpoints, "--split-mode", "3")
        layer = nll(cluster, "--rpc", *endpoints, "--n-gpu-layers", "31")
    finally:
        for i in (1, 2):
            cluster.stubs[i].StopRpcServer(pb.StopRpcServerRequest(port=50100), metadata=AUTH)
    assert abs(tensor - single) <= 0.02 * single, (single, tensor)
    assert layer == pytest.approx(single, rel=1e-6), (single, layer)


def test_killing_a_stage_host_fails_the_deployment_and_the_head_survives(
    cluster, smollm2_model, celery_worker_thread
):
    from django.utils import timezone

    from apps.deployments.models import Deployment
    from apps.nodes.models import Node
    from apps.nodes.services import sweep_stale_nodes

    d = deploy(cluster, ["host0", "host1"])
    [r] = d.replica_set.all()
    stage = r.plan.stages.get(role="stage")
    assert cluster.kill_host(1)

    # The head notices at its next token: its engine aborts, the agent stays up.
    with pytest.raises(grpc.RpcError):
        generate(cluster, r, 4)
    assert cluster.stubs[0].GetStatus(pb.GetStatusRequest(), metadata=AUTH).node_name == "host0"
    beat(cluster, 0)
    d.refresh_from_db()
    assert d.state == Deployment.State.FAILED
    assert f"stage host1 (layers {stage.layer_start}-{stage.layer_end - 1}, " in d.error
    assert "does not answer" in d.error, d.error

    # And with no traffic at all, the stage host's silence says the same.
    Node.objects.filter(name="host1").update(
        last_heartbeat_at=timezone.now() - timedelta(minutes=5)
    )
    assert sweep_stale_nodes() == ["host1"]
    assert Node.objects.get(name="host1").state == Node.State.UNREACHABLE
