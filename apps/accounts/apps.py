from django.apps import AppConfig


class AccountsConfig(AppConfig):
    """API keys and the people and apps that hold them."""

    name = "apps.accounts"

    def ready(self):
        from apps.accounts import services

        services.connect_signals()
