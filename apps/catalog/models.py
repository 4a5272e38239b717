from pathlib import Path

from django.conf import settings
from django.db import models


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
    has_chat_template = models.BooleanField(default=False, help_text="The file carries one.")
    chat_template = models.TextField(
        blank=True, help_text="Jinja chat template used when the file carries none."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @property
    def path(self) -> Path:
        return store_path(self.sha256)


def store_path(sha256: str) -> Path:
    """Files are named by content, so agents sharing the directory find them as they are."""
    return Path(settings.MODEL_STORE_DIR) / f"sha256-{sha256}.gguf"


class PullJob(models.Model):
    """One pull or import of a model file, with its progress."""

    class State(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    model = models.ForeignKey(CatalogModel, on_delete=models.CASCADE, related_name="pulls")
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    #: A local file to import instead of the model's known source.
    local_path = models.CharField(max_length=1000, blank=True)
    phase = models.CharField(max_length=200, blank=True)
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"pull {self.model.name} ({self.state})"

    @property
    def progress(self) -> float | None:
        return round(self.bytes_done / self.bytes_total, 4) if self.bytes_total else None
