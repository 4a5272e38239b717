from django.contrib import admin

from apps.deployments.models import Deployment, DeploymentEvent, PlanStage, Replica, ShardPlan


class ReplicaInline(admin.TabularInline):
    model = Replica
    extra = 0
    fields = ("id", "node", "state", "error", "memory_bytes", "load_seconds", "updated_at")
    readonly_fields = fields


class EventInline(admin.TabularInline):
    model = DeploymentEvent
    extra = 0
    fields = ("created_at", "level", "message")
    readonly_fields = fields
    ordering = ("-created_at",)


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
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
    readonly_fields = ("state", "error", "created_at", "updated_at")
    inlines = [ReplicaInline, EventInline]


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ("id", "deployment", "node", "state", "memory_bytes", "updated_at")
    list_filter = ("state",)
    readonly_fields = [f.name for f in Replica._meta.fields]


@admin.register(DeploymentEvent)
class DeploymentEventAdmin(admin.ModelAdmin):
    list_display = ("created_at", "deployment", "level", "message")
    list_filter = ("level",)
    readonly_fields = [f.name for f in DeploymentEvent._meta.fields]


class PlanStageInline(admin.TabularInline):
    model = PlanStage
    extra = 0
    fields = (
        "position", "role", "node_name", "layer_start", "layer_end", "weights_bytes",
        "kv_bytes", "compute_bytes", "total_bytes", "n_gpu_layers", "endpoint",
    )  # fmt: skip
    readonly_fields = fields


@admin.register(ShardPlan)
class ShardPlanAdmin(admin.ModelAdmin):
    """Plans are the planner's record: read them here, change a deployment to re-plan."""

    list_display = ("id", "deployment", "kind", "split_mode", "needed_bytes", "created_at")
    list_filter = ("kind", "split_mode")
    readonly_fields = [f.name for f in ShardPlan._meta.fields]
    inlines = [PlanStageInline]
