from rest_framework import serializers

from apps.accounts.models import ApiKey

LIMITS = ["requests_per_minute", "tokens_per_day", "tokens_per_month"]


class ApiKeySerializer(serializers.ModelSerializer):
    """A key; its limits (quotas) can be set by staff only."""

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "app",
            *LIMITS,
            "prefix",
            "created_at",
            "last_used_at",
            "revoked_at",
        ]
        read_only_fields = ["prefix", "created_at", "last_used_at", "revoked_at"]

    def validate(self, attrs):
        request = self.context.get("request")
        if any(k in attrs for k in LIMITS) and not (request and request.user.is_staff):
            raise serializers.ValidationError({"detail": "only staff can set a key's limits"})
        return attrs


class NewApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The key itself; shown only once.")

    class Meta(ApiKeySerializer.Meta):
        fields = ApiKeySerializer.Meta.fields + ["key"]
