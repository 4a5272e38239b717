"""Deployments react to what the nodes app observes."""

from django.dispatch import receiver

from apps.deployments import services
from apps.nodes.signals import node_lost, node_reported


@receiver(node_reported)
def _on_node_reported(sender, node, reported, restarted=False, **kwargs):
    # By id: the reaction reads the node as it is now, not as this heartbeat's transaction saw it.
    services.react_to_report(node.pk, node.boot_id, reported, restarted=restarted)


@receiver(node_lost)
def _on_node_lost(sender, node, since, **kwargs):
    services.node_lost(node, since)
