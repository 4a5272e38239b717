"""The deployment's event log: what happened to it, in words the console shows."""

from __future__ import annotations

import logging

from apps.deployments.models import Deployment, DeploymentEvent

log = logging.getLogger(__name__)


def record_event(deployment: Deployment, message: str, level: str = "info", replica=None) -> None:
    DeploymentEvent.objects.create(
        deployment=deployment, replica=replica, level=level, message=message
    )
    (log.warning if level != "info" else log.info)("%s: %s", deployment.name, message)
