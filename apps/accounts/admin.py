from django.contrib import admin

from apps.accounts.models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "app",
        "prefix",
        "owner",
        "requests_per_minute",
        "tokens_per_day",
        "tokens_per_month",
        "last_used_at",
        "revoked_at",
    )
    list_filter = ("revoked_at",)
    search_fields = ("name", "prefix")
    readonly_fields = ("prefix", "key_hash", "created_at", "last_used_at")
