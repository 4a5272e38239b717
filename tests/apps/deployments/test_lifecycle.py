"""Deploy, fail, redeploy, undeploy: the API, a real Celery worker on Redis, a real agent."""

import os
import signal
from datetime import timedelta

import pytest
from django.utils import timezone

from apps.deployments import services
from apps.deployments.models import Deployment, Replica
from apps.nodes.models import Node
from apps.nodes.services import sweep_stale_nodes
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def state_of(name):
    return Deployment.objects.get(name=name).state


def test_deploy_kill_redeploy_undeploy(ops, smollm2_model, registered_agent, celery_worker_thread):
    agent = registered_agent
    resp = ops.post(
        "/api/v1/deployments/",
        {"model": "smollm2-135m-instruct", "context_length": 512, "parallel": 2},
        format="json",
    )
    assert resp.status_code == 202, resp.content
    wait_for(lambda: state_of("smollm2-135m-instruct") == "ready")
    replica = Replica.objects.get(state="ready")
    assert replica.node.name == "node-a" and replica.memory_bytes > 50e6

    # The engine dies: the agent survives, its next report marks the replica and deployment failed.
    os.kill(agent.engine_pid(str(replica.pk)), signal.SIGKILL)
    wait_for(lambda: agent.agent.service.replicas[str(replica.pk)].engine.state == "failed")
    agent.heartbeat()
    d = Deployment.objects.get()
    assert d.state == "failed" and "SIGKILL" in d.error and "node-a" in d.error
    body = ops.get("/api/v1/deployments/smollm2-135m-instruct/").json()
    assert body["replica_set"][0]["state"] == "failed"
    assert any("SIGKILL" in e["message"] for e in body["recent_events"])

    # Redeploy: a new replica replaces the failed one and serves.
    assert ops.post("/api/v1/deployments/smollm2-135m-instruct/redeploy/").status_code == 202
    wait_for(lambda: state_of("smollm2-135m-instruct") == "ready")
    live = Replica.objects.get(state="ready")
    assert live.pk != replica.pk
    wait_for(lambda: str(replica.pk) not in agent.agent.service.replicas)  # dead one cleared

    # Undeploy frees the memory on the node.
    assert ops.post("/api/v1/deployments/smollm2-135m-instruct/undeploy/").status_code == 202
    wait_for(lambda: state_of("smollm2-135m-instruct") == "stopped")
    assert not agent.agent.service.replicas
    assert ops.delete("/api/v1/deployments/smollm2-135m-instruct/").status_code == 204


def test_without_nodes_it_waits_with_a_reason_then_deploys(
    ops, smollm2_model, agent, celery_worker_thread
):
    from apps.deployments.tasks import reconcile_all
    from apps.nodes.services import record_heartbeat

    ops.post(
        "/api/v1/deployments/",
        {"model": "smollm2-135m-instruct", "context_length": 256, "parallel": 1},
        format="json",
    )
    d = wait_for(lambda: Deployment.objects.filter(error__contains="no node is ready").first())
    assert d.state == "pending"
    record_heartbeat(agent.status_payload())
    reconcile_all.delay()
    wait_for(lambda: state_of("smollm2-135m-instruct") == "ready")


def deploy_one_replica(ops, agent) -> tuple[Replica, int]:
    """Deploy SmolLM2 once on the agent; the ready replica and its engine's pid."""
    ops.post(
        "/api/v1/deployments/",
        {"model": "smollm2-135m-instruct", "context_length": 256, "parallel": 1},
        format="json",
    )
    wait_for(lambda: state_of("smollm2-135m-instruct") == "ready")
    [r] = Replica.objects.all()
    return r, agent.engine_pid(str(r.pk))


def test_a_control_plane_blip_leaves_the_fleet_serving(
    ops, smollm2_model, registered_agent, celery_worker_thread
):
    """Heartbeats stopped reaching us (web or database out) but the agent serves on: the
    sweep asks the agent itself, and nothing is failed or freed."""
    r, pid = deploy_one_replica(ops, registered_agent)
    Node.objects.update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    assert sweep_stale_nodes() == []
    node = Node.objects.get()
    assert node.state == "ready" and timezone.now() - node.last_heartbeat_at < timedelta(seconds=30)
    assert state_of("smollm2-135m-instruct") == "ready"
    assert registered_agent.engine_pid(str(r.pk)) == pid


def test_a_lost_node_that_comes_back_with_its_replicas_gets_them_readopted(
    ops, smollm2_model, registered_agent, celery_worker_thread
):
    """A node that neither reports nor answers is unreachable: its replicas leave routing but
    are not freed. When it reports again holding them, they serve again, same engine."""
    r, pid = deploy_one_replica(ops, registered_agent)
    address = Node.objects.get().address
    # A partition: the agent can neither report nor be reached (its address leads nowhere).
    Node.objects.update(
        address="127.0.0.1:9", last_heartbeat_at=timezone.now() - timedelta(minutes=5)
    )
    assert sweep_stale_nodes() == ["node-a"]
    r.refresh_from_db()
    d = Deployment.objects.get()
    assert r.state == "unreachable" and d.state == "degraded"
    assert "stopped sending heartbeats" in d.error
    # The partition heals: its next report re-adopts the replica it still holds.
    Node.objects.update(address=address)
    registered_agent.heartbeat()
    r.refresh_from_db()
    assert r.state == "ready" and state_of("smollm2-135m-instruct") == "ready"
    assert registered_agent.engine_pid(str(r.pk)) == pid
    assert d.events.filter(message__contains="re-adopted").exists()


def test_load_failure_says_which_node_and_why(
    ops, smollm2_model, registered_agent, celery_worker_thread
):
    # The catalog says one thing, the file on the node is corrupt.
    path = smollm2_model.path
    good = path.read_bytes()
    path.unlink()  # the store file is a hard link: replace it, do not write through it
    path.write_bytes(good[:4_000_000])
    smollm2_model.size_bytes = 4_000_000  # same size: the agent loads it instead of fetching
    smollm2_model.save()
    smollm2_model.files.update(size_bytes=4_000_000)
    try:
        ops.post(
            "/api/v1/deployments/",
            {"model": "smollm2-135m-instruct", "context_length": 256, "parallel": 1},
            format="json",
        )
        wait_for(lambda: state_of("smollm2-135m-instruct") == "failed")
        d = Deployment.objects.get()
        assert "node-a" in d.error and "could not load" in d.error
    finally:
        path.unlink()
        path.write_bytes(good)


def test_bad_deployment_requests_are_refused(ops, smollm2_model):
    post = lambda body: ops.post("/api/v1/deployments/", body, format="json")  # noqa: E731
    assert post({"model": "nope"}).status_code == 404
    r = post({"model": "smollm2-135m-instruct", "context_length": 100000})
    assert r.status_code == 400 and "8192" in r.json()["detail"]
    assert post({"model": "smollm2-135m-instruct", "replicas": 0}).status_code == 400
    assert post({"model": "smollm2-135m-instruct", "name": "x"}).status_code == 202
    assert post({"model": "smollm2-135m-instruct", "name": "x"}).status_code == 409
    smollm2_model.state = "pulling"
    smollm2_model.save()
    assert post({"model": "smollm2-135m-instruct", "name": "y"}).status_code == 409


def test_a_crashed_engine_is_replaced_after_its_back_off(
    ops, smollm2_model, registered_agent, celery_worker_thread, monkeypatch
):
    """Restart policy "always" (the default): no redeploy needed after an engine crash."""
    from apps.deployments.services import reconciling

    monkeypatch.setattr(reconciling, "RESTART_FIRST_DELAY", 1)
    r, pid = deploy_one_replica(ops, registered_agent)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: registered_agent.agent.service.replicas[str(r.pk)].engine.state == "failed")
    registered_agent.heartbeat()
    d = Deployment.objects.get()
    assert d.state == "failed" and d.restarts == 1 and d.next_restart_at is not None
    wait_for(lambda: state_of("smollm2-135m-instruct") == "ready")
    new = Replica.objects.get(state="ready")
    r.refresh_from_db()
    assert new.pk != r.pk and r.state == "stopped"
    messages = list(d.events.values_list("message", flat=True))
    assert "restart 1 in 1 s" in messages
    assert "restart 1: replacing 1 failed replica(s)" in messages


def test_back_off_doubles_into_a_crash_loop_and_never_means_never(db, smollm2_model, clock):
    node = Node.objects.create(name="n", address="127.0.0.1:9")
    d = Deployment.objects.create(
        name="d", model=smollm2_model, replicas=1, context_length=256, parallel=1
    )

    def fail_one(dep):
        r = Replica.objects.create(deployment=dep, node=node, state="ready")
        services.fail_replica(r, "engine exited")
        dep.refresh_from_db()
        return r

    states = []
    for restart in range(1, 5):
        r = fail_one(d)
        states.append(d.state)
        assert d.restarts == restart
        # A second failure while the restart is pending joins it.
        fail_one(d)
        assert d.restarts == restart
        # Not before the back-off is over...
        services.reconcile(d.pk)
        r.refresh_from_db()
        assert r.state == "failed"
        # ...then the next reconcile retires the failed replicas.
        clock.shift(10 * 2 ** (restart - 1) + 1)
        services.reconcile(d.pk)
        r.refresh_from_db()
        assert r.state == "stopped"
    assert states == ["failed", "failed", "crash_loop", "crash_loop"]
    delays = [m for m in d.events.values_list("message", flat=True) if " in " in m]
    assert sorted(delays) == [
        "restart 1 in 10 s",
        "restart 2 in 20 s",
        "restart 3 in 40 s",
        "restart 4 in 80 s",
    ]
    # Ten quiet minutes of running reset the count (81 s have passed since the last failure).
    Deployment.objects.filter(pk=d.pk).update(state="ready")
    clock.shift(8 * 60)
    services.reconcile(d.pk)
    d.refresh_from_db()
    assert d.restarts == 4  # not yet
    Deployment.objects.filter(pk=d.pk).update(state="ready")  # (it found no capacity)
    clock.shift(60)
    services.reconcile(d.pk)
    d.refresh_from_db()
    assert d.restarts == 0
    # Policy "never": failed until someone redeploys.
    never = Deployment.objects.create(
        name="n", model=smollm2_model, replicas=1, context_length=256, parallel=1,
        restart_policy="never",
    )  # fmt: skip
    r = fail_one(never)
    services.reconcile(never.pk)
    r.refresh_from_db()
    never.refresh_from_db()
    assert r.state == "failed" and never.state == "failed" and never.restarts == 0


def _unreachable_deployment(model, replicas: int):
    """A node nothing answers on, and a deployment to hold replica rows made by hand."""
    node = Node.objects.create(name="n", address="127.0.0.1:9")
    d = Deployment.objects.create(
        name="d", model=model, replicas=replicas, context_length=256, parallel=1
    )
    return node, d


def test_a_load_whose_worker_died_fails_with_the_reason_and_one_never_sent_is_resent(
    db, smollm2_model, monkeypatch, clock
):
    from apps.deployments import tasks

    sent = []
    monkeypatch.setattr(tasks.load_replica, "delay", lambda pk: sent.append(pk))
    node, d = _unreachable_deployment(smollm2_model, replicas=2)
    held = Replica.objects.create(
        deployment=d, node=node, state="loading",
        lease_expires_at=timezone.now() + timedelta(minutes=1),
    )  # fmt: skip
    waiting = Replica.objects.create(deployment=d, node=node, state="pending")
    assert services.expire_leases() == {"lost": 0, "resent": 0, "refreed": 0}  # all in time
    clock.shift(5 * 60)  # the held lease ran out, and the pending one was never sent
    fresh = Replica.objects.create(
        deployment=d, node=node, state="loading",
        lease_expires_at=timezone.now() + timedelta(minutes=10),
    )  # fmt: skip
    assert services.expire_leases() == {"lost": 1, "resent": 1, "refreed": 0}
    held.refresh_from_db()
    fresh.refresh_from_db()
    assert held.state == "failed" and "did not finish within its lease" in held.error
    assert fresh.state == "loading" and sent == [str(waiting.pk)]
    d.refresh_from_db()
    assert d.restarts == 1  # the restart policy takes it from there


def test_a_free_that_did_not_finish_within_its_lease_is_sent_again(db, smollm2_model, monkeypatch):
    from apps.deployments import tasks

    freed = []
    monkeypatch.setattr(tasks.free_replica, "delay", lambda pk: freed.append(pk))
    node, d = _unreachable_deployment(smollm2_model, replicas=1)
    lost = Replica.objects.create(
        deployment=d, node=node, state="stopping",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )  # fmt: skip
    going = Replica.objects.create(deployment=d, node=node, state="ready")
    d.replicas = 0
    Deployment.objects.filter(pk=d.pk).update(state=Deployment.State.STOPPING)
    services.reconcile(d.pk)  # sets `going` stopping, with a lease of its own
    going.refresh_from_db()
    assert going.state == "stopping" and going.lease_expires_at > timezone.now()
    freed.clear()  # what reconcile sent for `going`
    assert services.expire_leases() == {"lost": 0, "resent": 0, "refreed": 1}
    assert freed == [str(lost.pk)]
    lost.refresh_from_db()
    assert lost.state == "stopping" and lost.lease_expires_at > timezone.now()  # a new lease


def test_an_agent_restart_fails_everything_of_its_previous_boot_at_once(
    ops, smollm2_model, registered_agent, celery_worker_thread
):
    """A report with a new boot id: ready, loading and unreachable replicas of the old boot
    all fail at that report, with the reason (a loading one would otherwise wait out its
    lease)."""
    r, _ = deploy_one_replica(ops, registered_agent)
    d = Deployment.objects.get()
    node = Node.objects.get()
    soon = timezone.now() + timedelta(minutes=15)
    loading = Replica.objects.create(
        deployment=d, node=node, state="loading", lease_expires_at=soon
    )
    # What a restart looks like from here: the engines are gone and the boot id is new.
    service = registered_agent.agent.service
    registered_agent.call(service.shutdown())
    service.replicas.clear()
    old_boot, service.boot_id = service.boot_id, "a-new-boot"
    assert Node.objects.get().boot_id == old_boot
    registered_agent.heartbeat()
    r.refresh_from_db()
    loading.refresh_from_db()
    assert r.state == loading.state == "failed"
    assert "restarted: its engines are gone" in r.error
    assert "restarted: its engines are gone" in loading.error
    assert Node.objects.get().boot_id == "a-new-boot"
