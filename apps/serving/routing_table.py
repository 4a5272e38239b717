"""Ready replicas per model, cached in each web process so that routing needs no query.

An entry is fresh for ROUTING_CACHE_SECONDS. A change in this process to what routing
reads (a replica's or deployment's state, a node's state, drain or address, a routing
policy) drops every entry at once, through signals, bulk updates included; other processes
see a change within that time while requests keep coming. Heartbeats, which save nodes
every few seconds, do not clear it: a node that comes back has lost its replicas, and
their changes do.

Past that, an entry still routes for up to ROUTING_STALE_SECONDS while one query in the
background reads the table again (stale while revalidate): a request after a quiet spell,
which is every request of a lone user chatting, does not wait for the database (a thread
hop and a query, 2-3 ms of its time to first token here). An older entry is read again
before routing.

A replica that went away meanwhile is skipped like any failed replica (the request goes to
the next one, and when every one it knew of failed, to those of a table read afresh; see
services._first_that_answers), and an empty answer is never cached, so a deployment that
just became ready is served at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

from django.conf import settings
from django.db import DatabaseError
from django.db.models.signals import post_delete, post_save

from controlplane.db import database_unreachable, in_pool_thread, mark_unreachable

log = logging.getLogger(__name__)

_cache: dict[str, tuple[float, list[tuple]]] = {}
#: Counts invalidations: a read that began before one must not store what it read.
_generation = 0
#: Background reads in flight, by model (strong references: the loop keeps only weak ones).
_refreshing: dict[str, asyncio.Task] = {}
#: The clock entries are dated by (tests move it).
_now = time.monotonic

#: How long past ROUTING_CACHE_SECONDS an entry still routes while a background read
#: brings it up to date.
ROUTING_STALE_SECONDS = 30.0
#: How long a cached entry still routes while the database does not answer.
STALE_IF_ERROR_SECONDS = 600.0


async def ready_rows(model_name: str, fresh: bool = False) -> list[tuple]:
    """(replica id, node name, node address, deployment name, routing policy, slots) per
    ready replica on a ready, open node serving the model, ordered by replica id; fresh:
    read the database whatever the cache holds."""
    hit = _cache.get(model_name)
    now = _now()
    age = now - hit[0] if hit is not None else float("inf")
    if not fresh:
        if age < settings.ROUTING_CACHE_SECONDS:
            return hit[1]
        if age < settings.ROUTING_CACHE_SECONDS + ROUTING_STALE_SECONDS:
            _refresh_soon(model_name)
            return hit[1]
    # The database is away (a restart, a failover): route by what was last seen.
    stale_ok = age < STALE_IF_ERROR_SECONDS
    if stale_ok and database_unreachable():
        return hit[1]
    try:
        return await _read(model_name)
    except DatabaseError:
        mark_unreachable()
        if stale_ok:
            return hit[1]
        raise


async def _read(model_name: str) -> list[tuple]:
    """Query the table and cache what it says, unless it changed while the query ran."""
    generation, began = _generation, _now()
    rows = await _query(model_name)
    if generation == _generation:
        if rows:
            _cache[model_name] = (began, rows)
        else:
            _cache.pop(model_name, None)
    return rows


def _refresh_soon(model_name: str) -> None:
    """Read the model's table in the background, once however many requests ask."""
    loop = asyncio.get_running_loop()
    running = _refreshing.get(model_name)
    if running is not None and not running.done() and running.get_loop() is loop:
        return

    async def refresh():
        try:
            await _read(model_name)
        except DatabaseError as exc:
            mark_unreachable()
            log.warning("routing table for %s not refreshed: %s", model_name, exc)
        finally:
            if _refreshing.get(model_name) is asyncio.current_task():
                del _refreshing[model_name]

    _refreshing[model_name] = loop.create_task(refresh())


@in_pool_thread
def _query(model_name: str) -> list[tuple]:
    """The table as the database has it. In a pool thread (controlplane.db.in_pool_thread),
    not through the async ORM: that hops to the request's own thread, which asgiref starts
    for it, and opens a connection there, while the request's prompt is being evaluated."""
    from apps.deployments.models import Deployment, Replica
    from apps.nodes.models import Node

    return [
        (str(pk), node, address, dep, policy, slots)
        for pk, node, address, dep, policy, slots in Replica.objects.filter(
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
    """Forget every cached table (and what reads under way would store)."""
    global _generation
    _generation += 1
    _cache.clear()


def _on_save(update_fields=None, **_kwargs) -> None:
    if update_fields is None or ROUTED_FIELDS & set(update_fields):
        invalidate()


def _on_update(fields=frozenset(), **_kwargs) -> None:
    if ROUTED_FIELDS & fields:
        invalidate()


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
