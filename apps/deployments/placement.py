"""Between the database and the pure planner: cluster state in, stored plans out."""

from __future__ import annotations

import re
from collections import defaultdict

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q

from apps.catalog.models import CatalogModel
from apps.deployments import planner as P
from apps.deployments.models import Deployment, PlanStage, Replica, ShardPlan
from apps.nodes.models import Node, NodeLink

_MIB = re.compile(r"(\d+)\s*MiB", re.I)


def model_facts(model: CatalogModel) -> P.ModelFacts:
    """The planner's view of a catalog model."""
    fields = {
        f: getattr(model, f)
        for f in P.ModelFacts.__dataclass_fields__
        if f not in ("name", "file_bytes")
    }
    fields["bytes_per_layer"] = tuple(model.bytes_per_layer or ())
    if not fields["bytes_embeddings"]:  # pulled before these facts were read: approximate
        fields["bytes_embeddings"] = fields["bytes_output"] = model.bytes_outside_layers
    return P.ModelFacts(name=model.name, file_bytes=model.size_bytes, **fields)


def accelerator_bytes(node: Node) -> tuple[int, ...]:
    """Memory of each accelerator an agent reported ("name, 24576 MiB")."""
    found = (_MIB.search(str(a)) for a in node.accelerators or ())
    return tuple(int(m.group(1)) * 2**20 for m in found if m)


def cluster(deployment: Deployment | None = None) -> tuple[list[P.NodeState], dict]:
    """Every node with the memory it has free for new work, and the measured links.

    Free = what the agent reported available, less what is booked but not loaded yet
    (replicas pending or loading, and the rpc stages of split replicas not yet ready).
    """
    nodes = Node.objects.all()
    if deployment is not None:  # new replicas spread away from the ones it has
        nodes = nodes.annotate(
            holds=Count(
                "replicas",
                filter=Q(replicas__deployment=deployment, replicas__state__in=Replica.LIVE),
            )
        )
    booked: dict[int, int] = defaultdict(int)
    pending = Replica.objects.filter(
        state__in=[Replica.State.PENDING, Replica.State.LOADING], plan__isnull=False
    ).prefetch_related("plan__stages")
    for r in pending:
        stages = list(r.plan.stages.all())
        if r.plan.kind == ShardPlan.Kind.REPLICAS:
            booked[r.node_id] += stages[0].total_bytes if stages else 0
        else:
            for st in stages:
                booked[st.node_id] += st.total_bytes
    states = [
        P.NodeState(
            name=n.name,
            free_bytes=n.memory_available_bytes - booked[n.pk],
            ready=n.state == Node.State.READY,
            draining=n.draining,
            accelerator_bytes=accelerator_bytes(n),
            holds=getattr(n, "holds", 0),
            window_cache="swa-window" in (n.features or ()),
        )
        for n in nodes
    ]
    links = {
        (src, dst): P.Link(rtt, mbit)
        for src, dst, rtt, mbit in NodeLink.objects.filter(rtt_ms__isnull=False).values_list(
            "source__name", "target__name", "rtt_ms", "mbit_s"
        )
    }
    return states, links


def swa_window(batching: str, swa_cache: str) -> bool:
    """Whether sliding layers keep only the window, in whole replicas and splits alike (the
    invariant mode keeps the full cache whatever the deployment says)."""
    return batching == Deployment.Batching.THROUGHPUT and swa_cache == Deployment.SwaCache.WINDOW


def preview(
    model: CatalogModel,
    context_length: int,
    parallel: int,
    replicas: int = 1,
    split_mode: str = "auto",
    pin_nodes: list[str] | tuple[str, ...] = (),
    deployment: Deployment | None = None,
    batching: str = Deployment.Batching.THROUGHPUT,
    swa_cache: str = Deployment.SwaCache.WINDOW,
) -> P.Plan:
    """What the planner would do now; nothing is stored."""
    nodes, links = cluster(deployment)
    request = P.Request(
        context_length=context_length,
        parallel=parallel,
        replicas=replicas,
        split_mode=split_mode,
        pin_nodes=tuple(pin_nodes or ()),
        swa_window=swa_window(batching, swa_cache),
    )
    return P.plan(model_facts(model), request, nodes, links)


def plan_for(d: Deployment, count: int) -> P.Plan:
    """Where `count` more replicas (or copies of a split) of a deployment would go now. Nodes
    that already hold a part of one of its splits are left out: copies do not overlap."""
    taken = set(
        PlanStage.objects.filter(
            plan__deployment=d,
            plan__kind=ShardPlan.Kind.SPLIT,
            plan__replicas__state__in=(*Replica.LIVE, Replica.State.UNREACHABLE),
        ).values_list("node_name", flat=True)
    )
    nodes, links = cluster(d)
    pins = [n for n in d.pin_nodes if n not in taken]
    request = P.Request(
        context_length=d.context_length,
        parallel=d.parallel,
        replicas=count,
        split_mode=d.split_mode,
        pin_nodes=tuple(pins),
        swa_window=swa_window(d.batching, d.swa_cache),
    )
    if d.pin_nodes and not pins:
        return P.Plan("refused", error="every pinned node already holds a copy of this split")
    usable = [n for n in nodes if n.name not in taken]
    return P.plan(model_facts(d.model), request, usable, links)


@transaction.atomic
def save(d: Deployment, plan: P.Plan) -> ShardPlan:
    """Store a plan with its stages; stages of a split get their rpc ports here."""
    nodes = {n.name: n for n in Node.objects.filter(name__in=[s.node for s in plan.stages])}
    plan_fields = plan.as_dict()
    stages = plan_fields.pop("stages")
    plan_fields.pop("error")  # a stored plan is never a refusal
    plan_fields.pop("copies")  # each copy is stored as a plan of its own
    plan_fields.pop("short")  # also among the warnings
    sp = ShardPlan.objects.create(deployment=d, **plan_fields)
    for i, fields in enumerate(stages):
        node = nodes[fields.pop("node")]
        stage = fields["role"] == PlanStage.Role.STAGE
        PlanStage.objects.create(
            plan=sp,
            position=i,
            node=node,
            node_name=node.name,
            rpc_port=free_rpc_port(node) if stage else None,
            **fields,
        )
    return sp


def free_rpc_port(node: Node) -> int:
    """The lowest rpc port no live split replica uses on this node's host (agents that share
    a machine share its ports)."""
    host = node.address.rsplit(":", 1)[0]
    same_host = Node.objects.filter(Q(pk=node.pk) | Q(address__startswith=f"{host}:"))
    used = set(
        PlanStage.objects.filter(
            node__in=same_host, rpc_port__isnull=False, plan__replicas__state__in=Replica.LIVE
        ).values_list("rpc_port", flat=True)
    )
    port = settings.RPC_PORT_BASE
    while port in used:
        port += 1
    return port


#: Nodes drawn beside a refused plan: the roomiest ready ones (where the memory was short).
DRAWN_FOR_REFUSAL = 12


def drawing(plan: dict) -> dict:
    """What a picture of a plan needs besides the plan: each node's memory (free for new work
    as the planner counts it, and in all) and the measured links between its nodes, slow
    ones marked. A refused plan gets the roomiest ready nodes, to show what was missing."""
    nodes, links = cluster()
    names = {s["node"] for p in (plan, *plan.get("copies", ())) for s in p["stages"]}
    if not names:
        ready = [n for n in nodes if n.ready and not n.draining]
        ready.sort(key=lambda n: -P.room_of(n))
        names = {n.name for n in ready[:DRAWN_FOR_REFUSAL]}
    total = dict(Node.objects.filter(name__in=names).values_list("name", "memory_total_bytes"))
    return {
        "nodes": [
            {
                "name": n.name,
                "free_bytes": max(P.room_of(n), 0),
                "memory_total_bytes": total.get(n.name, 0),
                "ready": n.ready and not n.draining,
            }
            for n in nodes
            if n.name in names
        ],
        "links": link_rows(names, links),
    }


def link_rows(names: set[str], links: dict | None = None) -> list[dict]:
    """Measured links between the named nodes, as the console draws them."""
    if links is None:
        links = {
            (src, dst): P.Link(rtt, mbit)
            for src, dst, rtt, mbit in NodeLink.objects.filter(
                rtt_ms__isnull=False, source__name__in=names, target__name__in=names
            ).values_list("source__name", "target__name", "rtt_ms", "mbit_s")
        }
    return [
        {"source": a, "target": b, "rtt_ms": lk.rtt_ms, "mbit_s": lk.mbit_s, "slow": P.is_slow(lk)}
        for (a, b), lk in sorted(links.items())
        if a in names and b in names
    ]
