"""Control operations on the `control` queue. Each takes an id and is safe to run twice."""

from celery import shared_task

from apps.deployments import autoscaling, services
from apps.deployments.models import Deployment, Replica
from apps.nodes import agent_client
from apps.nodes.models import Node
from controlplane.celery import every


@shared_task(time_limit=120, soft_time_limit=100)
def reconcile_deployment(deployment_id: int) -> None:
    """Place, load or free replicas until the deployment matches its desired state."""
    services.reconcile(deployment_id)


@shared_task(
    time_limit=agent_client.LOAD_TIMEOUT + 60,
    soft_time_limit=agent_client.LOAD_TIMEOUT + 30,
)
def load_replica(replica_id: str) -> None:
    """LoadModel on the replica's node."""
    services.load(replica_id)


@shared_task(time_limit=90, soft_time_limit=60)
def free_replica(replica_id: str) -> None:
    """FreeMemory on the replica's node and mark it stopped."""
    services.free(replica_id)


@shared_task(time_limit=120, soft_time_limit=100)
def stop_replica_stages(replica_id: str) -> None:
    """StopRpcServer on every stage of a failed split replica."""
    r = Replica.objects.select_related("plan").filter(pk=replica_id).first()
    if r is not None:
        services.stop_stages(r)


@shared_task(time_limit=90, soft_time_limit=60)
def free_on_node(node_id: int, replica_id: str) -> None:
    """FreeMemory for an engine the control plane no longer wants on that node."""
    node = Node.objects.filter(pk=node_id).first()
    if node is not None:
        services.free_remote(node, replica_id)


@shared_task(time_limit=120, soft_time_limit=100)
def reconcile_all() -> int:
    """Retry placement of deployments waiting for capacity, restart failed replicas whose
    back-off is over, and finish stops. Deployments whose loads are under way (deploying) are
    left to them: at fleet scale, hundreds deploy at once."""
    ids = list(
        Deployment.objects.filter(
            state__in=[
                Deployment.State.PENDING,
                Deployment.State.DEGRADED,
                Deployment.State.FAILED,  # restarts that are due (policy "always")
                Deployment.State.CRASH_LOOP,
                Deployment.State.STOPPING,
            ]
        ).values_list("pk", flat=True)
    )
    for pk in ids:
        services.reconcile(pk)
    return len(ids)


every(15.0, reconcile_all.name, "deployments: reconcile all")


@shared_task(time_limit=60, soft_time_limit=50)
def expire_load_leases() -> dict:
    """Fail loads whose worker died holding the claim; send again loads never picked up."""
    return services.expire_leases()


every(60.0, expire_load_leases.name, "deployments: expire load leases")


@shared_task(time_limit=30, soft_time_limit=25, expires=autoscaling.TICK_SECONDS * 2)
def autoscale() -> dict:
    """Sample each autoscaled deployment's load and scale it (or, in shadow, record what it
    would do)."""
    return autoscaling.tick()


every(autoscaling.TICK_SECONDS, autoscale.name, "deployments: autoscale")
