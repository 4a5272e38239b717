# Sliding-window models keep only their window in whole replicas by default, as
# llama-server does. Deployments made before keep the full cache they were planned with.

from django.db import migrations, models

CHOICES = [
    ("window", "window: sliding layers keep their window only, as llama-server does"),
    ("full", "full: sliding layers keep every token, so any cached prefix is reusable"),
]
HELP = (
    "Sliding-window models (gemma) in the throughput mode: window takes far less KV at long "
    "contexts; full also reuses a prefix another conversation shares beyond the window. "
    "Splits and the invariant mode always keep the full cache."
)


class Migration(migrations.Migration):
    dependencies = [
        ("deployments", "0010_replica_missing_since"),
    ]

    operations = [
        migrations.AddField(
            model_name="deployment",
            name="swa_cache",
            field=models.CharField(choices=CHOICES, default="full", help_text=HELP, max_length=10),
        ),
        migrations.AlterField(
            model_name="deployment",
            name="swa_cache",
            field=models.CharField(
                choices=CHOICES, default="window", help_text=HELP, max_length=10
            ),
        ),
    ]
