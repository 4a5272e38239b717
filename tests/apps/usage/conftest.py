import pytest


@pytest.fixture(autouse=True)
def clean_quota_counters(settings):
    """Quota counts are keyed by application (user) id, which a new test database reuses."""
    import redis

    from controlplane.redis import key

    client = redis.Redis.from_url(settings.REDIS_URL)
    for pattern in (key("tokens", "*"), key("rpm", "*")):
        keys = list(client.scan_iter(pattern))
        if keys:
            client.delete(*keys)
    client.close()
