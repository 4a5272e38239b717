from django.contrib.auth import get_user_model
from rest_framework import serializers

from apps.accounts.models import ApiKey
from apps.accounts.permissions import is_operator

LIMITS = ["requests_per_minute", "tokens_per_day", "tokens_per_month"]


def _looser(new: int | None, bound: int | None) -> bool:
    """Whether limit `new` allows more than `bound` (None is no limit)."""
    return bound is not None and (new is None or new > bound)


class ApiKeySerializer(serializers.ModelSerializer):
    """A key. Operators set anything, for any application. An application's key may mint keys
    for its own application and tighten limits, never loosen them: a new key's limits are at
    most those of the key that made it, and its app is that key's app."""

    owner = serializers.SlugRelatedField(
        slug_field="username",
        queryset=get_user_model().objects.filter(is_active=True),
        required=False,
        help_text="The application (account) the key belongs to; operators only. "
        "Defaults to the caller.",
    )
    name = serializers.CharField(max_length=100)
    app = serializers.CharField(max_length=100, required=False, allow_blank=True)

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "owner",
            "app",
            *LIMITS,
            "prefix",
            "created_at",
            "last_used_at",
            "revoked_at",
        ]
        read_only_fields = ["prefix", "created_at", "last_used_at", "revoked_at"]
        extra_kwargs = {k: {"max_value": 2**53} for k in LIMITS}

    def validate(self, attrs):
        request = self.context["request"]
        user = request.user
        if is_operator(user):
            owner = attrs.get("owner")
            if owner is not None and owner.is_staff and owner != user and not user.is_superuser:
                raise serializers.ValidationError(
                    {"owner": "only the admin may make keys for another operator"}
                )
            return attrs
        if "owner" in attrs and attrs["owner"] != user:
            raise serializers.ValidationError({"owner": "an application makes keys for itself"})
        if "app" in attrs and (self.instance is None or attrs["app"] != self.instance.app):
            raise serializers.ValidationError({"app": "only operators set a key's app"})
        minting = request.auth if isinstance(request.auth, ApiKey) else None
        for field in LIMITS:
            bounds = [getattr(k, field) for k in (minting, self.instance) if k is not None]
            new = attrs.get(field, getattr(self.instance, field, None) if self.instance else None)
            if self.instance is None and field not in attrs and bounds:
                attrs[field] = new = min((b for b in bounds if b is not None), default=None)
            if any(_looser(new, b) for b in bounds):
                raise serializers.ValidationError(
                    {field: "a key may not allow more than the key that makes or holds it"}
                )
        return attrs


class NewApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The key itself; shown only once.")

    class Meta(ApiKeySerializer.Meta):
        fields = ApiKeySerializer.Meta.fields + ["key"]
