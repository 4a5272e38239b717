from django.contrib import admin

from apps.nodes.models import Node, NodeLink


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
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
    list_editable = ("price_per_hour",)
    search_fields = ("name", "address")
    readonly_fields = ("registered_at", "last_heartbeat_at", "reported_replicas")


@admin.register(NodeLink)
class NodeLinkAdmin(admin.ModelAdmin):
    list_display = ("source", "target", "rtt_ms", "mbit_s", "error", "measured_at")
    readonly_fields = [f.name for f in NodeLink._meta.fields]
