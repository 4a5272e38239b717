# The shared KV cache became the default batching mode; the prefix policy joined routing.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("deployments", "0004_shard_plans"),
    ]

    operations = [
        migrations.RemoveField(model_name="deployment", name="shared_kv"),
        migrations.AddField(
            model_name="deployment",
            name="batching",
            field=models.CharField(
                choices=[
                    ("throughput", "throughput: one KV cache, mixed batches, prompt cache"),
                    ("invariant", "invariant: greedy text independent of load, no prompt cache"),
                ],
                default="throughput",
                help_text="throughput: batches like llama-server and reuses cached prompts; "
                "invariant: greedy text equals a solo run whatever else runs, at a cost in "
                "tokens/s.",
                max_length=20,
            ),
        ),
        migrations.AlterField(
            model_name="deployment",
            name="routing_policy",
            field=models.CharField(
                choices=[
                    ("round_robin", "Round Robin"),
                    ("least_connections", "Least Connections"),
                    (
                        "prefix",
                        "prefix: to the replica holding the prompt's prefix, load bounded",
                    ),
                ],
                default="prefix",
                help_text="How requests pick among ready replicas; counts are shared through "
                "Redis.",
                max_length=20,
            ),
        ),
    ]
