"""Reconciling: bring each deployment's replicas towards its desired state, restart failed
ones with back-off, expire leases of loads whose worker died, and sum up a deployment's state.

Tasks claim their work with a conditional UPDATE, so a task that runs twice (acks_late, a lost
worker) does nothing the second time."""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from apps.deployments import placement
from apps.deployments.models import Deployment, PlanStage, Replica, ShardPlan
from apps.deployments.services.events import record_event

S = Replica.State
D = Deployment.State


#: Restarts of failed replicas wait 10 s, then twice as long each time up to 5 minutes, as the
#: kubelet's back-off does; after 3 the deployment shows as a crash loop, and 10 minutes
#: without a failure start the count again.
RESTART_FIRST_DELAY, RESTART_MAX_DELAY = 10, 300
CRASH_LOOP_AFTER = 3
STEADY_SECONDS = 600


def reconcile(deployment_id: int) -> None:
    """Bring a deployment's replicas towards its desired state (safe to run any time)."""
    from apps.deployments.tasks import free_replica, load_replica

    with transaction.atomic():
        d = Deployment.objects.select_for_update().select_related("model").get(pk=deployment_id)
        if d.state in (D.STOPPING, D.STOPPED):
            to_stop = list(d.replica_set.filter(state__in=Replica.LIVE + (S.UNREACHABLE, S.FAILED)))
            Replica.objects.filter(pk__in=[r.pk for r in to_stop]).update(**stopping())
            for r in to_stop:
                free_replica.delay_on_commit(str(r.pk))
            refresh_state(d)
            return
        _heal(d)
        # Failed replicas keep their place until their restart is due (or, with the restart
        # policy "never", until someone redeploys). Unreachable ones keep it while their node
        # may come back with them.
        current = d.replica_set.filter(state__in=Replica.LIVE + (S.UNREACHABLE, S.FAILED))
        missing = d.replicas - current.count()
        if missing > 0:
            plan = placement.plan_for(d, missing)
            why = plan.error or plan.short
            # Replicas share one plan (a head each); each copy of a split has its own.
            for copy in plan.each_copy() if plan.kind != "refused" else ():
                stored = placement.save(d, copy)
                heads = [s for s in stored.stages.select_related("node") if s.role != "stage"]
                for st in heads:
                    r = Replica.objects.create(deployment=d, node=st.node, plan=stored)
                    record_event(d, _placed(stored, st), replica=r)
                    for w in copy.warnings:
                        record_event(d, f"plan: {w}", level="warning", replica=r)
                    load_replica.delay_on_commit(str(r.pk))
            if why and why != d.error:
                record_event(d, f"waiting for capacity: {why}", level="warning")
            Deployment.objects.filter(pk=d.pk).update(error=why and f"waiting for capacity: {why}")
        elif missing < 0:
            # Drop the least useful first: failed, then not yet ready, then the newest.
            rank = {S.FAILED: 0, S.UNREACHABLE: 1, S.PENDING: 2, S.LOADING: 3, S.READY: 4}
            extra = sorted(current, key=lambda r: (rank[r.state], -r.created_at.timestamp()))[
                :-missing
            ]
            Replica.objects.filter(pk__in=[r.pk for r in extra]).update(**stopping())
            for r in extra:
                free_replica.delay_on_commit(str(r.pk))
        d.refresh_from_db()
        refresh_state(d)


#: A pending replica whose load task never ran (the broker was down when it was sent) is sent
#: again after this long.
RESEND_AFTER_SECONDS = 120
#: A replica being stopped whose free has not finished by then is freed again (its worker
#: died, or the task was lost with the broker); FreeMemory is harmless twice.
FREE_LEASE_SECONDS = 2 * 30 + 60


def stopping() -> dict:
    """The fields of a replica set stopping: the state, and the lease of its free."""
    return {
        "state": S.STOPPING,
        "lease_expires_at": timezone.now() + timedelta(seconds=FREE_LEASE_SECONDS),
    }


def expire_leases() -> dict:
    """Loads whose worker died holding the claim fail with that reason (and are replaced
    under the restart policy); loads never picked up are sent again, and so are frees that
    did not finish within their lease."""
    from apps.deployments.tasks import free_on_node, free_replica, load_replica

    now = timezone.now()
    lost = list(
        Replica.objects.filter(state=S.LOADING, lease_expires_at__lt=now).select_related(
            "node", "plan"
        )
    )
    for r in lost:
        why = "the load did not finish within its lease (the worker running it stopped?)"
        if fail_replica(r, why, from_states=(S.LOADING,)):
            free_on_node.delay_on_commit(r.node_id, str(r.pk))
    stale = list(
        Replica.objects.filter(
            state=S.PENDING, created_at__lt=now - timedelta(seconds=RESEND_AFTER_SECONDS)
        ).values_list("pk", flat=True)
    )
    for pk in stale:
        load_replica.delay(str(pk))  # the claim makes a second delivery harmless
    unfreed = list(
        Replica.objects.filter(state=S.STOPPING, lease_expires_at__lt=now).values_list(
            "pk", flat=True
        )
    )
    for pk in unfreed:
        Replica.objects.filter(pk=pk, state=S.STOPPING).update(**stopping())  # a new lease
        free_replica.delay(str(pk))
    return {"lost": len(lost), "resent": len(stale), "refreed": len(unfreed)}


def retire_failed(d: Deployment) -> int:
    """Failed replicas give up their place (stopped here, forgotten on their node)."""
    from apps.deployments.tasks import free_on_node

    failed = list(d.replica_set.filter(state=S.FAILED).select_related("node"))
    Replica.objects.filter(pk__in=[r.pk for r in failed]).update(state=S.STOPPED)
    for r in failed:
        # The agent may still hold the dead engine's record: clear it there too.
        free_on_node.delay_on_commit(r.node_id, str(r.pk))
    return len(failed)


def _heal(d: Deployment) -> None:
    """Under the restart policy "always": replace failed replicas once their back-off is
    over, and forget past failures after a steady stretch. Called under the row lock."""
    if d.restart_policy != Deployment.Restart.ALWAYS:
        return
    now = timezone.now()
    if d.next_restart_at and d.next_restart_at <= now:
        n = retire_failed(d)
        Deployment.objects.filter(pk=d.pk).update(next_restart_at=None)
        d.next_restart_at = None
        if n:
            record_event(d, f"restart {d.restarts}: replacing {n} failed replica(s)")
    elif (
        d.restarts
        and d.state == D.READY
        and d.last_failure_at
        and d.last_failure_at < now - timedelta(seconds=STEADY_SECONDS)
    ):
        Deployment.objects.filter(pk=d.pk).update(restarts=0)
        d.restarts = 0
        record_event(d, "ran steadily for 10 minutes: restart back-off reset")


def _back_off(d: Deployment) -> None:
    """A replica failed: schedule its restart after the back-off (one for failures that
    arrive together)."""
    from apps.deployments.tasks import reconcile_deployment

    now = timezone.now()
    if d.restart_policy != Deployment.Restart.ALWAYS or d.state in (D.STOPPING, D.STOPPED):
        return
    if d.next_restart_at and d.next_restart_at > now:
        return  # a restart is already due; this failure joins it
    restarts = d.restarts + 1
    delay = min(RESTART_FIRST_DELAY * 2 ** (restarts - 1), RESTART_MAX_DELAY)
    Deployment.objects.filter(pk=d.pk).update(
        restarts=restarts, next_restart_at=now + timedelta(seconds=delay), last_failure_at=now
    )
    d.restarts, d.next_restart_at, d.last_failure_at = restarts, now + timedelta(seconds=delay), now
    record_event(d, f"restart {restarts} in {delay} s", level="warning")
    reconcile_deployment.apply_async_on_commit((d.pk,), countdown=delay)


def _placed(plan: ShardPlan, head: PlanStage) -> str:
    if plan.kind == ShardPlan.Kind.REPLICAS:
        return f"replica placed on {head.node_name} ({head.total_bytes / 2**30:.2f} GiB)"
    parts = [
        f"{s.role} {s.node_name}"
        + (
            f" layers {s.layer_start}-{s.layer_end - 1}"
            if s.layers and plan.split_mode == "layer"
            else ""
        )
        + f" ({s.total_bytes / 2**30:.2f} GiB)"
        for s in plan.stages.all()
    ]
    return f"{plan.split_mode} split planned: " + ", ".join(parts)


def refresh_state(d: Deployment) -> str:
    """Derive a deployment's state from its replicas; record a change as an event."""
    counts = dict(
        d.replica_set.values_list("state").annotate(n=Count("pk")).values_list("state", "n")
    )
    ready = counts.get(S.READY, 0)
    error = d.error
    if d.state in (D.STOPPING, D.STOPPED):
        busy = sum(counts.get(s, 0) for s in (*Replica.LIVE, S.STOPPING))
        state = D.STOPPING if busy else D.STOPPED
    elif d.replicas == 0 and not any(counts.get(s, 0) for s in (*Replica.LIVE, S.UNREACHABLE)):
        state, error = D.IDLE, ""  # scaled to zero; a request wakes it
    elif ready >= d.replicas:
        state, error = D.READY, ""
    elif ready or counts.get(S.UNREACHABLE, 0):
        state = D.DEGRADED  # unreachable replicas may come back
    elif counts.get(S.PENDING, 0) or counts.get(S.LOADING, 0):
        state = D.DEPLOYING
    elif counts.get(S.FAILED, 0):
        looping = d.restart_policy == Deployment.Restart.ALWAYS and d.restarts >= CRASH_LOOP_AFTER
        state = D.CRASH_LOOP if looping else D.FAILED
    else:
        state = D.PENDING  # waiting for capacity
    if state in (D.DEGRADED, D.FAILED, D.CRASH_LOOP):
        # The deployment's error is that of its most recently failed (or lost) replica.
        last = (
            d.replica_set.filter(state__in=(S.FAILED, S.UNREACHABLE))
            .order_by("-updated_at")
            .first()
        )
        error = last.error if last else error
    if state != d.state or error != d.error:
        Deployment.objects.filter(pk=d.pk).update(state=state, error=error)
        if state != d.state:
            level = (
                "error"
                if state in (D.FAILED, D.CRASH_LOOP)
                else "warning"
                if state == D.DEGRADED
                else "info"
            )
            record_event(d, f"{d.state} -> {state}" + (f": {error}" if error else ""), level=level)
        d.state, d.error = state, error
    return state


def fail_replica(replica: Replica, error: str, from_states=Replica.LIVE) -> bool:
    """Mark a replica failed (if it still is in one of from_states) and refresh its deployment."""
    changed = Replica.objects.filter(pk=replica.pk, state__in=from_states).update(
        state=S.FAILED, error=error, updated_at=timezone.now()
    )
    if changed:
        from apps.deployments.tasks import stop_replica_stages

        d = Deployment.objects.get(pk=replica.deployment_id)
        record_event(
            d, f"replica on {replica.node.name} failed: {error}", level="error", replica=replica
        )
        _back_off(d)
        refresh_state(d)
        if replica.plan_id and replica.plan.kind == ShardPlan.Kind.SPLIT:
            # The surviving stages hold memory for a head that is gone: free them.
            stop_replica_stages.delay_on_commit(str(replica.pk))
    return bool(changed)
