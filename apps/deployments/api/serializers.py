from rest_framework import serializers

from apps.deployments.models import Deployment, DeploymentEvent, Replica


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


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = DeploymentEvent
        fields = ["created_at", "level", "message"]
        read_only_fields = fields


class DeploymentSerializer(serializers.ModelSerializer):
    model = serializers.SlugRelatedField(slug_field="name", read_only=True)
    replica_set = ReplicaSerializer(many=True, read_only=True)
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
            "shared_kv",
            "state",
            "error",
            "replica_set",
            "recent_events",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    def get_recent_events(self, d) -> list[dict]:
        return EventSerializer(d.events.all()[:10], many=True).data


class CreateDeploymentSerializer(serializers.Serializer):
    name = serializers.SlugField(required=False, help_text="Defaults to the model name.")
    model = serializers.SlugField(help_text="Catalog name of a ready model.")
    replicas = serializers.IntegerField(default=1, min_value=1, max_value=64)
    context_length = serializers.IntegerField(required=False, min_value=16)
    parallel = serializers.IntegerField(required=False, min_value=1, max_value=256)
    routing_policy = serializers.ChoiceField(
        choices=Deployment.Routing.choices, default=Deployment.Routing.LEAST_CONNECTIONS
    )
    shared_kv = serializers.BooleanField(
        default=False, help_text="Faster under load; greedy text may vary with load."
    )


class ScaleSerializer(serializers.Serializer):
    replicas = serializers.IntegerField(min_value=1, max_value=64)
