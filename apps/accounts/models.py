"""API keys: only a hash is stored; the key is shown once, when it is created."""

import hashlib
import secrets

from django.conf import settings
from django.db import models

from controlplane.querysets import SignallingQuerySet

KEY_PREFIX = "lf-"


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiKeyQuerySet(SignallingQuerySet):
    def active(self):
        return self.filter(revoked_at__isnull=True)


class ApiKey(models.Model):
    """A bearer key for the REST, OpenAI-compatible and websocket APIs."""

    name = models.CharField(max_length=100, help_text="What the key is for (an app, a person).")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys"
    )
    prefix = models.CharField(
        max_length=16, db_index=True, help_text="First characters, to recognise a key."
    )
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    app = models.CharField(
        max_length=100, blank=True, help_text="The application the key belongs to, for reports."
    )
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Most requests in any 60 s; empty for no limit."
    )
    tokens_per_day = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Most tokens (prompt + completion) per UTC day."
    )
    tokens_per_month = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Most tokens per calendar month (UTC)."
    )

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.name} ({self.prefix}…)"

    @classmethod
    def generate(cls, name: str, owner, raw: str | None = None) -> tuple["ApiKey", str]:
        """Create a key; returns the row and the only copy of the raw key."""
        raw = raw or KEY_PREFIX + secrets.token_urlsafe(32)
        key = cls.objects.create(name=name, owner=owner, prefix=raw[:10], key_hash=hash_key(raw))
        return key, raw
