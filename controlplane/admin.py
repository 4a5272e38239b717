"""Admin classes shared by the apps."""

from django.contrib import admin


class _ReadOnly:
    """No add, change or delete: the admin only shows."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class ReadOnlyAdmin(_ReadOnly, admin.ModelAdmin):
    """For state the services own (deployments, replicas, nodes, pulls, usage): the admin
    shows it, and every change goes through the API or the console, past the services'
    checks."""


class ReadOnlyInline(_ReadOnly, admin.TabularInline):
    """An inline of ReadOnlyAdmin."""

    extra = 0
