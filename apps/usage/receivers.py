"""Node-hours come from heartbeats."""

from django.dispatch import receiver
from django.utils import timezone

from apps.nodes.signals import node_reported, nodes_alive
from apps.usage.services import account_heartbeat, account_heartbeats


@receiver(node_reported)
def _on_node_reported(sender, node, reported, previous_heartbeat_at=None, **kwargs):
    account_heartbeat(
        node, reported, previous_heartbeat_at, node.last_heartbeat_at or timezone.now()
    )


@receiver(nodes_alive)
def _on_nodes_alive(sender, items, **kwargs):
    account_heartbeats(items)
