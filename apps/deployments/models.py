import uuid

from django.db import models

from apps.catalog.models import CatalogModel
from apps.deployments import planner
from apps.nodes.models import Node
from controlplane.querysets import SignallingQuerySet


class Deployment(models.Model):
    """What should run: a model as N replicas with a context window and batching slots."""

    MAX_REPLICAS = planner.MAX_REPLICAS
    MIN_CONTEXT, MAX_CONTEXT = planner.MIN_CONTEXT, planner.MAX_CONTEXT
    MAX_PARALLEL = planner.MAX_PARALLEL

    class State(models.TextChoices):
        PENDING = "pending"
        DEPLOYING = "deploying"
        READY = "ready"
        DEGRADED = "degraded"  # some, not all, replicas ready
        FAILED = "failed"
        #: Failed again and again: still restarted, at longer and longer intervals.
        CRASH_LOOP = "crash_loop"
        STOPPING = "stopping"
        STOPPED = "stopped"
        #: Scaled to zero by its autoscaler: the next request starts a replica.
        IDLE = "idle"

    class Routing(models.TextChoices):
        ROUND_ROBIN = "round_robin"
        LEAST_CONNECTIONS = "least_connections"
        PREFIX = "prefix", "prefix: to the replica holding the prompt's prefix, load bounded"

    class Batching(models.TextChoices):
        THROUGHPUT = "throughput", "throughput: one KV cache, mixed batches, prompt cache"
        INVARIANT = "invariant", "invariant: greedy text independent of load, no prompt cache"

    name = models.SlugField(max_length=100, unique=True)
    model = models.ForeignKey(CatalogModel, on_delete=models.PROTECT, related_name="deployments")
    replicas = models.PositiveIntegerField(default=1, help_text="Desired number of replicas.")
    context_length = models.PositiveIntegerField(
        help_text="Context window of one sequence, in tokens."
    )
    parallel = models.PositiveIntegerField(help_text="Sequences decoded together per replica.")
    batching = models.CharField(
        max_length=20,
        choices=Batching.choices,
        default=Batching.THROUGHPUT,
        help_text="throughput: batches like llama-server and reuses cached prompts; invariant: "
        "greedy text equals a solo run whatever else runs, at a cost in tokens/s.",
    )

    class SwaCache(models.TextChoices):
        WINDOW = "window", "window: sliding layers keep their window only, as llama-server does"
        FULL = "full", "full: sliding layers keep every token, so any cached prefix is reusable"

    swa_cache = models.CharField(
        max_length=10,
        choices=SwaCache.choices,
        default=SwaCache.WINDOW,
        help_text="Sliding-window models (gemma) in the throughput mode: window takes far less "
        "KV at long contexts; full also reuses a prefix another conversation shares beyond "
        "the window. The invariant mode always keeps the full cache.",
    )
    routing_policy = models.CharField(
        max_length=20,
        choices=Routing.choices,
        default=Routing.PREFIX,
        help_text="How requests pick among ready replicas; counts are shared through Redis.",
    )

    class SplitMode(models.TextChoices):
        AUTO = "auto", "auto: replicas when a node holds the model, else a layer split"
        NONE = "none", "none: whole copies only"
        LAYER = "layer", "layer split (pipeline)"
        TENSOR = "tensor", "tensor parallel (flash attention on)"

    split_mode = models.CharField(max_length=10, choices=SplitMode.choices, default=SplitMode.AUTO)
    pin_nodes = models.JSONField(
        default=list,
        blank=True,
        help_text="Only these nodes (names); the first is the head of a split.",
    )

    class Restart(models.TextChoices):
        ALWAYS = "always", "always: replace failed replicas, with exponential backoff"
        NEVER = "never", "never: a failed replica stays failed until redeployed"

    restart_policy = models.CharField(
        max_length=10, choices=Restart.choices, default=Restart.ALWAYS
    )
    restarts = models.PositiveIntegerField(
        default=0, help_text="Restarts since the deployment last ran steadily (10 minutes)."
    )
    next_restart_at = models.DateTimeField(null=True, blank=True)
    last_failure_at = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = SignallingQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name


class ShardPlan(models.Model):
    """Where the planner put (part of) a deployment, and why: replicas on single nodes, or
    one copy split over a head and rpc stages."""

    class Kind(models.TextChoices):
        REPLICAS = "replicas"
        SPLIT = "split"

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="plans")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    split_mode = models.CharField(max_length=10, default="none")
    #: The head's LoadModel: layers offloaded to the rpc devices and each one's share.
    n_gpu_layers = models.IntegerField(default=0)
    tensor_split = models.JSONField(default=list, blank=True)
    needed_bytes = models.BigIntegerField(default=0)
    reasons = models.JSONField(default=list, blank=True)
    warnings = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.deployment.name}: {self.kind} plan #{self.pk}"


class PlanStage(models.Model):
    """One node's part of a plan, with the memory it was planned to take."""

    class Role(models.TextChoices):
        REPLICA = "replica"
        HEAD = "head"
        STAGE = "stage"

    plan = models.ForeignKey(ShardPlan, on_delete=models.CASCADE, related_name="stages")
    position = models.PositiveIntegerField()
    node = models.ForeignKey(Node, on_delete=models.SET_NULL, null=True, related_name="stages")
    node_name = models.CharField(max_length=100)
    role = models.CharField(max_length=10, choices=Role.choices)
    layer_start = models.PositiveIntegerField()
    layer_end = models.PositiveIntegerField()
    weights_bytes = models.BigIntegerField()
    kv_bytes = models.BigIntegerField()
    compute_bytes = models.BigIntegerField()
    overhead_bytes = models.BigIntegerField()
    total_bytes = models.BigIntegerField()
    n_gpu_layers = models.PositiveIntegerField(default=0)
    #: Where this stage's rpc server listens, once started (stages only).
    rpc_port = models.PositiveIntegerField(null=True, blank=True)
    endpoint = models.CharField(max_length=255, blank=True)

    class Meta:
        ordering = ["plan", "position"]

    def __str__(self):
        return f"{self.role} on {self.node_name}"

    @property
    def layers(self) -> int:
        return self.layer_end - self.layer_start


class Replica(models.Model):
    """One copy of a deployment's model on one node, as the agent reports it."""

    class State(models.TextChoices):
        PENDING = "pending"
        LOADING = "loading"
        READY = "ready"
        #: Was ready on a node that went quiet: not routed, not freed, re-adopted if the agent
        #: comes back still holding it (a control-plane or network blip), failed otherwise.
        UNREACHABLE = "unreachable"
        FAILED = "failed"
        STOPPING = "stopping"
        STOPPED = "stopped"

    LIVE = (State.PENDING, State.LOADING, State.READY)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replica_set")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="replicas")
    #: The plan this replica came from; a split replica's stages are that plan's.
    plan = models.ForeignKey(
        ShardPlan, on_delete=models.SET_NULL, null=True, blank=True, related_name="replicas"
    )
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    error = models.TextField(blank=True)
    memory_bytes = models.BigIntegerField(default=0)
    load_seconds = models.FloatField(null=True, blank=True)
    #: Set when a worker claims the load: past it, the load is taken as lost (the worker died
    #: with the claim) and the replica fails with that reason, to be replaced.
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    #: Ready, but missing from its node's reports since then. A report is a snapshot that
    #: may arrive late; only one that is still missing it this long after counts.
    missing_since = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = SignallingQuerySet.as_manager()

    class Meta:
        ordering = ["created_at"]

    def __str__(self):
        return f"{self.deployment.name}/{str(self.id)[:8]}@{self.node.name}"


class ScalingPolicy(models.Model):
    """How a deployment's replica count follows its load (see apps/deployments/autoscaling.py).

    The target is what one replica should carry: requests in flight per slot, or requests
    queued beyond its slots. Up: as soon as the load over `window_seconds` calls for more.
    Down: only when it called for fewer during the whole `scale_down_delay_seconds`. Two
    changes are at least `cooldown_seconds` apart, except a start from zero for a waiting
    request.
    """

    class Mode(models.TextChoices):
        OFF = "off", "off: replicas as set"
        SHADOW = "shadow", "shadow: decisions recorded as events, not acted on"
        ON = "on", "on: the autoscaler sets the replicas"

    class Metric(models.TextChoices):
        IN_FLIGHT_PER_SLOT = "in_flight_per_slot", "requests in flight per slot"
        QUEUE_DEPTH = "queue_depth", "requests queued beyond a replica's slots"

    deployment = models.OneToOneField(
        Deployment, on_delete=models.CASCADE, related_name="autoscaling"
    )
    mode = models.CharField(max_length=10, choices=Mode.choices, default=Mode.ON)
    min_replicas = models.PositiveIntegerField(default=1, help_text="0 allows scale to zero.")
    max_replicas = models.PositiveIntegerField(default=4)
    metric = models.CharField(
        max_length=20, choices=Metric.choices, default=Metric.IN_FLIGHT_PER_SLOT
    )
    target = models.FloatField(
        default=0.75, help_text="Per replica: in-flight requests per slot, or queued requests."
    )
    window_seconds = models.PositiveIntegerField(default=60)
    scale_down_delay_seconds = models.PositiveIntegerField(default=300)
    cooldown_seconds = models.PositiveIntegerField(default=60)
    #: The last change made (mode on), and the replica count last decided (shadow included).
    last_scaled_at = models.DateTimeField(null=True, blank=True)
    last_desired = models.PositiveIntegerField(null=True, blank=True)
    last_reason = models.TextField(blank=True)

    def __str__(self):
        return f"{self.deployment.name}: {self.mode} {self.min_replicas}..{self.max_replicas}"


class DeploymentEvent(models.Model):
    """A state change of a deployment or one of its replicas, in words."""

    class Level(models.TextChoices):
        INFO = "info"
        WARNING = "warning"
        ERROR = "error"

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="events")
    replica = models.ForeignKey(Replica, on_delete=models.SET_NULL, null=True, blank=True)
    level = models.CharField(max_length=10, choices=Level.choices, default=Level.INFO)
    message = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return self.message
