"""The deployment services against a fake agent (tests/fakes/agent.py): the real gRPC
contract on a real socket, no model. Fast checks beside the real-model tests of the same
paths (test_lifecycle.py, test_split.py)."""

from types import SimpleNamespace

import pytest

from apps.deployments import services
from apps.deployments.models import Deployment, Replica
from apps.deployments.services import splits
from workers.engine import errors

S = Replica.State


def deploy(model, replicas: int) -> Deployment:
    d = services.do_create("chat", model.name, replicas=replicas, context_length=512, parallel=2)
    services.reconcile(d.pk)  # the task do_create queues on commit, run here
    return d


def test_replicas_are_placed_loaded_and_ready(smollm2_model, fake_agent):
    d = deploy(smollm2_model, replicas=2)
    replicas = list(d.replica_set.all())
    assert len(replicas) == 2
    assert all(r.state == S.PENDING and r.node_id == fake_agent.node.pk for r in replicas)
    for r in replicas:
        services.load(str(r.pk))
    loads = fake_agent.calls_of("LoadModel")
    assert sorted(x.replica_id for x in loads) == sorted(str(r.pk) for r in replicas)
    assert all(x.context_length == 512 and x.parallel == 2 for x in loads)
    assert all(x.sha256 == smollm2_model.sha256 and not x.rpc_servers for x in loads)
    d.refresh_from_db()
    assert d.state == Deployment.State.READY
    assert set(d.replica_set.values_list("state", flat=True)) == {S.READY}


@pytest.mark.parametrize(
    ("batching", "swa_cache", "window"),
    [("throughput", "window", True), ("throughput", "full", False), ("invariant", "window", False)],
)
def test_load_model_carries_the_deployments_sliding_window_cache(
    smollm2_model, fake_agent, batching, swa_cache, window
):
    """The window cache reaches the agent only in the throughput mode: the invariant mode
    keeps the full cache whatever the deployment says (as its plan assumed)."""
    d = services.do_create(
        "chat", smollm2_model.name, 1, 512, 2, batching=batching, swa_cache=swa_cache
    )
    services.reconcile(d.pk)
    services.load(str(d.replica_set.get().pk))
    [call] = fake_agent.calls_of("LoadModel")
    assert call.swa_window is window
    assert call.batch_invariant is (batching == "invariant")


def test_a_failed_load_fails_the_replica_with_the_agents_reason(smollm2_model, fake_agent):
    fake_agent.load_error = "the file is not a GGUF model"
    d = deploy(smollm2_model, replicas=1)
    r = d.replica_set.get()
    services.load(str(r.pk))
    r.refresh_from_db()
    assert r.state == S.FAILED and "the file is not a GGUF model" in r.error
    d.refresh_from_db()
    assert d.state == Deployment.State.FAILED
    assert d.events.filter(message__contains="the file is not a GGUF model").exists()
    services.load(str(r.pk))  # a second delivery of the task: its claim is gone, nothing runs
    assert len(fake_agent.calls_of("LoadModel")) == 1


def test_scaling_down_frees_one_replica_on_its_agent(smollm2_model, fake_agent):
    d = deploy(smollm2_model, replicas=2)
    for r in d.replica_set.all():
        services.load(str(r.pk))
    Deployment.objects.filter(pk=d.pk).update(replicas=1)
    services.reconcile(d.pk)
    stopping = list(d.replica_set.filter(state=S.STOPPING))
    assert len(stopping) == 1
    services.free(str(stopping[0].pk))
    assert [x.replica_id for x in fake_agent.calls_of("FreeMemory")] == [str(stopping[0].pk)]
    assert str(stopping[0].pk) not in fake_agent.replicas
    assert d.replica_set.filter(state=S.READY).count() == 1
    stopping[0].refresh_from_db()
    assert stopping[0].state == S.STOPPED


@pytest.mark.parametrize(
    ("code", "moves_on"),
    [(errors.ENDPOINT_IN_USE, True), (errors.INVALID_ARGUMENT, False)],
)
def test_an_rpc_port_moves_up_only_for_the_endpoint_in_use_code(fake_agent, code, moves_on):
    """The deploy flow reads the ErrorCode, never the message: both failures say "already in
    use", and only the one coded ENDPOINT_IN_USE makes it try the next port."""
    fake_agent.port_errors = {7000: code}
    stage = SimpleNamespace(node=fake_agent.node, node_name=fake_agent.name, rpc_port=7000)
    if moves_on:
        status = splits._start_rpc_server(stage)
        assert status.endpoint == "127.0.0.1:7001" and stage.rpc_port == 7001
    else:
        with pytest.raises(splits.StageError, match="already in use"):
            splits._start_rpc_server(stage)
    tried = [x.port for x in fake_agent.calls_of("StartRpcServer")]
    assert tried == ([7000, 7001] if moves_on else [7000])
