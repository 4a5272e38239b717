from django.contrib import admin

from apps.catalog.models import CatalogModel, PullJob


class PullJobInline(admin.TabularInline):
    model = PullJob
    extra = 0
    readonly_fields = (
        "state",
        "phase",
        "bytes_done",
        "bytes_total",
        "error",
        "created_at",
        "finished_at",
    )
    fields = readonly_fields


@admin.register(CatalogModel)
class CatalogModelAdmin(admin.ModelAdmin):
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
    readonly_fields = [
        f.name for f in CatalogModel._meta.fields if f.name not in ("name", "description")
    ]
    inlines = [PullJobInline]


@admin.register(PullJob)
class PullJobAdmin(admin.ModelAdmin):
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
    readonly_fields = [f.name for f in PullJob._meta.fields]
