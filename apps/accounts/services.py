"""Authenticating and managing API keys."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import DatabaseError
from django.utils import timezone

from apps.accounts.models import ApiKey, hash_key
from controlplane.db import database_unreachable, in_pool_thread, mark_unreachable

log = logging.getLogger(__name__)

#: last_used_at is a hint for people, not an audit log: write it at most this often.
_TOUCH_EVERY = timedelta(minutes=1)


#: Keys this process authenticated lately, by hash: while the database does not answer
#: (a restart, a failover), they keep working for this long after they were last checked.
#: A key revoked during the outage is refused once the database is back.
STALE_IF_ERROR = timedelta(minutes=10)
_MAX_REMEMBERED = 10_000
_remembered: dict[str, tuple[ApiKey, object]] = {}


def authenticate_key(raw: str, fresh: bool = False) -> ApiKey | None:
    """The active key matching a raw bearer value, or None.

    A key checked less than KEY_CACHE_SECONDS ago is taken as it was, without a query: the
    hot path asks the database nothing per request. A change to a key or a user in this
    process forgets what it checked at once (signals, below); other processes see it within
    that time, as they see routing changes. fresh: ask the database whatever was checked.

    A key is remembered as of when its query began, so a check that began before a
    revocation and ended after it still expires within KEY_CACHE_SECONDS of it."""
    if not raw:
        return None
    digest = hash_key(raw)
    now = timezone.now()
    known = _remembered.get(digest)
    if not fresh and known is not None and _within_cache(known, now):
        return known[0]
    fresh_enough = known is not None and now - known[1] <= STALE_IF_ERROR
    if fresh_enough and database_unreachable():
        return known[0]
    try:
        key = ApiKey.objects.active().select_related("owner").filter(key_hash=digest).first()
    except DatabaseError:
        mark_unreachable()
        if not fresh_enough:
            raise
        log.warning("database unreachable: key %s accepted as checked at %s", known[0].prefix,
                    known[1])  # fmt: skip
        return known[0]
    if key is None or not key.owner.is_active:
        _remembered.pop(digest, None)
        return None
    if len(_remembered) >= _MAX_REMEMBERED:
        _remembered.clear()
    _remembered[digest] = (key, now)
    if key.last_used_at is None or now - key.last_used_at > _TOUCH_EVERY:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
    return key


def _within_cache(known: tuple[ApiKey, datetime], now: datetime) -> bool:
    """Whether a remembered (key, checked at) was checked less than KEY_CACHE_SECONDS ago."""
    return now - known[1] <= timedelta(seconds=settings.KEY_CACHE_SECONDS)


_refreshing: set[str] = set()  # digests being checked again in the background
_tasks: set[asyncio.Task] = set()


async def check_key(raw: str) -> ApiKey | None:
    """authenticate_key for async callers (the serving path), the query in a pool thread.

    A key checked in the last KEY_CACHE_SECONDS is taken without a query, as in
    authenticate_key; past half of that it is checked again in the background, so that a
    steady client never waits for the database on its way to the first token (1.5 to 3 ms
    here, most of it Django's query compiler, on the same cores as the engine). Nothing is
    accepted later than before: the background check refuses a revoked key for the
    requests after it, and a key not checked within KEY_CACHE_SECONDS waits for its query.
    """
    digest = hash_key(raw) if raw else ""
    known = _remembered.get(digest)
    now = timezone.now()
    if known is None or not _within_cache(known, now):  # no I/O before this: no thread hop
        return await in_pool_thread(authenticate_key)(raw)
    key, checked_at = known
    half = timedelta(seconds=settings.KEY_CACHE_SECONDS / 2)
    if now - checked_at > half and digest not in _refreshing:
        _refreshing.add(digest)
        task = asyncio.get_running_loop().create_task(_check_again(raw, digest))
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
    return key


async def _check_again(raw: str, digest: str) -> None:
    try:
        await in_pool_thread(authenticate_key)(raw, fresh=True)
    except DatabaseError as exc:  # the next request past KEY_CACHE_SECONDS asks again
        log.warning("API key %s not checked again: %s", digest[:8], exc)
    finally:
        _refreshing.discard(digest)


def forget_keys(sender=None, instance=None, **_kwargs) -> None:
    """Drop what this process remembers of a key that changed (of all, for anything else:
    a user deactivated, a bulk update)."""
    if isinstance(instance, ApiKey) and instance.key_hash:
        _remembered.pop(instance.key_hash, None)
    else:
        _remembered.clear()


def connect_signals() -> None:
    from django.db.models.signals import post_delete, post_save

    from controlplane.querysets import rows_updated

    for sender in (ApiKey, get_user_model()):
        uid = f"key-cache-{sender.__name__}"
        post_save.connect(forget_keys, sender=sender, dispatch_uid=uid)
        post_delete.connect(forget_keys, sender=sender, dispatch_uid=uid)
    rows_updated.connect(_forget_on_update, sender=ApiKey, dispatch_uid="key-cache-update")


def _forget_on_update(fields=frozenset(), **_kwargs) -> None:
    if fields != {"last_used_at"}:  # the touch below changes nothing a check reads
        _remembered.clear()


def bearer_from_header(value: str) -> str:
    """The token of an `Authorization: Bearer <token>` header, or ""."""
    scheme, _, token = (value or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def create_key(name: str, owner=None, raw: str | None = None, **fields) -> tuple[ApiKey, str]:
    """Create a key for owner (by default the first superuser, created if needed); fields
    are its app and limits."""
    if owner is None:
        owner = ensure_admin_user()
    key, raw = ApiKey.generate(name, owner, raw)
    if fields:
        for k, v in fields.items():
            setattr(key, k, v)
        key.save(update_fields=list(fields))
    return key, raw


def ensure_admin_user(username: str = "admin"):
    """The operator account that owns keys made from the command line."""
    User = get_user_model()
    user = User.objects.filter(is_superuser=True).order_by("pk").first()
    if user is None:
        user = User.objects.create_superuser(username=username, email="", password=None)
    return user


def revoke_key(key: ApiKey) -> None:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
