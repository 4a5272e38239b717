import pytest


@pytest.fixture(autouse=True)
def clean_quota_counters(settings):
    """Quota counts are keyed by application (user) id, which a new test database reuses."""
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL)
    for pattern in ("llamafleet:tokens:*", "llamafleet:rpm:*"):
        keys = list(client.scan_iter(pattern))
        if keys:
            client.delete(*keys)
    client.close()
