"""Daily and weekly reports as django-celery-beat rows, so that the admin can edit them."""

import json

from django.db import migrations

SCHEDULES = [
    # name, kind, minute, hour, day_of_week
    ("usage: daily report", "daily", "10", "0", "*"),
    ("usage: weekly report", "weekly", "20", "0", "1"),
]


def create(apps, schema_editor):
    Crontab = apps.get_model("django_celery_beat", "CrontabSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    for name, kind, minute, hour, dow in SCHEDULES:
        crontab, _ = Crontab.objects.get_or_create(
            minute=minute,
            hour=hour,
            day_of_week=dow,
            day_of_month="*",
            month_of_year="*",
            timezone="UTC",
        )
        PeriodicTask.objects.get_or_create(
            name=name,
            defaults={
                "task": "apps.usage.tasks.make_report",
                "crontab": crontab,
                "kwargs": json.dumps({"kind": kind}),
                "queue": "jobs",
            },
        )


def remove(apps, schema_editor):
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTask.objects.filter(name__in=[s[0] for s in SCHEDULES]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("usage", "0001_initial"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(create, remove)]
