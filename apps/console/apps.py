from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "apps.console"
    verbose_name = "Web console"
