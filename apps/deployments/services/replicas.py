"""Replicas on agents: load one (its split's stages first), free one."""

from __future__ import annotations

from datetime import timedelta

import grpc
from django.utils import timezone

from apps.catalog.services import agent_files
from apps.deployments import placement
from apps.deployments.models import Deployment, Replica, ShardPlan
from apps.deployments.services.events import record_event
from apps.deployments.services.reconciling import fail_replica, refresh_state, stopping
from apps.deployments.services.splits import (
    StageError,
    diagnose_stages,
    probe,
    start_stages,
    stop_stages,
)
from apps.nodes import agent_client
from apps.nodes.models import Node
from workers.engine import errors

S = Replica.State


def load(replica_id: str) -> None:
    """Ask the replica's node to load it (with its rpc stages first, for a split); record
    the outcome. A split that fails anywhere is rolled back whole."""
    from apps.deployments.tasks import free_replica

    claimed = Replica.objects.filter(pk=replica_id, state=S.PENDING).update(
        state=S.LOADING,
        lease_expires_at=timezone.now() + timedelta(seconds=agent_client.LOAD_TIMEOUT + 120),
    )
    if not claimed:
        return  # another worker got there first, or it was stopped meanwhile
    r = Replica.objects.select_related("deployment__model", "node", "plan").get(pk=replica_id)
    d, node = r.deployment, r.node
    split = r.plan is not None and r.plan.kind == ShardPlan.Kind.SPLIT
    record_event(d, f"loading {d.model.name} on {node.name}", replica=r)
    refresh_state(d)
    request = _load_request(r)
    if split:
        try:
            _with_stages(r, request)
        except StageError as exc:
            stop_stages(r)
            fail_replica(r, f"split not started, rolled back: {exc}")
            return
    resp, error = _ask_to_load(node, request)
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


def _load_request(r: Replica):
    """The LoadModel request of a replica as its deployment and plan describe it."""
    from llamafleet.agent.v1 import agent_pb2 as pb

    d, model = r.deployment, r.deployment.model
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
        swa_window=placement.swa_window(d.batching, d.swa_cache),
    )
    if r.plan is not None and r.plan.kind != ShardPlan.Kind.SPLIT:
        # Layers the planner put on this node's accelerators (0: none reported).
        mine = r.plan.stages.filter(node=r.node).first()
        request.n_gpu_layers = mine.n_gpu_layers if mine else 0
    return request


def _with_stages(r: Replica, request) -> None:
    """Start a split's rpc stages and point the head's request at them; raises StageError."""
    from llamafleet.agent.v1 import agent_pb2 as pb

    request.rpc_servers.extend(start_stages(r))
    request.n_gpu_layers = r.plan.n_gpu_layers
    request.split_mode = (
        pb.SPLIT_MODE_TENSOR if r.plan.split_mode == "tensor" else pb.SPLIT_MODE_LAYER
    )
    request.tensor_split.extend(r.plan.tensor_split)


def _ask_to_load(node, request):
    """LoadModel on the node: (its answer, "") or (None, why it did not load)."""
    from llamafleet.agent.v1 import agent_pb2 as pb

    try:
        resp = agent_client.stub(node.address).LoadModel(
            request, metadata=agent_client.metadata(), timeout=agent_client.LOAD_TIMEOUT
        )
    except grpc.RpcError as exc:
        return None, f"node {node.name} ({node.address}) did not load it: {errors.describe(exc)}"
    if resp.state != pb.REPLICA_STATE_READY:
        return (
            resp,
            f"loading on {node.name} failed: {resp.error or pb.ReplicaState.Name(resp.state)}",
        )
    return resp, ""


def free(replica_id: str) -> None:
    """Ask the replica's node to free it, then mark it stopped."""
    r = Replica.objects.select_related("node", "deployment", "plan").filter(pk=replica_id).first()
    if r is None or r.state == S.STOPPED:
        return
    Replica.objects.filter(pk=r.pk).update(**stopping())
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
            timeout=agent_client.CONTROL_TIMEOUT,
        )
    except grpc.RpcError as exc:
        return errors.describe(exc)
    return ""
