from django.db import migrations, models


def read_facts(apps, schema_editor):
    """Models pulled before the field existed: read it from the stored files."""
    from apps.catalog.models import migrate_facts

    migrate_facts(apps, ("sliding_window", "sliding_layers"))


class Migration(migrations.Migration):

    dependencies = [
        ("catalog", "0005_leases"),
    ]

    operations = [
        migrations.AddField(
            model_name="catalogmodel",
            name="sliding_layers",
            field=models.PositiveIntegerField(
                default=0,
                help_text="Layers attending only to the window (as llama.cpp loads them).",
            ),
        ),
        migrations.RunPython(read_facts, migrations.RunPython.noop),
    ]
