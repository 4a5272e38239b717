"""The Celery app; tasks and their periodic schedules live in each app's tasks.py."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("llamafleet")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
