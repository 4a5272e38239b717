"""Autoscaling: the decision rule on its own, the API, and the whole loop on real parts (real
agents and engines, a real Celery worker on Redis, uvicorn on a socket, httpx and the OpenAI
SDK as clients). The beat schedule's task body, autoscaling.tick(), is called by the tests at
their own pace instead of every 5 s."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from apps.deployments import autoscaling
from apps.deployments.autoscaling import Sample, decide
from apps.deployments.models import Deployment, Replica, ScalingPolicy
from tests.conftest import SMOLLM2, RunningAgent, wait_for

P = ScalingPolicy


def policy(**kw) -> ScalingPolicy:
    base = dict(
        mode=P.Mode.ON,
        min_replicas=1,
        max_replicas=4,
        metric=P.Metric.IN_FLIGHT_PER_SLOT,
        target=0.5,
        window_seconds=30,
        scale_down_delay_seconds=60,
        cooldown_seconds=20,
    )
    return ScalingPolicy(**(base | kw))


def series(loads: list[float], step: float = 5.0, end: float = 1000.0) -> list[Sample]:
    return [Sample(end - step * (len(loads) - 1 - i), x, 1) for i, x in enumerate(loads)]


# ---- the rule ------------------------------------------------------------------------------


def test_scales_up_on_the_windows_mean_load():
    p = policy()  # 0.5 per slot x 4 slots: 2 requests per replica
    d = decide(p, 1, 4, series([6, 6, 6, 6, 6, 6]), 1000.0, None)
    assert d.desired == 3 and "load 6.00 over 30 s" in d.reason
    # One burst in an otherwise quiet window does not.
    assert decide(p, 1, 4, series([0, 0, 0, 0, 0, 6]), 1000.0, None) is None
    # Never above the maximum.
    assert decide(p, 1, 4, series([40] * 6), 1000.0, None).desired == 4


def test_the_cooldown_holds_a_second_change_back():
    p = policy()
    assert decide(p, 1, 4, series([6] * 6), 1000.0, last_scaled=990.0) is None
    assert decide(p, 1, 4, series([6] * 6), 1000.0, last_scaled=975.0).desired == 3


def test_scales_down_only_after_the_whole_delay_was_quiet():
    p = policy()
    quiet = series([1] * 13)  # 60 s observed, 1 request: one replica is enough
    assert decide(p, 3, 4, quiet, 1000.0, None).desired == 1
    # Not yet observed for the whole delay (a fresh autoscaler): stay.
    assert decide(p, 3, 4, series([1] * 5), 1000.0, None) is None
    # A peak inside the delay keeps what the peak needed.
    assert decide(p, 3, 4, series([1] * 6 + [4] + [1] * 6), 1000.0, None).desired == 2


def test_to_zero_when_allowed_and_back_for_a_waiting_request():
    p = policy(min_replicas=0)
    assert decide(p, 1, 4, series([0] * 13), 1000.0, None).desired == 0
    assert decide(policy(), 1, 4, series([0] * 13), 1000.0, None) is None  # min 1
    # At zero, one waiting request starts a replica at once, cooldown or not.
    d = decide(p, 0, 4, series([0] * 12 + [1]), 1000.0, last_scaled=999.0)
    assert d.desired == 1 and "waiting at zero" in d.reason
    # A crowd at zero starts as many as it needs.
    assert decide(p, 0, 4, series([0] * 12 + [7]), 1000.0, 999.0).desired == 4


def test_queue_depth_counts_beyond_the_slots():
    p = policy(metric=P.Metric.QUEUE_DEPTH, target=1)  # 4 slots + 1 queued per replica
    assert decide(p, 1, 4, series([5] * 6), 1000.0, None) is None
    assert decide(p, 1, 4, series([11] * 6), 1000.0, None).desired == 3


# ---- the API -------------------------------------------------------------------------------


@pytest.fixture
def idle_deployment(db, smollm2_model):
    return Deployment.objects.create(
        name="chat", model=smollm2_model, replicas=1, context_length=512, parallel=2,
        state=Deployment.State.READY,
    )  # fmt: skip


@pytest.mark.django_db
def test_policy_api_validates_and_owns_the_replica_count(ops, idle_deployment):
    url = "/api/v1/deployments/chat/autoscaling/"
    assert ops.get(url).status_code == 404
    bad = ops.put(url, {"min_replicas": 3, "max_replicas": 2}, format="json")
    assert bad.status_code == 400 and "min" in bad.json()["detail"]
    assert ops.put(url, {"mode": "sometimes"}, format="json").status_code == 400
    assert ops.put(url, {"window_seconds": 1}, format="json").status_code == 400
    ok = ops.put(url, {"min_replicas": 2, "max_replicas": 3, "target": 1}, format="json")
    assert ok.status_code == 200, ok.content
    assert ok.json()["mode"] == "on" and ok.json()["min_replicas"] == 2
    idle_deployment.refresh_from_db()
    assert idle_deployment.replicas == 2  # moved into the bounds at once
    body = ops.get("/api/v1/deployments/chat/").json()
    assert body["autoscaling"]["max_replicas"] == 3
    assert any("autoscaler: 1 -> 2" in e["message"] for e in body["recent_events"])
    # Hand scaling would fight the autoscaler: refused, with what to do instead.
    scale = ops.post("/api/v1/deployments/chat/scale/", {"replicas": 1}, format="json")
    assert scale.status_code == 409 and "shadow" in scale.json()["detail"]
    # A partial change keeps the other fields.
    assert ops.put(url, {"mode": "shadow"}, format="json").json()["min_replicas"] == 2
    assert (
        ops.post("/api/v1/deployments/chat/scale/", {"replicas": 1}, format="json").status_code
        == 202
    )


@pytest.mark.django_db
def test_a_split_deployment_is_not_autoscaled(ops, idle_deployment):
    Deployment.objects.filter(pk=idle_deployment.pk).update(split_mode="layer")
    r = ops.put("/api/v1/deployments/chat/autoscaling/", {"max_replicas": 2}, format="json")
    assert r.status_code == 409 and "split" in r.json()["detail"]


@pytest.mark.django_db
def test_an_application_key_cannot_change_autoscaling(api, idle_deployment):
    r = api.put("/api/v1/deployments/chat/autoscaling/", {"max_replicas": 9}, format="json")
    assert r.status_code == 403
    assert not ScalingPolicy.objects.exists()


# ---- the loop on real parts ----------------------------------------------------------------


@pytest.fixture
def fleet(transactional_db, smollm2_model, model_store):
    """Two real agents, registered; no deployment yet."""
    from apps.nodes.services import record_heartbeat

    agents = [RunningAgent(model_store, name) for name in ("node-a", "node-b")]
    for a in agents:
        a.node = record_heartbeat(a.status_payload())
    yield agents
    for a in agents:
        a.close()


def deploy(ops, **autoscale) -> None:
    r = ops.post(
        "/api/v1/deployments/",
        {"model": SMOLLM2, "name": "chat", "context_length": 512, "parallel": 2,
         "autoscaling": autoscale},
        format="json",
    )  # fmt: skip
    assert r.status_code == 202, r.content
    wait_for(lambda: Deployment.objects.get(name="chat").state == "ready", 60)


def ready_count() -> int:
    return Replica.objects.filter(deployment__name="chat", state="ready").count()


def tick_until(predicate, timeout: float = 60.0):
    """Run the beat task's body every 0.5 s until predicate() holds."""

    def step():
        autoscaling.tick()
        return predicate()

    return wait_for(step, timeout, interval=0.5)


def stream(base: str, key: str, tokens: int, out: list) -> None:
    body = {
        "model": SMOLLM2,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": tokens,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, timeout=120,
        headers={"Authorization": f"Bearer {key}"},
    ) as r:  # fmt: skip
        out.append((r.status_code, r.read().decode()))


def test_sustained_load_brings_a_second_replica_and_idleness_takes_it_away(
    ops, alice_key, fleet, celery_worker_thread, asgi_server
):
    deploy(
        ops, min_replicas=1, max_replicas=2, target=0.5, window_seconds=5,
        scale_down_delay_seconds=4, cooldown_seconds=0,
    )  # fmt: skip
    assert ready_count() == 1
    out: list = []
    clients = [
        threading.Thread(target=stream, args=(asgi_server, alice_key, 400, out)) for _ in range(4)
    ]
    for c in clients:
        c.start()
    try:
        # 4 streams on one replica of 2 slots, 1 per replica wanted: up to the maximum of 2.
        tick_until(lambda: Deployment.objects.get(name="chat").replicas == 2, 30)
        wait_for(lambda: ready_count() == 2, 60)
    finally:
        for c in clients:
            c.join(120)
    assert [status for status, _ in out] == [200] * 4
    events = list(Deployment.objects.get(name="chat").events.values_list("message", flat=True))
    assert any("autoscaler: 1 -> 2" in m and "per replica" in m for m in events), events
    # Quiet for the whole delay: back to the minimum, and the engine is freed on its node.
    tick_until(lambda: Deployment.objects.get(name="chat").replicas == 1, 30)
    wait_for(lambda: sum(len(a.agent.service.replicas) for a in fleet) == 1, 30)
    assert ready_count() == 1


def test_scale_to_zero_and_a_request_at_zero_is_served(
    ops, alice_key, fleet, celery_worker_thread, asgi_server
):
    from openai import OpenAI

    deploy(
        ops, min_replicas=0, max_replicas=1, window_seconds=5, scale_down_delay_seconds=2,
        cooldown_seconds=0,
    )  # fmt: skip
    tick_until(lambda: Deployment.objects.get(name="chat").state == "idle", 30)
    wait_for(lambda: not any(a.agent.service.replicas for a in fleet), 30)
    client = OpenAI(base_url=f"{asgi_server}/v1", api_key=alice_key, max_retries=0)
    # Listed while at zero: a request starts it.
    assert SMOLLM2 in [m.id for m in client.models.list().data]
    began = time.monotonic()
    reply = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    cold = time.monotonic() - began
    assert ready_count() == 1
    events = list(Deployment.objects.get(name="chat").events.values_list("message", flat=True))
    assert any("autoscaler: 0 -> 1 replica(s): a request is waiting" in m for m in events)
    print(f"first token from zero: {cold:.2f} s")  # bench/autoscale.py measures it properly

    # Back to zero, then a stream: its connection stays open with SSE comments while the
    # replica loads, and the SDK sees an ordinary stream.
    tick_until(lambda: Deployment.objects.get(name="chat").state == "idle", 30)
    wait_for(lambda: not any(a.agent.service.replicas for a in fleet), 30)
    pieces = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
        stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text


def test_at_zero_overflow_and_a_timeout_get_503_with_retry_after(
    ops, alice_key, fleet, asgi_server, settings, celery_worker_thread
):
    deploy(ops, min_replicas=0, max_replicas=1, scale_down_delay_seconds=0, cooldown_seconds=0)
    tick_until(lambda: Deployment.objects.get(name="chat").state == "idle", 30)
    wait_for(lambda: not any(a.agent.service.replicas for a in fleet), 30)
    # Nothing is loaded from here on (reconciling is not sent): requests wait, and run out
    # of time.
    settings.COLD_START_TIMEOUT = 3
    settings.COLD_START_MAX_WAITING = 1
    from apps.deployments import tasks

    loads: list = []
    real_delay = tasks.reconcile_deployment.delay
    tasks.reconcile_deployment.delay = lambda *a, **k: loads.append(a)  # nothing starts
    try:
        body = {"model": SMOLLM2, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        headers = {"Authorization": f"Bearer {alice_key}"}
        results: list = []

        def call():
            results.append(
                httpx.post(f"{asgi_server}/v1/chat/completions", json=body, headers=headers,
                           timeout=30)
            )  # fmt: skip

        first = threading.Thread(target=call)
        first.start()
        # The first one waits (counted in Redis, as every web process counts)...
        from controlplane.redis import sync_client

        wait_for(lambda: sync_client().zcard(autoscaling.waiting_key(SMOLLM2)) == 1, 10)
        call()  # ...so the second is one too many
        first.join(30)
    finally:
        tasks.reconcile_deployment.delay = real_delay
    overflow, timed_out = results
    assert overflow.status_code == 503 and overflow.headers["Retry-After"] == "10"
    assert "already wait" in overflow.json()["error"]["message"]
    assert timed_out.status_code == 503 and int(timed_out.headers["Retry-After"]) > 0
    assert "within 3 s" in timed_out.json()["error"]["message"]
    assert loads  # the first request did ask for a replica
