from django.db import models

from controlplane.jobs import Job
from controlplane.querysets import SignallingQuerySet


class Node(models.Model):
    """A machine running a node agent, as its heartbeats describe it."""

    class State(models.TextChoices):
        READY = "ready"
        UNREACHABLE = "unreachable"

    class ReportedState(models.TextChoices):
        """A replica's state as its agent reports it (in reported_replicas)."""

        LOADING = "loading"
        READY = "ready"
        FAILED = "failed"
        STOPPING = "stopping"
        UNKNOWN = "unknown"

    name = models.CharField(max_length=100, unique=True)
    address = models.CharField(max_length=255, help_text="host:port of the agent's gRPC server")
    state = models.CharField(max_length=20, choices=State.choices, default=State.READY)
    price_per_hour = models.DecimalField(
        max_digits=10,
        decimal_places=4,
        default=0,
        help_text="What an hour of this node costs: a cloud price or amortised hardware.",
    )
    currency = models.CharField(max_length=3, default="USD")
    draining = models.BooleanField(
        default=False,
        help_text="Takes no new requests or replicas; requests in flight finish.",
    )
    version = models.CharField(max_length=40, blank=True)
    #: What the agent said it does beyond the first protocol (workers.FEATURES).
    features = models.JSONField(default=list, blank=True)
    memory_total_bytes = models.BigIntegerField(default=0)
    memory_available_bytes = models.BigIntegerField(default=0)
    memory_in_use_bytes = models.BigIntegerField(default=0)
    disk_free_bytes = models.BigIntegerField(
        default=0, help_text="Free bytes where the agent keeps model files."
    )
    boot_id = models.CharField(
        max_length=64, blank=True, help_text="The agent's current start (changes on restart)."
    )
    load_average = models.FloatField(default=0, help_text="One-minute load average.")
    cpu_cores = models.PositiveIntegerField(default=0)
    accelerators = models.JSONField(default=list, blank=True)
    in_flight = models.PositiveIntegerField(default=0)
    #: The rpc servers the agent runs for heads elsewhere (endpoint, running, pid, error).
    rpc_servers = models.JSONField(default=list, blank=True)
    #: The replicas as the agent reported them last (replica_id, state, error, memory, pid).
    reported_replicas = models.JSONField(default=list, blank=True)
    registered_at = models.DateTimeField(auto_now_add=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)

    objects = SignallingQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name


class LinkJob(Job):
    """One round of link measurements between ready nodes (all of them, or those named),
    with its progress in node pairs. The hourly schedule and POST .../measure-links/ make
    one; GET /api/v1/link-jobs/<id>/ follows it."""

    PROGRESS = ("pairs_done", "pairs_total")

    nodes = models.JSONField(default=list, blank=True, help_text="Names; [] for every node.")
    pairs_done = models.PositiveIntegerField(default=0)
    pairs_total = models.PositiveIntegerField(default=0)

    class Meta(Job.Meta):
        pass

    def __str__(self):
        return f"link measurements #{self.pk} ({self.state})"


class NodeLink(models.Model):
    """A measured network path from one node's agent to another's (round trip, throughput)."""

    source = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="links_out")
    target = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="links_in")
    rtt_ms = models.FloatField(null=True, blank=True)
    mbit_s = models.FloatField(null=True, blank=True)
    error = models.TextField(blank=True)
    measured_at = models.DateTimeField()

    class Meta:
        ordering = ["source__name", "target__name"]
        constraints = [
            models.UniqueConstraint(fields=["source", "target"], name="one_link_per_pair")
        ]

    def __str__(self):
        return f"{self.source.name} -> {self.target.name}"
