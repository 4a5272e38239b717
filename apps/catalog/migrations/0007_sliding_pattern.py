from django.db import migrations, models


def read_facts(apps, schema_editor):
    """Models pulled before the field existed: read it from the stored files."""
    from apps.catalog.models import migrate_facts

    migrate_facts(apps, ("sliding_layers", "sliding_pattern"))


class Migration(migrations.Migration):

    dependencies = [
        ("catalog", "0006_sliding_layers"),
    ]

    operations = [
        migrations.AddField(
            model_name="catalogmodel",
            name="sliding_pattern",
            field=models.CharField(
                blank=True,
                default="",
                help_text='A character a layer, "1" where it attends only to the window ("": none).',
                max_length=4096,
            ),
        ),
        migrations.RunPython(read_facts, migrations.RunPython.noop),
    ]
