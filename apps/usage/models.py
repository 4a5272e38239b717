"""What was served (one record per request), what nodes cost (hourly), and reports."""

from django.conf import settings
from django.db import models


class UsageRecord(models.Model):
    """One request to the serving API, however it ended."""

    class Outcome(models.TextChoices):
        OK = "ok"
        MIGRATED = "migrated"  # completed after moving to another replica mid-stream
        CANCELLED = "cancelled"
        ERROR = "error"
        REJECTED = "rejected"  # 429: over a quota or a limit
        # Routed, stream not ended yet; left so by a web process that died mid-stream, until
        # services.settle_interrupted() completes it.
        RUNNING = "running"

    request_id = models.CharField(max_length=64, unique=True)
    api_key = models.ForeignKey(
        "accounts.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage"
    )
    app = models.CharField(max_length=100, blank=True, help_text="The key's app when recorded.")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    endpoint = models.CharField(max_length=32)  # chat, completion, embedding
    model = models.CharField(max_length=100)
    deployment = models.CharField(max_length=100, blank=True)
    replicas = models.JSONField(default=list, help_text="Replica ids that served, in order.")
    nodes = models.JSONField(default=list, help_text="Node names that served, in order.")
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    time_to_first_token_ms = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField(default=0)
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    error_code = models.CharField(max_length=64, blank=True)
    started_at = models.DateTimeField(db_index=True)
    finished_at = models.DateTimeField(
        null=True, blank=True, db_index=True, help_text="When the request ended (live charts)."
    )

    class Meta:
        ordering = ["-started_at"]
        indexes = [
            models.Index(fields=["api_key", "started_at"]),
            models.Index(fields=["user", "started_at"]),  # quotas count per application
        ]

    def __str__(self):
        return f"{self.model} {self.outcome} {self.prompt_tokens}+{self.completion_tokens}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class NodeUsage(models.Model):
    """One node's hour: how long it was up (from heartbeats), what that cost, who held it.

    `held` maps deployment name to byte-seconds of memory its replicas held on the node; the
    rest of memory_total_bytes x seconds is idle.
    """

    node = models.ForeignKey(
        "nodes.Node", null=True, on_delete=models.SET_NULL, related_name="usage"
    )
    node_name = models.CharField(max_length=100, help_text="Kept when the node is removed.")
    hour = models.DateTimeField(help_text="Start of the hour (UTC).")
    seconds = models.FloatField(default=0)
    cost = models.DecimalField(max_digits=14, decimal_places=6, default=0)
    currency = models.CharField(max_length=3, default="USD")
    memory_total_bytes = models.BigIntegerField(default=0)
    held = models.JSONField(default=dict)

    class Meta:
        ordering = ["-hour", "node"]
        constraints = [models.UniqueConstraint(fields=["node", "hour"], name="one_row_per_hour")]

    def __str__(self):
        return f"{self.node} {self.hour:%Y-%m-%d %H}:00 {self.seconds:.0f}s"


class Report(models.Model):
    """Usage and cost over [start, end), computed only from stored records: re-running it
    gives the same numbers."""

    class Kind(models.TextChoices):
        DAILY = "daily"
        WEEKLY = "weekly"
        CUSTOM = "custom"

    kind = models.CharField(max_length=10, choices=Kind.choices)
    start = models.DateTimeField()
    end = models.DateTimeField()
    generated_at = models.DateTimeField(auto_now=True)
    data = models.JSONField(default=dict)

    class Meta:
        ordering = ["-start", "kind"]
        constraints = [
            models.UniqueConstraint(fields=["kind", "start", "end"], name="one_report_per_period")
        ]

    def __str__(self):
        return f"{self.kind} {self.start:%Y-%m-%d} – {self.end:%Y-%m-%d}"
