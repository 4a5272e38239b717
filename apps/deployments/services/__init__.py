"""Deployments: validate and record desired state, then reconcile replicas towards it.

One module per concern; the names other apps, tasks and tests use are gathered here:
- commands: check_* validate, do_* write desired state (and enqueue a reconcile on commit);
- reconciling: replicas towards desired state, restarts with back-off, lease expiry, state;
- replicas: load a replica on its agent (a split's stages first), free one;
- splits: the rpc servers of a split's stages;
- reports: what an agent's heartbeat says about its replicas, and a lost node;
- events: the deployment's event log.
"""

from apps.deployments.services.commands import (
    check_create,
    do_create,
    do_delete,
    do_redeploy,
    do_scale,
    do_undeploy,
)
from apps.deployments.services.events import record_event
from apps.deployments.services.reconciling import (
    expire_leases,
    fail_replica,
    reconcile,
    refresh_state,
)
from apps.deployments.services.replicas import free, free_remote, load
from apps.deployments.services.reports import (
    REPORT_GRACE_SECONDS,
    apply_agent_report,
    mark_unreachable,
    node_lost,
    react_to_report,
)
from apps.deployments.services.splits import (
    RPC_PORT_TRIES,
    StageError,
    diagnose_stages,
    probe,
    start_stages,
    stop_stages,
)

__all__ = [
    "REPORT_GRACE_SECONDS",
    "RPC_PORT_TRIES",
    "StageError",
    "apply_agent_report",
    "check_create",
    "diagnose_stages",
    "do_create",
    "do_delete",
    "do_redeploy",
    "do_scale",
    "do_undeploy",
    "expire_leases",
    "fail_replica",
    "free",
    "free_remote",
    "load",
    "mark_unreachable",
    "node_lost",
    "probe",
    "react_to_report",
    "reconcile",
    "record_event",
    "refresh_state",
    "start_stages",
    "stop_stages",
]
