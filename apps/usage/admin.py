from django.contrib import admin

from apps.usage.models import NodeUsage, Report, UsageRecord
from controlplane.admin import ReadOnlyAdmin


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
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
class NodeUsageAdmin(ReadOnlyAdmin):
    list_display = ("hour", "node", "seconds", "cost", "currency", "memory_total_bytes")
    list_filter = ("node",)
    date_hierarchy = "hour"


@admin.register(Report)
class ReportAdmin(ReadOnlyAdmin):
    list_display = ("kind", "start", "end", "generated_at")
    list_filter = ("kind",)
