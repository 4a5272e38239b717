"""Recording what agents report and noticing the ones that went quiet."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.nodes.models import Node
from apps.nodes.signals import node_lost, node_reported
from controlplane.errors import Conflict, DomainError

log = logging.getLogger(__name__)

#: Seconds the sweep waits for a quiet node's agent to answer before calling it unreachable.
PROBE_TIMEOUT = 3.0

_STATE_NAMES = {
    "REPLICA_STATE_LOADING": "loading",
    "REPLICA_STATE_READY": "ready",
    "REPLICA_STATE_FAILED": "failed",
    "REPLICA_STATE_STOPPING": "stopping",
}


def record_heartbeat(payload: dict) -> Node:
    """Register or refresh a node from an agent's status report (registration is the first
    one). The payload is a NodeStatus in protobuf's JSON form, plus the agent's `address`.

    Only the node's row is written under its lock; what the report means for replicas (fail,
    re-adopt, free) runs after the commit, so a slow reaction never holds the lock.
    """
    from google.protobuf.json_format import ParseDict, ParseError
    from llamafleet.agent.v1 import agent_pb2 as pb

    address = str(payload.get("address") or "").strip() if isinstance(payload, dict) else ""
    try:
        status = ParseDict(payload, pb.NodeStatus(), ignore_unknown_fields=True)
    except (ParseError, TypeError, ValueError, AttributeError) as exc:
        raise DomainError(f"not a NodeStatus report: {exc}") from None
    name = status.node_name.strip()
    if not name or not address:
        raise DomainError("node_name and address are required")
    replicas = [
        {
            "replica_id": r.replica_id,
            "model_name": r.model_name,
            "state": _STATE_NAMES.get(pb.ReplicaState.Name(r.state), "unknown"),
            "error": r.error,
            "memory_bytes": r.memory_bytes,
            "in_flight": r.in_flight,
            "pid": r.pid,
        }
        for r in status.replicas
    ]
    fields = {
        "address": address,
        "state": Node.State.READY,
        "version": status.version[:40],
        "memory_total_bytes": status.memory_total_bytes,
        "memory_available_bytes": status.memory_available_bytes,
        "memory_in_use_bytes": status.memory_in_use_bytes,
        "disk_free_bytes": status.disk_free_bytes,
        "cpu_cores": status.cpu_cores,
        "load_average": status.load_average,
        "accelerators": list(status.accelerators),
        "rpc_servers": [
            {"endpoint": s.endpoint, "running": s.running, "pid": s.pid, "error": s.error}
            for s in status.rpc_servers
        ],
        "in_flight": status.in_flight,
        "reported_replicas": replicas,
        "last_heartbeat_at": timezone.now(),
        "boot_id": status.boot_id[:64],
    }
    with transaction.atomic():
        previous, previous_boot = (
            Node.objects.select_for_update()
            .filter(name=name)
            .values_list("last_heartbeat_at", "boot_id")
            .first()
        ) or (None, "")
        node, created = Node.objects.update_or_create(name=name, defaults=fields)
        restarted = bool(previous_boot and status.boot_id and previous_boot != status.boot_id)
        if created:
            log.info("node %s registered at %s", name, address)
        elif restarted:
            log.warning("node %s: its agent restarted (new boot)", name)
        transaction.on_commit(
            lambda: node_reported.send(
                sender=Node,
                node=node,
                reported=replicas,
                previous_heartbeat_at=previous,
                restarted=restarted,
            ),
            robust=True,  # a failed reaction is logged; the heartbeat itself is recorded
        )
    return node


def sweep_stale_nodes() -> list[str]:
    """Mark nodes unreachable when their heartbeats stopped and they do not answer a direct
    probe either; returns their names.

    Silence alone is not proof: when the web process or the database was out, heartbeats did
    not reach us although every agent serves on. A node whose agent answers GetStatus is
    refreshed from that answer (as a heartbeat would) and keeps everything it holds.
    """
    cutoff = timezone.now() - timedelta(seconds=settings.HEARTBEAT_TIMEOUT_SECONDS)
    stale = list(Node.objects.filter(state=Node.State.READY, last_heartbeat_at__lt=cutoff))
    if not stale:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(stale))) as pool:
        answers = list(pool.map(_probe, stale))
    lost = []
    for node, answer in zip(stale, answers, strict=True):
        if answer is not None:
            log.warning(
                "node %s answered the sweep's probe: its heartbeats did not reach us", node.name
            )
            record_heartbeat(answer)
            continue
        with transaction.atomic():
            # Conditional update: another sweeper (or a fresh heartbeat) may have got there first.
            claimed = Node.objects.filter(
                pk=node.pk, state=Node.State.READY, last_heartbeat_at__lt=cutoff
            ).update(state=Node.State.UNREACHABLE)
            if claimed:
                log.warning("node %s stopped sending heartbeats and does not answer", node.name)
                transaction.on_commit(
                    lambda node=node: node_lost.send(
                        sender=Node, node=node, since=node.last_heartbeat_at
                    ),
                    robust=True,
                )
                lost.append(node.name)
    return lost


def _probe(node: Node) -> dict | None:
    """The agent's status as a heartbeat payload, asked directly; None if it does not answer."""
    import grpc
    from google.protobuf.json_format import MessageToDict
    from llamafleet.agent.v1 import agent_pb2 as pb

    from apps.nodes import agent_client

    try:
        status = agent_client.stub(node.address).GetStatus(
            pb.GetStatusRequest(), metadata=agent_client.metadata(), timeout=PROBE_TIMEOUT
        )
    except grpc.RpcError:
        return None
    payload = MessageToDict(
        status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    if payload.get("node_name") != node.name:
        return None  # another agent now answers at that address
    return payload | {"address": node.address}


def remove_node(node: Node) -> None:
    """Forget a node that holds nothing live; its past costs stay in the reports."""
    from apps.deployments.models import Replica  # nodes knows no deployments otherwise

    live = Replica.objects.filter(node=node, state__in=Replica.LIVE).count()
    if live:
        raise Conflict(f"{node.name} still holds {live} replica(s): undeploy or scale them away")
    with transaction.atomic():
        Replica.objects.filter(node=node).delete()
        node.delete()
    log.info("node %s removed", node.name)


def set_draining(node: Node, draining: bool) -> Node:
    """Open or close a node to new work; what runs there is left alone."""
    Node.objects.filter(pk=node.pk).update(draining=draining)
    node.draining = draining
    log.info("node %s %s", node.name, "draining" if draining else "open")
    return node


#: Pairs measured per node when the fleet is too large for every pair.
LINK_SAMPLE = 8


def measure_links(node_names: list[str] | None = None) -> int:
    """Ask each ready node's agent to measure its links to the others (every pair up to
    LINK_SAMPLE + 1 nodes, else LINK_SAMPLE random peers each); store the results. The
    planner reads them to choose heads and warn about slow links."""
    import random

    import grpc
    from llamafleet.agent.v1 import agent_pb2 as pb

    from apps.nodes import agent_client
    from apps.nodes.models import NodeLink

    nodes = list(Node.objects.filter(state=Node.State.READY))
    if node_names:
        nodes = [n for n in nodes if n.name in set(node_names)]
    count = 0
    for src in nodes:
        peers = [n for n in nodes if n.pk != src.pk]
        if len(peers) > LINK_SAMPLE:
            peers = random.sample(peers, LINK_SAMPLE)
        for dst in peers:
            try:
                m = agent_client.stub(src.address).MeasureLink(
                    pb.MeasureLinkRequest(target=dst.address),
                    metadata=agent_client.metadata(),
                    timeout=60,
                )
                values = {"rtt_ms": m.rtt_ms, "mbit_s": m.mbit_s, "error": m.error}
                if m.error:
                    values.update(rtt_ms=None, mbit_s=None)
            except grpc.RpcError as exc:
                values = {"rtt_ms": None, "mbit_s": None, "error": f"{src.name}: {exc.details()}"}
            NodeLink.objects.update_or_create(
                source=src, target=dst, defaults={**values, "measured_at": timezone.now()}
            )
            count += 1
    return count
