from django.contrib import admin

from apps.deployments.models import Deployment, DeploymentEvent, Replica


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
        "updated_at",
    )
    list_filter = ("state",)
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
