from django.contrib import admin

from apps.catalog.models import CatalogModel, PullJob
from controlplane.admin import ReadOnlyAdmin, ReadOnlyInline


class PullJobInline(ReadOnlyInline):
    model = PullJob
    fields = (
        "state",
        "phase",
        "bytes_done",
        "bytes_total",
        "error",
        "created_at",
        "finished_at",
    )


@admin.register(CatalogModel)
class CatalogModelAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "state",
        "architecture",
        "quantization",
        "parameters",
        "size_bytes",
        "n_layers",
    )
    list_filter = ("state", "architecture")
    search_fields = ("name", "sha256")
    inlines = [PullJobInline]


@admin.register(PullJob)
class PullJobAdmin(ReadOnlyAdmin):
    list_display = (
        "model",
        "state",
        "phase",
        "bytes_done",
        "bytes_total",
        "created_at",
        "finished_at",
    )
    list_filter = ("state",)
