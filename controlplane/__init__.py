"""The LlamaFleet control plane (Django project)."""

from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
