from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "apps.console"
    verbose_name = "Web console"

    def ready(self):
        from apps.console import live

        live.watch()
