from django.contrib import admin

from apps.deployments.models import Deployment, DeploymentEvent, PlanStage, Replica, ShardPlan
from controlplane.admin import ReadOnlyAdmin, ReadOnlyInline


class ReplicaInline(ReadOnlyInline):
    model = Replica
    fields = ("id", "node", "state", "error", "memory_bytes", "load_seconds", "updated_at")


class EventInline(ReadOnlyInline):
    model = DeploymentEvent
    fields = ("created_at", "level", "message")
    ordering = ("-created_at",)


@admin.register(Deployment)
class DeploymentAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "model",
        "state",
        "replicas",
        "context_length",
        "parallel",
        "split_mode",
        "updated_at",
    )
    list_filter = ("state", "split_mode")
    search_fields = ("name",)
    inlines = [ReplicaInline, EventInline]


@admin.register(Replica)
class ReplicaAdmin(ReadOnlyAdmin):
    list_display = ("id", "deployment", "node", "state", "memory_bytes", "updated_at")
    list_filter = ("state",)


@admin.register(DeploymentEvent)
class DeploymentEventAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "deployment", "level", "message")
    list_filter = ("level",)


class PlanStageInline(ReadOnlyInline):
    model = PlanStage
    fields = (
        "position", "role", "node_name", "layer_start", "layer_end", "weights_bytes",
        "kv_bytes", "compute_bytes", "total_bytes", "n_gpu_layers", "endpoint",
    )  # fmt: skip


@admin.register(ShardPlan)
class ShardPlanAdmin(ReadOnlyAdmin):
    """Plans are the planner's record: read them here, change a deployment to re-plan."""

    list_display = ("id", "deployment", "kind", "split_mode", "needed_bytes", "created_at")
    list_filter = ("kind", "split_mode")
    inlines = [PlanStageInline]
