from django.db import migrations, models


def read_facts(apps, schema_editor):
    """Models pulled before the field existed: read it from the stored files (a model whose
    file cannot be read keeps "", and the planner sizes its KV as full: an upper bound)."""
    from apps.catalog.gguf_meta import BadGGUF, read_metadata
    from apps.catalog.models import store_path

    files = apps.get_model("catalog", "ModelFile").objects.order_by("index")
    for m in apps.get_model("catalog", "CatalogModel").objects.exclude(sha256=""):
        shas = [f.sha256 for f in files.filter(model=m)] or [m.sha256]
        try:
            meta = read_metadata([store_path(sha) for sha in shas])
        except (OSError, BadGGUF):
            continue
        m.sliding_layers, m.sliding_pattern = meta["sliding_layers"], meta["sliding_pattern"]
        m.save(update_fields=["sliding_layers", "sliding_pattern"])


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
