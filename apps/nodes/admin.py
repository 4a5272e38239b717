from django.contrib import admin

from apps.nodes.models import Node, NodeLink
from controlplane.admin import ReadOnlyAdmin


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "address",
        "state",
        "draining",
        "price_per_hour",
        "currency",
        "cpu_cores",
        "memory_total_bytes",
        "memory_available_bytes",
        "in_flight",
        "last_heartbeat_at",
    )
    list_filter = ("state", "draining")
    search_fields = ("name", "address")


@admin.register(NodeLink)
class NodeLinkAdmin(ReadOnlyAdmin):
    list_display = ("source", "target", "rtt_ms", "mbit_s", "error", "measured_at")
