"""Deployments: validate and record desired state, then reconcile replicas towards it.

check_* validate, do_* write; every write that needs an agent enqueues a task after the
transaction commits. Tasks claim their work with a conditional UPDATE, so a task that runs
twice (acks_late, a lost worker) does nothing the second time.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

import grpc
from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from apps.catalog.models import CatalogModel
from apps.catalog.services import agent_files
from apps.deployments import placement
from apps.deployments.models import Deployment, DeploymentEvent, PlanStage, Replica, ShardPlan
from apps.nodes import agent_client
from apps.nodes.models import Node
from controlplane.errors import Conflict, DomainError, NotFound

log = logging.getLogger(__name__)
S = Replica.State
D = Deployment.State

#: How long a LoadModel call may take (download included).
LOAD_TIMEOUT_SECONDS = 900
#: Restarts of failed replicas wait 10 s, then twice as long each time up to 5 minutes, as the
#: kubelet's back-off does; after 3 the deployment shows as a crash loop, and 10 minutes
#: without a failure start the count again.
RESTART_FIRST_DELAY, RESTART_MAX_DELAY = 10, 300
CRASH_LOOP_AFTER = 3
STEADY_SECONDS = 600


def record_event(deployment: Deployment, message: str, level: str = "info", replica=None) -> None:
    DeploymentEvent.objects.create(
        deployment=deployment, replica=replica, level=level, message=message
    )
    (log.warning if level != "info" else log.info)("%s: %s", deployment.name, message)


# ---- desired state ---------------------------------------------------------------------


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
    if not 16 <= context_length <= 1 << 20 or not 1 <= parallel <= 256:
        raise DomainError("context_length must be 16..1048576 and parallel 1..256")
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
        transaction.on_commit(lambda: reconcile_deployment.delay(d.pk))
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
        transaction.on_commit(lambda: reconcile_deployment.delay(d.pk))
    d.refresh_from_db()
    return d


def do_undeploy(d: Deployment) -> Deployment:
    """Stop every replica and free its memory; the row stays, as stopped."""
    from apps.deployments.tasks import reconcile_deployment

    with transaction.atomic():
        Deployment.objects.filter(pk=d.pk).update(state=D.STOPPING, error="")
        record_event(d, "undeploy requested")
        transaction.on_commit(lambda: reconcile_deployment.delay(d.pk))
    d.refresh_from_db()
    return d


def do_redeploy(d: Deployment) -> Deployment:
    """Replace failed replicas (or start a stopped deployment again)."""
    from apps.deployments.tasks import reconcile_deployment

    if not CatalogModel.objects.filter(pk=d.model_id, state=CatalogModel.State.READY).exists():
        raise Conflict(f"model {d.model.name} is not ready")
    with transaction.atomic():
        n = _retire_failed(d)
        Deployment.objects.filter(pk=d.pk).update(
            state=D.PENDING, error="", restarts=0, next_restart_at=None
        )
        record_event(d, f"redeploy requested ({n} failed replica(s) replaced)")
        transaction.on_commit(lambda: reconcile_deployment.delay(d.pk))
    d.refresh_from_db()
    return d


def do_delete(d: Deployment) -> None:
    if d.replica_set.exclude(state=S.STOPPED).exists():
        raise Conflict(f"{d.name} still holds replicas; undeploy it first")
    d.delete()


# ---- reconciling -----------------------------------------------------------------------


def reconcile(deployment_id: int) -> None:
    """Bring a deployment's replicas towards its desired state (safe to run any time)."""
    from apps.deployments.tasks import free_replica, load_replica

    with transaction.atomic():
        d = Deployment.objects.select_for_update().select_related("model").get(pk=deployment_id)
        if d.state in (D.STOPPING, D.STOPPED):
            to_stop = list(d.replica_set.filter(state__in=Replica.LIVE + (S.UNREACHABLE, S.FAILED)))
            Replica.objects.filter(pk__in=[r.pk for r in to_stop]).update(state=S.STOPPING)
            for r in to_stop:
                transaction.on_commit(lambda r=r: free_replica.delay(str(r.pk)))
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
            why = plan.error or "; ".join(w for w in plan.warnings if "fit now" in w)
            # Replicas share one plan (a head each); each copy of a split has its own.
            for copy in plan.each_copy() if plan.kind != "refused" else ():
                stored = placement.save(d, copy)
                heads = [s for s in stored.stages.select_related("node") if s.role != "stage"]
                for st in heads:
                    r = Replica.objects.create(deployment=d, node=st.node, plan=stored)
                    record_event(d, _placed(stored, st), replica=r)
                    for w in copy.warnings:
                        record_event(d, f"plan: {w}", level="warning", replica=r)
                    transaction.on_commit(lambda r=r: load_replica.delay(str(r.pk)))
            if why and why != d.error:
                record_event(d, f"waiting for capacity: {why}", level="warning")
            Deployment.objects.filter(pk=d.pk).update(error=why and f"waiting for capacity: {why}")
        elif missing < 0:
            # Drop the least useful first: failed, then not yet ready, then the newest.
            rank = {S.FAILED: 0, S.UNREACHABLE: 1, S.PENDING: 2, S.LOADING: 3, S.READY: 4}
            extra = sorted(current, key=lambda r: (rank[r.state], -r.created_at.timestamp()))[
                :-missing
            ]
            Replica.objects.filter(pk__in=[r.pk for r in extra]).update(state=S.STOPPING)
            for r in extra:
                transaction.on_commit(lambda r=r: free_replica.delay(str(r.pk)))
        d.refresh_from_db()
        refresh_state(d)


#: A pending replica whose load task never ran (the broker was down when it was sent) is sent
#: again after this long.
RESEND_AFTER_SECONDS = 120


def expire_leases() -> dict:
    """Loads whose worker died holding the claim fail with that reason (and are replaced
    under the restart policy); loads never picked up are sent again."""
    from apps.deployments.tasks import free_on_node, load_replica

    now = timezone.now()
    lost = list(
        Replica.objects.filter(state=S.LOADING, lease_expires_at__lt=now).select_related(
            "node", "plan"
        )
    )
    for r in lost:
        why = "the load did not finish within its lease (the worker running it stopped?)"
        if fail_replica(r, why, from_states=(S.LOADING,)):
            transaction.on_commit(lambda r=r: free_on_node.delay(r.node_id, str(r.pk)))
    stale = list(
        Replica.objects.filter(
            state=S.PENDING, created_at__lt=now - timedelta(seconds=RESEND_AFTER_SECONDS)
        ).values_list("pk", flat=True)
    )
    for pk in stale:
        load_replica.delay(str(pk))  # the claim makes a second delivery harmless
    return {"lost": len(lost), "resent": len(stale)}


def _retire_failed(d: Deployment) -> int:
    """Failed replicas give up their place (stopped here, forgotten on their node)."""
    from apps.deployments.tasks import free_on_node

    failed = list(d.replica_set.filter(state=S.FAILED).select_related("node"))
    Replica.objects.filter(pk__in=[r.pk for r in failed]).update(state=S.STOPPED)
    for r in failed:
        # The agent may still hold the dead engine's record: clear it there too.
        transaction.on_commit(lambda r=r: free_on_node.delay(r.node_id, str(r.pk)))
    return len(failed)


def _heal(d: Deployment) -> None:
    """Under the restart policy "always": replace failed replicas once their back-off is
    over, and forget past failures after a steady stretch. Called under the row lock."""
    if d.restart_policy != Deployment.Restart.ALWAYS:
        return
    now = timezone.now()
    if d.next_restart_at and d.next_restart_at <= now:
        n = _retire_failed(d)
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
    transaction.on_commit(lambda: reconcile_deployment.apply_async((d.pk,), countdown=delay))


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
            transaction.on_commit(lambda: stop_replica_stages.delay(str(replica.pk)))
    return bool(changed)


class StageError(Exception):
    """A split could not come up; the message names the node and why."""


def load(replica_id: str) -> None:
    """Ask the replica's node to load it (with its rpc stages first, for a split); record
    the outcome. A split that fails anywhere is rolled back whole."""
    from llamafleet.agent.v1 import agent_pb2 as pb

    from apps.deployments.tasks import free_replica

    claimed = Replica.objects.filter(pk=replica_id, state=S.PENDING).update(
        state=S.LOADING,
        lease_expires_at=timezone.now() + timedelta(seconds=LOAD_TIMEOUT_SECONDS + 120),
    )
    if not claimed:
        return  # another worker got there first, or it was stopped meanwhile
    r = Replica.objects.select_related("deployment__model", "node", "plan").get(pk=replica_id)
    d, model, node = r.deployment, r.deployment.model, r.node
    split = r.plan is not None and r.plan.kind == ShardPlan.Kind.SPLIT
    record_event(d, f"loading {model.name} on {node.name}", replica=r)
    refresh_state(d)
    request = pb.LoadModelRequest(
        replica_id=str(r.pk),
        model_name=model.name,
        sha256=model.sha256,
        size_bytes=model.size_bytes,
        files=agent_files(model),
        context_length=d.context_length,
        parallel=d.parallel,
        chat_template=model.chat_template,
        batch_invariant=d.batching == Deployment.Batching.INVARIANT,
    )
    if r.plan is not None and not split:
        # Layers the planner put on this node's accelerators (0: none reported).
        mine = r.plan.stages.filter(node=node).first()
        request.n_gpu_layers = mine.n_gpu_layers if mine else 0
    if split:
        try:
            endpoints = start_stages(r)
        except StageError as exc:
            stop_stages(r)
            fail_replica(r, f"split not started, rolled back: {exc}")
            return
        request.rpc_servers.extend(endpoints)
        request.n_gpu_layers = r.plan.n_gpu_layers
        request.split_mode = 3 if r.plan.split_mode == "tensor" else 1
        request.tensor_split.extend(r.plan.tensor_split)
    try:
        resp = agent_client.stub(node.address).LoadModel(
            request, metadata=agent_client.metadata(), timeout=LOAD_TIMEOUT_SECONDS
        )
        error = (
            ""
            if resp.state == pb.REPLICA_STATE_READY
            else (
                f"loading on {node.name} failed: {resp.error or pb.ReplicaState.Name(resp.state)}"
            )
        )
    except grpc.RpcError as exc:
        error = f"node {node.name} ({node.address}) did not load it: {exc.details() or exc.code()}"
    if not error and split:
        error = probe(r)
    if error:
        if split:
            # Diagnose first: once stopped, every stage would look dead.
            error = f"split rolled back: {error}" + diagnose_stages(r)
            free_remote(node, str(r.pk))
            stop_stages(r)
        fail_replica(r, error)
        return
    became_ready = Replica.objects.filter(pk=r.pk, state=S.LOADING).update(
        state=S.READY,
        error="",
        memory_bytes=resp.memory_bytes,
        load_seconds=resp.load_seconds,
        updated_at=timezone.now(),
    )
    if not became_ready:
        # Undeployed or scaled down while loading: do not leave the memory held.
        free_replica.delay(str(r.pk))
        return
    what = f"split over {1 + len(request.rpc_servers)} nodes, probed" if split else "replica"
    record_event(
        d,
        f"{what} on {node.name} ready in {resp.load_seconds:.1f} s "
        f"({resp.memory_bytes / 2**20:.0f} MiB)",
        replica=r,
    )
    refresh_state(Deployment.objects.get(pk=d.pk))


def start_stages(r: Replica) -> list[str]:
    """Start the rpc server of every stage, then have the head check each one (reachable
    from there, same protocol version, memory enough). Returns the endpoints in order."""
    from llamafleet.agent.v1 import agent_pb2 as pb

    stages = list(r.plan.stages.filter(role=PlanStage.Role.STAGE).select_related("node"))
    for st in stages:
        node = st.node
        if node is None or node.state != Node.State.READY:
            raise StageError(f"stage node {st.node_name} is not ready")
        status = _start_rpc_server(st)
        PlanStage.objects.filter(pk=st.pk).update(endpoint=status.endpoint, rpc_port=st.rpc_port)
        st.endpoint = status.endpoint
        record_event(r.deployment, f"rpc server up on {node.name} at {status.endpoint}", replica=r)
    try:
        checks = (
            agent_client.stub(r.node.address)
            .CheckRpcServers(
                pb.CheckRpcServersRequest(endpoints=[st.endpoint for st in stages]),
                metadata=agent_client.metadata(),
                timeout=60,
            )
            .servers
        )
    except grpc.RpcError as exc:
        raise StageError(f"head {r.node.name} did not check its stages: {exc.details()}") from exc
    for st, check in zip(stages, checks, strict=True):
        if not check.ok:
            raise StageError(f"head {r.node.name} cannot use stage {st.node_name}: {check.error}")
        need = st.total_bytes - st.overhead_bytes
        if check.free_bytes and check.free_bytes < need:
            raise StageError(
                f"stage {st.node_name} has {check.free_bytes / 2**30:.2f} GiB free, its part "
                f"needs {need / 2**30:.2f} GiB"
            )
    return [st.endpoint for st in stages]


#: Ports tried, from the planned one up, when something else holds a stage's rpc port.
RPC_PORT_TRIES = 5


def _start_rpc_server(st: PlanStage):
    """StartRpcServer on a stage's node, moving up past ports something else holds."""
    from llamafleet.agent.v1 import agent_pb2 as pb

    for attempt in range(RPC_PORT_TRIES):
        try:
            return agent_client.stub(st.node.address).StartRpcServer(
                pb.StartRpcServerRequest(port=st.rpc_port),
                metadata=agent_client.metadata(),
                timeout=60,
            )
        except grpc.RpcError as exc:
            why = exc.details() or str(exc.code())
            if "already in use" in why and attempt < RPC_PORT_TRIES - 1:
                st.rpc_port += 1
                continue
            raise StageError(
                f"stage node {st.node_name} could not start an rpc server on port "
                f"{st.rpc_port}: {why}"
            ) from exc


def stop_stages(r: Replica) -> list[str]:
    """Stop the rpc servers of a split replica's stages; returns what could not be reached."""
    from llamafleet.agent.v1 import agent_pb2 as pb

    if r.plan is None or r.plan.kind != ShardPlan.Kind.SPLIT:
        return []
    missed = []
    for st in r.plan.stages.filter(role=PlanStage.Role.STAGE).select_related("node"):
        if st.node is None or not st.rpc_port:
            continue
        try:
            agent_client.stub(st.node.address).StopRpcServer(
                pb.StopRpcServerRequest(port=st.rpc_port),
                metadata=agent_client.metadata(),
                timeout=30,
            )
        except grpc.RpcError as exc:
            missed.append(f"{st.node_name}: {exc.details() or exc.code()}")
    return missed


def probe(r: Replica) -> str:
    """One greedy token through the whole split: "" when it serves, else why not."""
    from llamafleet.agent.v1 import agent_pb2 as pb

    request = pb.InferenceRequest(
        replica_id=str(r.pk), prompt="Hello", max_tokens=1, sampling=pb.SamplingParams()
    )
    try:
        got = list(
            agent_client.stub(r.node.address).RunInference(
                request, metadata=agent_client.metadata(), timeout=120
            )
        )
    except grpc.RpcError as exc:
        return f"the one-token probe on head {r.node.name} failed: {exc.details() or exc.code()}"
    if not got or got[-1].usage.completion_tokens < 1:
        return f"the one-token probe on head {r.node.name} produced no token"
    return ""


def diagnose_stages(r: Replica) -> str:
    """When a split fails, say which stage does not answer (a TCP connect to each)."""
    import socket

    if r.plan is None or r.plan.kind != ShardPlan.Kind.SPLIT:
        return ""
    gone = []
    for st in r.plan.stages.filter(role=PlanStage.Role.STAGE).exclude(endpoint=""):
        host, _, port = st.endpoint.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                pass
        except OSError as exc:
            layers = (
                f"layers {st.layer_start}-{st.layer_end - 1}, "
                if r.plan.split_mode == "layer"
                else ""
            )
            gone.append(
                f"stage {st.node_name} ({layers}{st.endpoint}) does not answer: "
                f"{exc.strerror or exc}"
            )
    return ("; " + "; ".join(gone)) if gone else ""


def free(replica_id: str) -> None:
    """Ask the replica's node to free it, then mark it stopped."""
    r = Replica.objects.select_related("node", "deployment", "plan").filter(pk=replica_id).first()
    if r is None or r.state == S.STOPPED:
        return
    Replica.objects.filter(pk=r.pk).update(state=S.STOPPING)
    error = free_remote(r.node, str(r.pk))
    missed = stop_stages(r)
    Replica.objects.filter(pk=r.pk, state=S.STOPPING).update(state=S.STOPPED)
    msg = f"replica on {r.node.name} stopped" + (f" (agent not reached: {error})" if error else "")
    if r.plan is not None and r.plan.kind == ShardPlan.Kind.SPLIT:
        msg += ", rpc stages stopped" + (f" except {'; '.join(missed)}" if missed else "")
    record_event(r.deployment, msg, level="warning" if error else "info", replica=r)
    refresh_state(Deployment.objects.get(pk=r.deployment_id))


def free_remote(node: Node, replica_id: str) -> str:
    """FreeMemory on a node; returns "" or why it could not be reached."""
    from llamafleet.agent.v1 import agent_pb2 as pb

    try:
        agent_client.stub(node.address).FreeMemory(
            pb.FreeMemoryRequest(replica_id=replica_id),
            metadata=agent_client.metadata(),
            timeout=30,
        )
    except grpc.RpcError as exc:
        return exc.details() or str(exc.code())
    return ""


#: How long a ready replica may be missing from its node's reports before it counts as gone
#: (reports are snapshots that can arrive late: built, queued, buffered, flushed).
REPORT_GRACE_SECONDS = 10


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
        elif seen["state"] == "failed":
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
        if replica_id not in wanted and seen["state"] != "stopping":
            transaction.on_commit(lambda rid=replica_id: free_on_node.delay(node.pk, rid))
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
            state == S.READY and (seen is None or seen["state"] != "ready")
        ):
            return False
    wanted = {rid for rid, (state, _) in ours.items() if state != S.STOPPING}
    if any(rid not in wanted and seen["state"] != "stopping" for rid, seen in by_id.items()):
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
        if seen is None or seen["state"] != "ready":
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
