import hashlib
from pathlib import Path

from django.conf import settings
from django.db import models

from controlplane.jobs import Job


class CatalogModel(models.Model):
    """A GGUF model the fleet can deploy, with the facts read from its file."""

    class State(models.TextChoices):
        PENDING = "pending"
        PULLING = "pulling"
        READY = "ready"
        FAILED = "failed"

    name = models.SlugField(max_length=100, unique=True, help_text="Name clients address it by.")
    source = models.CharField(max_length=500, help_text="Where the file came from.")
    description = models.CharField(max_length=300, blank=True)
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    error = models.TextField(blank=True)
    sha256 = models.CharField(max_length=64, blank=True, db_index=True)
    size_bytes = models.BigIntegerField(default=0)
    architecture = models.CharField(max_length=50, blank=True)
    display_name = models.CharField(max_length=200, blank=True)
    parameters = models.BigIntegerField(default=0)
    quantization = models.CharField(max_length=30, blank=True)
    n_layers = models.PositiveIntegerField(default=0)
    n_heads = models.PositiveIntegerField(default=0)
    n_kv_heads = models.PositiveIntegerField(default=0)
    n_embd = models.PositiveIntegerField(default=0)
    head_dim = models.PositiveIntegerField(default=0)
    context_length = models.PositiveIntegerField(default=0, help_text="Trained context window.")
    bytes_per_layer = models.JSONField(default=list, blank=True)
    bytes_outside_layers = models.BigIntegerField(default=0, help_text="Embeddings, output, norms.")
    bytes_embeddings = models.BigIntegerField(default=0, help_text="Token embeddings (input).")
    bytes_output = models.BigIntegerField(
        default=0, help_text="Output matrix and norm (a copy of the embeddings when tied)."
    )
    n_vocab = models.PositiveIntegerField(default=0)
    n_ff = models.PositiveIntegerField(default=0, help_text="Feed-forward width.")
    sliding_window = models.PositiveIntegerField(
        default=0, help_text="Sliding-window attention span (0: none)."
    )
    sliding_layers = models.PositiveIntegerField(
        default=0, help_text="Layers attending only to the window (as llama.cpp loads them)."
    )
    sliding_pattern = models.CharField(
        max_length=4096,
        blank=True,
        default="",
        help_text='A character a layer, "1" where it attends only to the window ("": none).',
    )
    has_chat_template = models.BooleanField(default=False, help_text="The file carries one.")
    chat_template = models.TextField(
        blank=True, help_text="Jinja chat template used when the file carries none."
    )
    revision = models.CharField(
        max_length=100, blank=True, help_text="The hub commit the files came from."
    )
    #: A variant made in the fleet (quantization) records what it was made from, and how it
    #: measured against it on the evaluation text.
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="variants"
    )
    evaluation = models.JSONField(
        default=dict,
        blank=True,
        help_text="mean NLL and decode tokens/s on the evaluation text, with the parent's.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @property
    def path(self) -> Path:
        """The file llama.cpp opens: the model's only file, or the first part of a split."""
        return self.paths[0]

    @property
    def paths(self) -> list[Path]:
        shas = [f.sha256 for f in self.files.all()] or [self.sha256]
        return [store_path(sha) for sha in shas]

    @property
    def is_split(self) -> bool:
        return self.files.count() > 1


def model_digest(part_sha256s: list[str]) -> str:
    """A model's identity: its file's sha256, or for a split a digest of its parts' in order."""
    if len(part_sha256s) == 1:
        return part_sha256s[0]
    return hashlib.sha256("\n".join(part_sha256s).encode()).hexdigest()


class ModelFile(models.Model):
    """One file of a model: the only one, or one part of a multi-file (split) GGUF."""

    model = models.ForeignKey(CatalogModel, on_delete=models.CASCADE, related_name="files")
    index = models.PositiveSmallIntegerField()
    sha256 = models.CharField(max_length=64, db_index=True)
    size_bytes = models.BigIntegerField()
    name = models.CharField(max_length=300, help_text="The file's name where it came from.")

    class Meta:
        ordering = ["model", "index"]
        constraints = [
            models.UniqueConstraint(fields=["model", "index"], name="model_file_index_unique")
        ]

    def __str__(self):
        return f"{self.model.name} part {self.index + 1}: {self.name}"


def store_path(sha256: str) -> Path:
    """Files are named by content, so agents sharing the directory find them as they are."""
    return Path(settings.MODEL_STORE_DIR) / f"sha256-{sha256}.gguf"


def migrate_facts(apps, fields: tuple[str, ...]) -> None:
    """For a migration that adds GGUF facts: read `fields` of every stored model from its
    files (a model whose files cannot be read keeps the fields' defaults, which the planner
    treats as an upper bound)."""
    from apps.catalog.gguf_meta import BadGGUF, read_metadata

    files = apps.get_model("catalog", "ModelFile").objects.order_by("index")
    for m in apps.get_model("catalog", "CatalogModel").objects.exclude(sha256=""):
        shas = [f.sha256 for f in files.filter(model=m)] or [m.sha256]
        try:
            meta = read_metadata([store_path(sha) for sha in shas])
        except (OSError, BadGGUF):
            continue
        for field in fields:
            setattr(m, field, meta[field])
        m.save(update_fields=list(fields))


class PullJob(Job):
    """One pull or import of a model file, with its progress."""

    PROGRESS = ("bytes_done", "bytes_total")

    model = models.ForeignKey(CatalogModel, on_delete=models.CASCADE, related_name="pulls")
    #: A local file to import instead of the model's known source.
    local_path = models.CharField(max_length=1000, blank=True)
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)

    class Meta(Job.Meta):
        pass

    def __str__(self):
        return f"pull {self.model.name} ({self.state})"


class QuantizeJob(Job):
    """Making a quantized variant of a catalog model on a node of the fleet."""

    class Target(models.TextChoices):
        Q4_K_M = "Q4_K_M"
        Q5_K_M = "Q5_K_M"
        Q8_0 = "Q8_0"
        Q4_0 = "Q4_0"

    source = models.ForeignKey(CatalogModel, on_delete=models.CASCADE, related_name="quantizations")
    target = models.CharField(max_length=10, choices=Target.choices)
    name = models.SlugField(max_length=100, help_text="Catalog name of the result.")
    node = models.ForeignKey(
        "nodes.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    result = models.ForeignKey(
        CatalogModel, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    done = models.BigIntegerField(default=0, help_text="Tensors (quantizing) or bytes (copying).")
    total = models.BigIntegerField(default=0)

    class Meta(Job.Meta):
        pass

    def __str__(self):
        return f"quantize {self.source.name} to {self.target} ({self.state})"
