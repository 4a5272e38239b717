"""Ready replicas per model, cached in each web process so that routing needs no query.

An entry lives ROUTING_CACHE_SECONDS at most. A change in this process to what routing
reads (a replica's or deployment's state, a node's state, drain or address, a routing
policy) drops every entry at once, through signals, bulk updates included; other processes
see a change within that time. Heartbeats, which save nodes every few seconds, do not
clear it: a node that comes back has lost its replicas, and their changes do.

A replica that went away meanwhile is skipped like any failed replica (the request goes to
the next one), and an empty answer is never cached, so a deployment that just became ready
is served at once.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.db import DatabaseError
from django.db.models.signals import post_delete, post_save

from controlplane.db import database_unreachable, mark_unreachable

_cache: dict[str, tuple[float, list[tuple]]] = {}


async def ready_rows(model_name: str) -> list[tuple]:
    """(replica id, node name, node address, deployment name, routing policy, slots) per
    ready replica on a ready, open node serving the model, ordered by replica id."""
    hit = _cache.get(model_name)
    now = time.monotonic()
    if hit is not None and now - hit[0] < settings.ROUTING_CACHE_SECONDS:
        return hit[1]
    # The database is away (a restart, a failover): route by what was last seen.
    stale_ok = hit is not None and now - hit[0] < STALE_IF_ERROR_SECONDS
    if stale_ok and database_unreachable():
        return hit[1]
    try:
        rows = await _query(model_name)
    except DatabaseError:
        mark_unreachable()
        if stale_ok:
            return hit[1]
        raise
    if rows:
        _cache[model_name] = (now, rows)
    else:
        _cache.pop(model_name, None)
    return rows


#: How long a cached entry still routes while the database does not answer.
STALE_IF_ERROR_SECONDS = 600.0


async def _query(model_name: str) -> list[tuple]:
    from apps.deployments.models import Deployment, Replica
    from apps.nodes.models import Node

    return [
        (str(pk), node, address, dep, policy, slots)
        async for pk, node, address, dep, policy, slots in Replica.objects.filter(
            state=Replica.State.READY,
            node__state=Node.State.READY,
            node__draining=False,
            deployment__model__name=model_name,
            deployment__state__in=[Deployment.State.READY, Deployment.State.DEGRADED],
        )
        .order_by("pk")
        .values_list(
            "pk",
            "node__name",
            "node__address",
            "deployment__name",
            "deployment__routing_policy",
            "deployment__parallel",
        )
    ]


#: Fields whose change can change a routing decision.
ROUTED_FIELDS = frozenset({"state", "draining", "address", "routing_policy", "deployment"})


def invalidate(**_kwargs) -> None:
    """Forget every cached table."""
    _cache.clear()


def _on_save(update_fields=None, **_kwargs) -> None:
    if update_fields is None or ROUTED_FIELDS & set(update_fields):
        _cache.clear()


def _on_update(fields=frozenset(), **_kwargs) -> None:
    if ROUTED_FIELDS & fields:
        _cache.clear()


def connect_signals() -> None:
    from apps.deployments.models import Deployment, Replica
    from apps.nodes.models import Node
    from controlplane.querysets import rows_updated

    for sender in (Replica, Node, Deployment):
        uid = f"routing-{sender.__name__}"
        if sender is not Node:  # see the module docstring
            post_save.connect(_on_save, sender=sender, dispatch_uid=uid)
        post_delete.connect(invalidate, sender=sender, dispatch_uid=uid)
        rows_updated.connect(_on_update, sender=sender, dispatch_uid=uid)
