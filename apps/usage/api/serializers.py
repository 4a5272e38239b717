from rest_framework import serializers

from apps.usage.models import Report, UsageRecord


class UsageRecordSerializer(serializers.ModelSerializer):
    class Meta:
        model = UsageRecord
        fields = [
            "request_id",
            "api_key",
            "app",
            "endpoint",
            "model",
            "deployment",
            "replicas",
            "nodes",
            "prompt_tokens",
            "completion_tokens",
            "time_to_first_token_ms",
            "duration_ms",
            "outcome",
            "error_code",
            "started_at",
        ]
        read_only_fields = fields


class ReportSerializer(serializers.ModelSerializer):
    class Meta:
        model = Report
        fields = ["id", "kind", "start", "end", "generated_at", "data"]
        read_only_fields = fields


class NewReportSerializer(serializers.Serializer):
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()

    def validate(self, attrs):
        if attrs["end"] <= attrs["start"]:
            raise serializers.ValidationError({"end": "must be after start"})
        if (attrs["end"] - attrs["start"]).days > 366:
            raise serializers.ValidationError({"end": "a report covers at most a year"})
        return attrs
