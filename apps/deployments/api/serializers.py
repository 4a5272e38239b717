from rest_framework import serializers

from apps.deployments import autoscaling
from apps.deployments.models import (
    Deployment,
    DeploymentEvent,
    PlanStage,
    Replica,
    ScalingPolicy,
    ShardPlan,
)


class ReplicaSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = Replica
        fields = [
            "id",
            "node",
            "state",
            "error",
            "memory_bytes",
            "load_seconds",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields


class PlanStageSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node_name", read_only=True)

    class Meta:
        model = PlanStage
        fields = [
            "node",
            "role",
            "layer_start",
            "layer_end",
            "weights_bytes",
            "kv_bytes",
            "compute_bytes",
            "overhead_bytes",
            "total_bytes",
            "n_gpu_layers",
            "endpoint",
        ]
        read_only_fields = fields


class ShardPlanSerializer(serializers.ModelSerializer):
    stages = PlanStageSerializer(many=True, read_only=True)

    class Meta:
        model = ShardPlan
        fields = [
            "id",
            "kind",
            "split_mode",
            "n_gpu_layers",
            "tensor_split",
            "needed_bytes",
            "reasons",
            "warnings",
            "stages",
            "created_at",
        ]
        read_only_fields = fields


class PlanPreviewSerializer(serializers.Serializer):
    """The planner's answer before anything is deployed (nothing is stored)."""

    kind = serializers.ChoiceField(choices=["replicas", "split", "refused"])
    split_mode = serializers.CharField()
    n_gpu_layers = serializers.IntegerField()
    tensor_split = serializers.ListField(child=serializers.FloatField())
    needed_bytes = serializers.IntegerField()
    reasons = serializers.ListField(child=serializers.CharField())
    warnings = serializers.ListField(child=serializers.CharField())
    error = serializers.CharField()
    stages = serializers.ListField(child=serializers.DictField())
    copies = serializers.ListField(
        child=serializers.DictField(),
        help_text="Further copies of a split with several replicas, each in this same shape.",
    )
    nodes = serializers.ListField(
        child=serializers.DictField(),
        help_text="For drawing: the plan's nodes (a refusal: the roomiest ready ones) with "
        "name, free_bytes (for new work), memory_total_bytes and ready.",
    )
    links = serializers.ListField(
        child=serializers.DictField(),
        help_text="Measured links between those nodes: source, target, rtt_ms, mbit_s, slow.",
    )


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = DeploymentEvent
        fields = ["created_at", "level", "message"]
        read_only_fields = fields


class AutoscalingSerializer(serializers.ModelSerializer):
    """A deployment's autoscaling policy; on write, fields left out keep their values."""

    class Meta:
        model = ScalingPolicy
        fields = [*autoscaling.FIELDS, "last_scaled_at", "last_desired", "last_reason"]
        read_only_fields = ["last_scaled_at", "last_desired", "last_reason"]
        extra_kwargs = {
            "min_replicas": {"max_value": Deployment.MAX_REPLICAS},
            "max_replicas": {"min_value": 1, "max_value": Deployment.MAX_REPLICAS},
            "target": {"min_value": 0.001, "max_value": 1000},
            "window_seconds": {"min_value": 5, "max_value": 3600},
            "scale_down_delay_seconds": {"max_value": 86400},
            "cooldown_seconds": {"max_value": 3600},
        }


class DeploymentSerializer(serializers.ModelSerializer):
    model = serializers.SlugRelatedField(slug_field="name", read_only=True)
    autoscaling = serializers.SerializerMethodField()
    replica_set = ReplicaSerializer(many=True, read_only=True)
    plan = serializers.SerializerMethodField()
    recent_events = serializers.SerializerMethodField()

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "model",
            "replicas",
            "context_length",
            "parallel",
            "routing_policy",
            "batching",
            "swa_cache",
            "split_mode",
            "pin_nodes",
            "restart_policy",
            "autoscaling",
            "restarts",
            "next_restart_at",
            "state",
            "error",
            "plan",
            "replica_set",
            "recent_events",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    def get_plan(self, d) -> dict | None:
        """The plan the newest live replica came from (else the newest plan); read from the
        replicas already loaded (prefetched by the console's snapshot)."""
        live = [r for r in d.replica_set.all() if r.state in Replica.LIVE and r.plan_id]
        plan = max(live, key=lambda r: r.created_at).plan if live else d.plans.first()
        return ShardPlanSerializer(plan).data if plan else None

    def get_autoscaling(self, d) -> dict | None:
        try:
            policy = d.autoscaling
        except ScalingPolicy.DoesNotExist:
            return None
        return AutoscalingSerializer(policy).data

    def get_recent_events(self, d) -> list[dict]:
        return EventSerializer(d.events.all()[:10], many=True).data


class CreateDeploymentSerializer(serializers.Serializer):
    name = serializers.SlugField(required=False, help_text="Defaults to the model name.")
    model = serializers.SlugField(help_text="Catalog name of a ready model.")
    replicas = serializers.IntegerField(default=1, min_value=1, max_value=Deployment.MAX_REPLICAS)
    context_length = serializers.IntegerField(
        required=False, min_value=Deployment.MIN_CONTEXT, max_value=Deployment.MAX_CONTEXT
    )
    parallel = serializers.IntegerField(
        required=False, min_value=1, max_value=Deployment.MAX_PARALLEL
    )
    routing_policy = serializers.ChoiceField(
        choices=Deployment.Routing.choices,
        required=False,
        help_text="Defaults to prefix for models with a chat template, else least_connections.",
    )
    batching = serializers.ChoiceField(
        choices=Deployment.Batching.choices, default=Deployment.Batching.THROUGHPUT
    )
    swa_cache = serializers.ChoiceField(
        choices=Deployment.SwaCache.choices,
        default=Deployment.SwaCache.WINDOW,
        help_text="Sliding-window models: window (far less KV) or full (any shared prefix "
        "reusable). The invariant mode keeps the full cache.",
    )
    split_mode = serializers.ChoiceField(
        choices=Deployment.SplitMode.choices,
        default=Deployment.SplitMode.AUTO,
        help_text="auto: whole replicas when a node holds the model, else a layer split.",
    )
    pin_nodes = serializers.ListField(
        child=serializers.CharField(max_length=100),
        required=False,
        default=list,
        help_text="Only these nodes; the first is the head of a split.",
    )
    restart_policy = serializers.ChoiceField(
        choices=Deployment.Restart.choices, default=Deployment.Restart.ALWAYS
    )
    autoscaling = AutoscalingSerializer(
        required=False, help_text="Replicas follow the load between min and max (min 0 allowed)."
    )


class PlanRequestSerializer(CreateDeploymentSerializer):
    name = None
    routing_policy = None
    restart_policy = None
    autoscaling = None


class ScaleSerializer(serializers.Serializer):
    replicas = serializers.IntegerField(min_value=1, max_value=Deployment.MAX_REPLICAS)
