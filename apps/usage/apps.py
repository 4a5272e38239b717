from django.apps import AppConfig


class UsageConfig(AppConfig):
    name = "apps.usage"
    verbose_name = "Usage, quotas and cost reports"

    def ready(self):
        from apps.usage import receivers  # noqa: F401
