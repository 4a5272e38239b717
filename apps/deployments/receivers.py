"""Deployments react to what the nodes app observes."""

from django.dispatch import receiver

from apps.deployments import services
from apps.nodes.signals import node_lost, node_reported


@receiver(node_reported)
def _on_node_reported(sender, node, reported, restarted=False, **kwargs):
    services.apply_agent_report(node, reported, restarted=restarted)


@receiver(node_lost)
def _on_node_lost(sender, node, since, **kwargs):
    services.node_lost(node, since)
