from django.contrib import admin

from apps.usage.models import NodeUsage, Report, UsageRecord


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin):
    list_display = (
        "started_at",
        "app",
        "model",
        "deployment",
        "outcome",
        "prompt_tokens",
        "completion_tokens",
        "time_to_first_token_ms",
        "duration_ms",
    )
    list_filter = ("outcome", "model", "endpoint")
    search_fields = ("request_id", "app", "deployment")
    date_hierarchy = "started_at"


@admin.register(NodeUsage)
class NodeUsageAdmin(admin.ModelAdmin):
    list_display = ("hour", "node", "seconds", "cost", "currency", "memory_total_bytes")
    list_filter = ("node",)
    date_hierarchy = "hour"


@admin.register(Report)
class ReportAdmin(admin.ModelAdmin):
    list_display = ("kind", "start", "end", "generated_at")
    list_filter = ("kind",)
