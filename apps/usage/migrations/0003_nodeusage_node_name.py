"""Keep a node's name on its hours, so that removing the node keeps its past costs."""

import django.db.models.deletion
from django.db import migrations, models


def fill_names(apps, schema_editor):
    NodeUsage = apps.get_model("usage", "NodeUsage")
    for row in NodeUsage.objects.select_related("node"):
        row.node_name = row.node.name
        row.save(update_fields=["node_name"])


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0003_node_currency_node_price_per_hour"),
        ("usage", "0002_report_schedules"),
    ]

    operations = [
        migrations.AddField(
            model_name="nodeusage",
            name="node_name",
            field=models.CharField(
                default="", help_text="Kept when the node is removed.", max_length=100
            ),
            preserve_default=False,
        ),
        migrations.RunPython(fill_names, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="nodeusage",
            name="node",
            field=models.ForeignKey(
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="usage",
                to="nodes.node",
            ),
        ),
    ]
