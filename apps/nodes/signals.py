"""What the nodes app tells the rest of the control plane, without importing it."""

from django.dispatch import Signal

#: A heartbeat was recorded: sender=Node, node, reported=list of replica dicts,
#: previous_heartbeat_at=datetime of the one before (None at registration), restarted=True
#: when the agent reports another boot than before (its previous engines are all gone).
node_reported = Signal()
#: A node stopped sending heartbeats: sender=Node, since=datetime of its last one.
node_lost = Signal()
#: Buffered heartbeats that said nothing new were written: sender=Node, items=list of
#: (node, reported replicas, previous_heartbeat_at, this heartbeat's time).
nodes_alive = Signal()
