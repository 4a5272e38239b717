"""Desired state: check_* validate, do_* write, and every write that needs an agent enqueues
a task once the transaction commits (the tasks then reconcile)."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from apps.catalog.models import CatalogModel
from apps.deployments.models import Deployment, Replica
from apps.deployments.services.events import record_event
from apps.deployments.services.reconciling import retire_failed
from apps.nodes.models import Node
from controlplane.errors import Conflict, DomainError, NotFound

S = Replica.State
D = Deployment.State


def check_create(
    name: str,
    model_name: str,
    replicas: int,
    context_length: int | None,
    parallel: int | None,
    split_mode: str = Deployment.SplitMode.AUTO,
    pin_nodes: list[str] | None = None,
) -> tuple[CatalogModel, int, int]:
    model = CatalogModel.objects.filter(name=model_name).first()
    if model is None:
        raise NotFound(f"unknown model {model_name!r}; pull it first")
    if model.state != CatalogModel.State.READY:
        raise Conflict(f"model {model_name} is {model.state}, not ready")
    if Deployment.objects.filter(name=name).exists():
        raise Conflict(f"a deployment named {name!r} exists")
    if not 1 <= replicas <= Deployment.MAX_REPLICAS:
        raise DomainError(f"replicas must be between 1 and {Deployment.MAX_REPLICAS}")
    context_length = context_length or min(
        settings.DEFAULT_CONTEXT_LENGTH, model.context_length or 10**9
    )
    parallel = parallel or settings.DEFAULT_PARALLEL
    if model.context_length and context_length > model.context_length:
        raise DomainError(
            f"context_length {context_length} is above what {model_name} was trained for "
            f"({model.context_length})"
        )
    lo, hi, slots = Deployment.MIN_CONTEXT, Deployment.MAX_CONTEXT, Deployment.MAX_PARALLEL
    if not lo <= context_length <= hi or not 1 <= parallel <= slots:
        raise DomainError(f"context_length must be {lo}..{hi} and parallel 1..{slots}")
    if split_mode not in Deployment.SplitMode.values:
        raise DomainError(f"split_mode must be one of {', '.join(Deployment.SplitMode.values)}")
    unknown = set(pin_nodes or ()) - set(Node.objects.values_list("name", flat=True))
    if unknown:
        raise DomainError(f"unknown node(s) to pin: {', '.join(sorted(unknown))}")
    return model, context_length, parallel


def do_create(
    name: str,
    model_name: str,
    replicas: int = 1,
    context_length: int | None = None,
    parallel: int | None = None,
    routing_policy: str | None = None,
    batching: str = Deployment.Batching.THROUGHPUT,
    swa_cache: str = Deployment.SwaCache.WINDOW,
    split_mode: str = Deployment.SplitMode.AUTO,
    pin_nodes: list[str] | None = None,
    restart_policy: str = Deployment.Restart.ALWAYS,
) -> Deployment:
    """Record a deployment and start reconciling it."""
    from apps.deployments.tasks import reconcile_deployment

    with transaction.atomic():
        model, context_length, parallel = check_create(
            name, model_name, replicas, context_length, parallel, split_mode, pin_nodes
        )
        if not routing_policy:
            # Chat clients resend their history: send them where it is cached.
            chat = model.has_chat_template or bool(model.chat_template)
            routing_policy = (
                Deployment.Routing.PREFIX if chat else Deployment.Routing.LEAST_CONNECTIONS
            )
        d = Deployment.objects.create(
            name=name,
            model=model,
            replicas=replicas,
            context_length=context_length,
            parallel=parallel,
            routing_policy=routing_policy,
            batching=batching,
            swa_cache=swa_cache,
            split_mode=split_mode,
            pin_nodes=list(pin_nodes or []),
            restart_policy=restart_policy,
        )
        record_event(
            d,
            f"created: {model.name}, {replicas} replica(s), "
            f"context {context_length} x {parallel} slots, split mode {split_mode}"
            + (f", pinned to {', '.join(pin_nodes)}" if pin_nodes else ""),
        )
        reconcile_deployment.delay_on_commit(d.pk)
    return d


def do_scale(d: Deployment, replicas: int) -> Deployment:
    from apps.deployments.tasks import reconcile_deployment

    if not 1 <= replicas <= Deployment.MAX_REPLICAS:
        raise DomainError(f"replicas must be between 1 and {Deployment.MAX_REPLICAS}")
    policy = getattr(d, "autoscaling", None)
    if policy is not None and policy.mode == policy.Mode.ON:
        raise Conflict(
            f"the autoscaler sets the replicas of {d.name} ({policy.min_replicas}.."
            f"{policy.max_replicas}): change its bounds, or set its mode to off or shadow"
        )
    if d.state in (D.STOPPING, D.STOPPED):
        raise Conflict(f"{d.name} is {d.state}; redeploy it first")
    with transaction.atomic():
        Deployment.objects.filter(pk=d.pk).update(replicas=replicas)
        record_event(d, f"scaled to {replicas} replica(s)")
        reconcile_deployment.delay_on_commit(d.pk)
    d.refresh_from_db()
    return d


def do_undeploy(d: Deployment) -> Deployment:
    """Stop every replica and free its memory; the row stays, as stopped."""
    from apps.deployments.tasks import reconcile_deployment

    with transaction.atomic():
        Deployment.objects.filter(pk=d.pk).update(state=D.STOPPING, error="")
        record_event(d, "undeploy requested")
        reconcile_deployment.delay_on_commit(d.pk)
    d.refresh_from_db()
    return d


def do_redeploy(d: Deployment) -> Deployment:
    """Replace failed replicas (or start a stopped deployment again)."""
    from apps.deployments.tasks import reconcile_deployment

    if not CatalogModel.objects.filter(pk=d.model_id, state=CatalogModel.State.READY).exists():
        raise Conflict(f"model {d.model.name} is not ready")
    with transaction.atomic():
        n = retire_failed(d)
        Deployment.objects.filter(pk=d.pk).update(
            state=D.PENDING, error="", restarts=0, next_restart_at=None
        )
        record_event(d, f"redeploy requested ({n} failed replica(s) replaced)")
        reconcile_deployment.delay_on_commit(d.pk)
    d.refresh_from_db()
    return d


def do_delete(d: Deployment) -> None:
    if d.replica_set.exclude(state=S.STOPPED).exists():
        raise Conflict(f"{d.name} still holds replicas; undeploy it first")
    d.delete()
