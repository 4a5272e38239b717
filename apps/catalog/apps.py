from django.apps import AppConfig


class CatalogConfig(AppConfig):
    """GGUF models known to the fleet: where they come from, their facts, their files."""

    name = "apps.catalog"
