"""Split orchestration: the rpc servers of a split's stages, started, stopped, checked."""

from __future__ import annotations

import grpc

from apps.deployments.models import PlanStage, Replica, ShardPlan
from apps.deployments.services.events import record_event
from apps.nodes import agent_client
from apps.nodes.models import Node
from workers.engine import errors


class StageError(Exception):
    """A split could not come up; the message names the node and why."""


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
                timeout=agent_client.START_TIMEOUT,
            )
            .servers
        )
    except grpc.RpcError as exc:
        why = errors.describe(exc)
        raise StageError(f"head {r.node.name} did not check its stages: {why}") from exc
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
                timeout=agent_client.START_TIMEOUT,
            )
        except grpc.RpcError as exc:
            why = errors.describe(exc)
            in_use = agent_client.error_code(exc) == errors.ENDPOINT_IN_USE
            if in_use and attempt < RPC_PORT_TRIES - 1:
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
                timeout=agent_client.CONTROL_TIMEOUT,
            )
        except grpc.RpcError as exc:
            missed.append(f"{st.node_name}: {errors.describe(exc)}")
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
                request, metadata=agent_client.metadata(), timeout=agent_client.PROBE_TIMEOUT
            )
        )
    except grpc.RpcError as exc:
        return f"the one-token probe on head {r.node.name} failed: {errors.describe(exc)}"
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
