from rest_framework import serializers

from apps.nodes.models import LinkJob, Node, NodeLink


class NodeSerializer(serializers.ModelSerializer):
    heartbeat_age_seconds = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "address",
            "state",
            "draining",
            "price_per_hour",
            "currency",
            "version",
            "features",
            "cpu_cores",
            "load_average",
            "accelerators",
            "rpc_servers",
            "memory_total_bytes",
            "memory_available_bytes",
            "memory_in_use_bytes",
            "in_flight",
            "reported_replicas",
            "registered_at",
            "last_heartbeat_at",
            "heartbeat_age_seconds",
        ]
        read_only_fields = fields

    def get_heartbeat_age_seconds(self, node) -> float | None:
        from django.utils import timezone

        if node.last_heartbeat_at is None:
            return None
        return round((timezone.now() - node.last_heartbeat_at).total_seconds(), 1)


class NodePriceSerializer(serializers.Serializer):
    price_per_hour = serializers.DecimalField(max_digits=10, decimal_places=4, min_value=0)
    currency = serializers.RegexField(r"^[A-Z]{3}$", required=False)


class NodeLinkSerializer(serializers.ModelSerializer):
    source = serializers.SlugRelatedField(slug_field="name", read_only=True)
    target = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = NodeLink
        fields = ["source", "target", "rtt_ms", "mbit_s", "error", "measured_at"]
        read_only_fields = fields


class LinkJobSerializer(serializers.ModelSerializer):
    progress = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = LinkJob
        fields = [
            "id", "state", "phase", "nodes", "pairs_done", "pairs_total", "progress", "error",
            "created_at", "started_at", "finished_at",
        ]  # fmt: skip
        read_only_fields = fields
