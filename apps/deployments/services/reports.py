"""Agent reports: what a node's heartbeat says about its replicas (failed, gone, re-adopted,
orphaned), and what a lost node means for them."""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.utils import timezone

from apps.deployments.models import Deployment, PlanStage, Replica
from apps.deployments.services.events import record_event
from apps.deployments.services.reconciling import fail_replica, refresh_state
from apps.deployments.services.splits import diagnose_stages
from apps.nodes.models import Node

S = Replica.State
Reported = Node.ReportedState


#: How long a ready replica may be missing from its node's reports before it counts as gone
#: (reports are snapshots that can arrive late: built, queued, buffered, flushed).
REPORT_GRACE_SECONDS = 10


def react_to_report(
    node_id: int, boot_id: str, reported: list[dict], restarted: bool = False
) -> None:
    """A recorded heartbeat's reaction, run after its commit and outside the node's lock. The
    node is read afresh; a report from a boot that has since been replaced stands down (the
    new boot's first report reacts for it, and would be undone by this one)."""
    node = Node.objects.filter(pk=node_id).first()
    if node is None or (boot_id and node.boot_id and node.boot_id != boot_id):
        return  # removed, or restarted again since this report
    apply_agent_report(node, reported, restarted=restarted)


def apply_agent_report(node: Node, reported: list[dict], restarted: bool = False) -> None:
    """Compare what an agent holds with what we think it holds. After a restart (a new boot)
    nothing of the previous boot survives: its loading and unreachable replicas fail at once
    too, rather than when their lease runs out or their node is swept."""
    from apps.deployments.tasks import free_on_node

    by_id = {r["replica_id"]: r for r in reported if _is_uuid(r["replica_id"])}
    if not restarted and _as_expected(node, by_id):
        return
    if restarted:
        gone = Replica.objects.filter(
            node=node, state__in=(S.LOADING, S.UNREACHABLE)
        ).select_related("node", "plan")
        for r in gone:
            if str(r.pk) not in by_id:
                fail_replica(
                    r,
                    f"the agent on {node.name} restarted: its engines are gone",
                    (S.LOADING, S.UNREACHABLE),
                )
    _readopt(node, by_id)
    now = timezone.now()
    for r in Replica.objects.filter(node=node, state=S.READY).select_related("node", "plan"):
        seen = by_id.get(str(r.pk))
        if seen is not None and r.missing_since:
            Replica.objects.filter(pk=r.pk).update(missing_since=None)
        if seen is None and not restarted:
            # A report is a snapshot that may arrive late (a replica that became ready since
            # is not in it): only reports that go on missing it for the grace period count.
            if r.missing_since is None:
                Replica.objects.filter(pk=r.pk, missing_since=None).update(missing_since=now)
                continue
            if now - r.missing_since < timedelta(seconds=REPORT_GRACE_SECONDS):
                continue
        if seen is None:
            why = (
                f"the agent on {node.name} restarted: its engines are gone"
                if restarted
                else f"node {node.name} no longer holds this replica"
            )
            fail_replica(r, why, (S.READY,))
        elif seen["state"] == Reported.FAILED:
            # A split head aborts when a stage goes away: say which one.
            why = f"{seen['error']} (on node {node.name})" + diagnose_stages(r)
            fail_replica(r, why, (S.READY,))
        elif seen["memory_bytes"] and seen["memory_bytes"] != r.memory_bytes:
            Replica.objects.filter(pk=r.pk).update(memory_bytes=seen["memory_bytes"])
    # Engines the agent holds that should not run any more: free them.
    wanted = {
        str(pk)
        for pk in Replica.objects.filter(
            node=node, pk__in=list(by_id), state__in=(*Replica.LIVE, S.UNREACHABLE)
        ).values_list("pk", flat=True)
    }
    for replica_id, seen in by_id.items():
        if replica_id not in wanted and seen["state"] != Reported.STOPPING:
            free_on_node.delay_on_commit(node.pk, replica_id)
    # rpc servers this node runs for ready splits: one that died, or that the agent no longer
    # runs at all (restarted), fails its split.
    reported = {s["endpoint"]: s for s in node.rpc_servers or ()}
    for st in _live_stages_on(node).exclude(endpoint=""):
        seen = reported.get(st.endpoint)
        if seen is not None and seen["running"]:
            continue
        why = (
            f"stopped: {seen['error'] or 'not running'}"
            if seen
            else "is gone (the agent no longer runs it; restarted?)"
        )
        for r in st.plan.replicas.filter(state=S.READY).select_related("node", "plan"):
            fail_replica(
                r, f"the rpc server of stage {node.name} ({st.endpoint}) {why}", (S.READY,)
            )


def _as_expected(node: Node, by_id: dict[str, dict]) -> bool:
    """The common heartbeat, answered with one query: the agent holds ready exactly the
    replicas we route to, nothing to re-adopt, free or fail (memory figures are refreshed
    here). False sends the report down the full comparison."""
    rows = Replica.objects.filter(
        node=node, state__in=(*Replica.LIVE, S.UNREACHABLE, S.STOPPING)
    ).values_list("pk", "state", "memory_bytes", "missing_since")
    ours = {str(pk): (state, mem) for pk, state, mem, _ in rows}
    if any(missing for *_, missing in rows):
        return False  # missing from an earlier report
    for rid, (state, _) in ours.items():
        seen = by_id.get(rid)
        if state == S.UNREACHABLE or (
            state == S.READY and (seen is None or seen["state"] != Reported.READY)
        ):
            return False
    wanted = {rid for rid, (state, _) in ours.items() if state != S.STOPPING}
    if any(rid not in wanted and seen["state"] != Reported.STOPPING for rid, seen in by_id.items()):
        return False  # an engine to free
    if node.rpc_servers or _live_stages_on(node).exclude(endpoint="").exists():
        return False  # rpc servers of splits: compared in full
    for rid, (state, mem) in ours.items():
        reported = by_id.get(rid, {}).get("memory_bytes")
        if state == S.READY and reported and reported != mem:
            Replica.objects.filter(pk=rid).update(memory_bytes=reported)
    return True


def _readopt(node: Node, by_id: dict[str, dict]) -> None:
    """Replicas lost with a node (or with a stage node) that the agent still holds ready serve
    again, once every node of their plan reports; the others on this node have failed."""
    for r in Replica.objects.filter(node=node, state=S.UNREACHABLE).select_related("node", "plan"):
        seen = by_id.get(str(r.pk))
        if seen is None or seen["state"] != Reported.READY:
            why = "held it no more" if seen is None else f"reports it {seen['state']}"
            fail_replica(r, f"node {node.name} came back but {why}", (S.UNREACHABLE,))
            continue
        quiet = (
            r.plan.stages.exclude(node__state=Node.State.READY).values_list("node_name", flat=True)
            if r.plan_id
            else []
        )
        if quiet:
            continue  # a stage node is still out: wait for it
        if Replica.objects.filter(pk=r.pk, state=S.UNREACHABLE).update(state=S.READY, error=""):
            d = Deployment.objects.get(pk=r.deployment_id)
            record_event(d, f"replica on {node.name} re-adopted: its node is back", replica=r)
            refresh_state(d)


def mark_unreachable(replica: Replica, why: str) -> bool:
    """A ready replica whose node (or stage node) went quiet: out of routing, kept in memory."""
    changed = Replica.objects.filter(pk=replica.pk, state=S.READY).update(
        state=S.UNREACHABLE, error=why, updated_at=timezone.now()
    )
    if changed:
        d = Deployment.objects.get(pk=replica.deployment_id)
        record_event(d, f"replica on {replica.node.name} unreachable: {why}", "warning", replica)
        refresh_state(d)
    return bool(changed)


def _live_stages_on(node: Node):
    return PlanStage.objects.filter(
        node=node, role=PlanStage.Role.STAGE, plan__replicas__state__in=Replica.LIVE
    ).select_related("plan")


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except (ValueError, TypeError):
        return False
    return True


def node_lost(node: Node, since) -> None:
    """A node went quiet and does not answer: what it held cannot serve, nor the splits it was
    a stage of. Ready replicas become unreachable (kept, re-adopted if the node comes back with
    them); ones still loading fail."""
    why = f"node {node.name} stopped sending heartbeats (last at {since:%H:%M:%S} UTC)"
    for r in Replica.objects.filter(node=node, state__in=Replica.LIVE).select_related(
        "node", "plan"
    ):
        if not mark_unreachable(r, why):
            fail_replica(r, why)
    for st in _live_stages_on(node):
        stage_why = (
            f"stage node {node.name} (layers {st.layer_start}-{st.layer_end - 1}) stopped "
            f"sending heartbeats (last at {since:%H:%M:%S} UTC)"
        )
        for r in st.plan.replicas.filter(state__in=Replica.LIVE).select_related("node", "plan"):
            if not mark_unreachable(r, stage_why):
                fail_replica(r, stage_why)
