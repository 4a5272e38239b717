from django.db import migrations, models


def read_facts(apps, schema_editor):
    """Models pulled before the field existed: read it from the stored files (a model whose
    file cannot be read keeps 0, and the planner sizes its KV as full: an upper bound)."""
    from apps.catalog.gguf_meta import BadGGUF, read_metadata
    from apps.catalog.models import store_path

    files = apps.get_model("catalog", "ModelFile").objects.order_by("index")
    for m in apps.get_model("catalog", "CatalogModel").objects.exclude(sha256=""):
        shas = [f.sha256 for f in files.filter(model=m)] or [m.sha256]
        try:
            meta = read_metadata([store_path(sha) for sha in shas])
        except (OSError, BadGGUF):
            continue
        m.sliding_window, m.sliding_layers = meta["sliding_window"], meta["sliding_layers"]
        m.save(update_fields=["sliding_window", "sliding_layers"])


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
