"""`manage.py create_api_key NAME` prints a new API key (shown only this once)."""

from django.core.management.base import BaseCommand, CommandError

from apps.accounts.models import KEY_PREFIX, ApiKey, hash_key
from apps.accounts.services import create_key


class Command(BaseCommand):
    help = "Create an API key and print it. Only its hash is stored."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument(
            "--key",
            default="",
            help=f"use this value instead of a random one (must start with {KEY_PREFIX}); "
            "an existing key with this value is kept",
        )

    def handle(self, name, key, **options):
        if key:
            if not key.startswith(KEY_PREFIX) or len(key) < 24:
                raise CommandError(
                    f"--key must start with {KEY_PREFIX} and be at least 24 characters"
                )
            if ApiKey.objects.active().filter(key_hash=hash_key(key)).exists():
                self.stdout.write(key)
                return
        _, raw = create_key(name, raw=key or None)
        self.stdout.write(raw)
