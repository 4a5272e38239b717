"""Recording what agents report and noticing the ones that went quiet."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from redis.exceptions import RedisError, ResponseError

from apps.nodes.models import Node
from apps.nodes.signals import node_lost, node_reported, nodes_alive
from controlplane.db import bulk_update, relaxed_commit
from controlplane.errors import Conflict, DomainError
from controlplane.redis import client, sync_client
from controlplane.redis import key as redis_key
from workers.engine import errors

log = logging.getLogger(__name__)

#: Seconds the sweep waits for a quiet node's agent to answer before calling it unreachable.

_REPORTED = {
    "REPLICA_STATE_LOADING": Node.ReportedState.LOADING,
    "REPLICA_STATE_READY": Node.ReportedState.READY,
    "REPLICA_STATE_FAILED": Node.ReportedState.FAILED,
    "REPLICA_STATE_STOPPING": Node.ReportedState.STOPPING,
}


def _parse(payload: dict) -> tuple[str, dict, list[dict], str]:
    """A heartbeat's node name, its Node fields, its replicas and its boot id. The payload is
    a NodeStatus in protobuf's JSON form, plus the agent's `address`."""
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
            "state": _REPORTED.get(pb.ReplicaState.Name(r.state), Node.ReportedState.UNKNOWN),
            "error": r.error,
            "memory_bytes": r.memory_bytes,
            "in_flight": r.in_flight,
            "pid": r.pid,
            "threads": r.threads,
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
        "features": [f[:40] for f in status.features[:32]],
    }
    return name, fields, replicas, status.boot_id


def record_heartbeat(payload: dict, received_at=None) -> Node:
    """Register or refresh a node from an agent's status report (registration is the first
    one), and react to what it says about replicas.

    Only the node's row is written under its lock; what the report means for replicas (fail,
    re-adopt, free) runs after the commit, so a slow reaction never holds the lock.
    """
    name, fields, replicas, boot_id = _parse(payload)
    if received_at is not None:  # buffered: it arrived then
        fields["last_heartbeat_at"] = received_at
    with transaction.atomic():
        relaxed_commit()  # the next heartbeat follows in seconds
        node = Node.objects.select_for_update().filter(name=name).first()
        created = node is None
        if created:
            previous, previous_boot = None, ""
            node = Node.objects.create(name=name, **fields)
        else:
            previous, previous_boot = node.last_heartbeat_at, node.boot_id
            for k, v in fields.items():
                setattr(node, k, v)
            node.save(update_fields=list(fields))  # one UPDATE: the row is locked already
        restarted = bool(previous_boot and boot_id and previous_boot != boot_id)
        if created:
            log.info("node %s registered at %s", name, node.address)
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


# ---- heartbeats at fleet scale ---------------------------------------------------------------
#
# Most heartbeats say what the one before said: the same replicas in the same states, only
# fresher memory and load figures. Those are buffered in Redis by the web process (one
# HSET) and written in bulk by flush_heartbeats, at the start of every sweep (FLUSH_SECONDS):
# one UPDATE for all nodes, node-hours credited in bulk. A report that differs from the last
# one this process recorded in full, one from a node it has not seen for FULL_EVERY seconds,
# or any heartbeat while Redis does not answer, takes the full path at once.

#: Seconds between sweeps, each of which first writes the buffered heartbeats in bulk.
FLUSH_SECONDS = 2.0
#: A node's report takes the full path at least this often, so that changes made on the
#: control plane's side (a replica stopped, a node swept) meet the agent's view soon.
FULL_EVERY = 60.0
#: What the fast path writes: figures that change without meaning anything new.
FAST_FIELDS = (
    "memory_available_bytes",
    "memory_in_use_bytes",
    "disk_free_bytes",
    "load_average",
    "in_flight",
    "reported_replicas",
    "last_heartbeat_at",
)
_recorded: dict[str, tuple[str, float]] = {}  # node name -> (digest, when recorded in full)


def _digest(fields: dict) -> str:
    """What a report means: the node's identity and each replica's and rpc server's state,
    not its fluctuating figures."""

    meaning = {
        k: fields[k]
        for k in (
            "address",
            "version",
            "features",
            "boot_id",
            "memory_total_bytes",
            "cpu_cores",
            "accelerators",
            "rpc_servers",
        )  # fmt: skip
    }
    meaning["replicas"] = sorted(
        (r["replica_id"], r["state"], r["error"]) for r in fields["reported_replicas"]
    )
    return hashlib.blake2b(json.dumps(meaning, sort_keys=True).encode(), digest_size=16).hexdigest()


def _buffer_key() -> str:

    return redis_key("heartbeats")


async def receive_heartbeat(payload: dict) -> dict:
    """The heartbeat API: buffer a report that says nothing new, record the others in full."""

    name, fields, _, _ = _parse(payload)
    digest = _digest(fields)
    seen = _recorded.get(name)
    if seen and seen[0] == digest and time.monotonic() - seen[1] < FULL_EVERY:
        # Parsed once, here: the flush writes these figures as they are.
        fast = {k: fields[k] for k in FAST_FIELDS if k != "last_heartbeat_at"}
        entry = {"at": time.time(), "fast": fast, "payload": payload}
        try:
            await client().hset(_buffer_key(), name, json.dumps(entry))
            return {"node": name, "state": Node.State.READY}
        except (RedisError, OSError) as exc:
            log.warning("heartbeat of %s recorded directly (Redis: %s)", name, exc)
    node = await sync_to_async(record_heartbeat)(payload)
    if node.state == Node.State.READY:
        _recorded[name] = (digest, time.monotonic())
    return {"node": node.name, "state": node.state}


def flush_heartbeats() -> int:
    """Write the buffered heartbeats: in bulk for nodes that are ready; in full for any
    other (a node swept meanwhile comes back through the full path). Returns how many."""
    redis, taking = sync_client(), f"{_buffer_key()}:flushing:{uuid.uuid4().hex}"
    try:
        redis.rename(_buffer_key(), taking)  # what arrives from now on waits for the next
        raw = redis.hgetall(taking)
        redis.delete(taking)
    except ResponseError:
        return 0  # nothing buffered
    except RedisError as exc:
        log.warning("cannot flush buffered heartbeats: %s", exc)
        return 0
    entries = {k.decode(): json.loads(v) for k, v in raw.items()}
    nodes = {n.name: n for n in Node.objects.filter(name__in=entries)}
    fast, items = [], []
    for name, entry in entries.items():
        at = dt.datetime.fromtimestamp(entry["at"], dt.UTC)
        node = nodes.get(name)
        if node is not None and node.last_heartbeat_at and at <= node.last_heartbeat_at:
            continue  # a full report came after it
        if node is None or node.state != Node.State.READY:
            record_heartbeat(entry["payload"], received_at=at)
            continue
        previous = node.last_heartbeat_at
        for k, v in entry["fast"].items():
            setattr(node, k, v)
        node.last_heartbeat_at = at
        fast.append(node)
        items.append((node, entry["fast"]["reported_replicas"], previous, at))
    if fast:
        with transaction.atomic():
            relaxed_commit()
            bulk_update(Node, fast, FAST_FIELDS)
        for receiver, result in nodes_alive.send_robust(sender=Node, items=items):
            if isinstance(result, Exception):
                log.error("%s failed on %d heartbeats: %r", receiver, len(items), result)
    return len(entries)


def sweep_stale_nodes() -> list[str]:
    """Mark nodes unreachable when their heartbeats stopped and they do not answer a direct
    probe either; returns their names.

    Silence alone is not proof: when the web process or the database was out, heartbeats did
    not reach us although every agent serves on. A node whose agent answers GetStatus is
    refreshed from that answer (as a heartbeat would) and keeps everything it holds.
    """
    flush_heartbeats()  # what the web processes buffered is not silence
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
            pb.GetStatusRequest(),
            metadata=agent_client.metadata(),
            timeout=agent_client.STATUS_TIMEOUT,
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


#: A round of link measurements may run 15 minutes (its task's time limit).
LINK_JOB_LEASE_SECONDS = 900 + 120


def link_pairs(node_names: list[str] | None = None) -> list[tuple[Node, Node]]:
    """Which links to measure: every ordered pair of ready nodes up to LINK_SAMPLE + 1 of
    them, else LINK_SAMPLE random peers for each."""
    import random

    nodes = list(Node.objects.filter(state=Node.State.READY))
    if node_names:
        nodes = [n for n in nodes if n.name in set(node_names)]
    pairs = []
    for src in nodes:
        peers = [n for n in nodes if n.pk != src.pk]
        if len(peers) > LINK_SAMPLE:
            peers = random.sample(peers, LINK_SAMPLE)
        pairs.extend((src, dst) for dst in peers)
    return pairs


def _measure_pair(src: Node, dst: Node) -> None:
    """Have src's agent measure its link to dst, and store the result (a failure included:
    the planner then knows the path is not usable)."""
    import grpc
    from llamafleet.agent.v1 import agent_pb2 as pb

    from apps.nodes import agent_client
    from apps.nodes.models import NodeLink

    try:
        m = agent_client.stub(src.address).MeasureLink(
            pb.MeasureLinkRequest(target=dst.address),
            metadata=agent_client.metadata(),
            timeout=agent_client.START_TIMEOUT,
        )
        values = {"rtt_ms": m.rtt_ms, "mbit_s": m.mbit_s, "error": m.error}
        if m.error:
            values.update(rtt_ms=None, mbit_s=None)
    except grpc.RpcError as exc:
        why = f"{src.name}: {errors.describe(exc)}"
        values = {"rtt_ms": None, "mbit_s": None, "error": why}
    NodeLink.objects.update_or_create(
        source=src, target=dst, defaults={**values, "measured_at": timezone.now()}
    )


def measure_links(node_names: list[str] | None = None, on_pair=None) -> int:
    """Measure the links between ready nodes (see link_pairs) and store them; the planner
    reads them to choose heads and warn about slow links. on_pair(done, total) follows."""
    pairs = link_pairs(node_names)
    if on_pair is not None:
        on_pair(0, len(pairs))
    for i, (src, dst) in enumerate(pairs, 1):
        _measure_pair(src, dst)
        if on_pair is not None:
            on_pair(i, len(pairs))
    return len(pairs)


def start_link_job(node_names: list[str] | None = None):
    """Record a round of link measurements and send it to a worker once committed."""
    from apps.nodes.models import LinkJob
    from apps.nodes.tasks import measure_links as task

    with transaction.atomic():
        job = LinkJob.objects.create(nodes=list(node_names or []))
        task.delay_on_commit(job.pk)
    return job


def run_link_job(job_id: int):
    """Run a round of link measurements: claimed with a lease, its progress written per
    pair, and ended DONE or FAILED (with the reason) whatever happens on the way."""
    from apps.nodes.models import LinkJob

    if not LinkJob.claim(job_id, LINK_JOB_LEASE_SECONDS, phase="measuring"):
        return LinkJob.objects.get(pk=job_id)  # another worker has it, or it ran already
    job = LinkJob.objects.get(pk=job_id)

    def progress(done: int, total: int) -> None:
        LinkJob.objects.filter(pk=job_id).update(pairs_done=done, pairs_total=total)

    try:
        measure_links(job.nodes, on_pair=progress)
    except BaseException as exc:  # a soft time limit too: the job must not stay running
        LinkJob.end(job_id, error=f"{type(exc).__name__}: {exc}", phase="failed")
        if not isinstance(exc, Exception):
            raise
    else:
        LinkJob.end(job_id, phase="done")
    return LinkJob.objects.get(pk=job_id)
