"""The fleet page's charts: points computed from real usage records and routing counters,
kept an hour in Redis, pushed to open dashboards; and every application's usage by key."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest

from apps.console import live, series
from apps.deployments.models import Deployment
from apps.usage.models import UsageRecord
from controlplane.redis import sync_client


@pytest.fixture
def chat(db, smollm2_model):
    return Deployment.objects.create(
        name="chat", model=smollm2_model, replicas=2, context_length=512, parallel=2,
        state=Deployment.State.READY,
    )  # fmt: skip


@pytest.fixture
def clean_series():
    sync_client().delete(series._key())
    yield
    sync_client().delete(series._key())


def finished(deployment: str, seconds_ago: float, now: float, **fields) -> UsageRecord:
    end = datetime.fromtimestamp(now - seconds_ago, UTC)
    fields = {"outcome": "ok", "completion_tokens": 10, "time_to_first_token_ms": 100.0} | fields
    return UsageRecord.objects.create(
        request_id=f"r{UsageRecord.objects.count()}", endpoint="chat", model="m",
        deployment=deployment, started_at=end - timedelta(seconds=2), finished_at=end,
        duration_ms=2000, **fields,
    )  # fmt: skip


def test_percentiles_are_nearest_rank():
    assert series.percentile([], 50) is None
    assert series.percentile([5.0], 95) == 5.0
    values = [float(v) for v in range(1, 101)]
    assert series.percentile(values, 50) == 50.0 and series.percentile(values, 95) == 95.0


def test_a_point_covers_the_requests_that_ended_in_its_step(chat):
    now = time.time()
    for ttft in (100.0, 200.0, 300.0, 400.0):
        finished("chat", 1, now, time_to_first_token_ms=ttft, completion_tokens=25)
    finished("chat", 2, now, outcome="error", completion_tokens=0, time_to_first_token_ms=None)
    finished("chat", series.STEP + 5, now, completion_tokens=1000)  # the step before: not here
    finished("other", 1, now, completion_tokens=1000)  # not a live deployment
    p = series.point(now)
    assert set(p["deployments"]) == {"chat"}
    figures = p["deployments"]["chat"]
    assert figures["tokens_per_s"] == 100 / series.STEP
    assert figures["ttft_p50_ms"] == 200.0 and figures["ttft_p95_ms"] == 400.0
    assert figures["requests"] == 5 and figures["errors"] == 1
    # No ready replica: nothing in flight, and the desired count is the deployment's.
    assert figures["replicas"] == 0 and figures["desired"] == 2 and figures["in_flight"] == 0


def test_points_are_kept_an_hour_and_pushed_to_open_dashboards(chat, clean_series):
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(live.GROUP, channel)
    try:
        start = time.time()
        for i in range(series.KEEP + 3):
            sync_client().rpush(series._key(), json.dumps({"t": start + i, "deployments": {}}))
        taken = series.record()
        kept = series.history()
        assert len(kept) == series.KEEP and kept[-1] == taken  # the oldest fell off
        assert kept[0]["t"] == start + 4
        sent = async_to_sync(layer.receive)(channel)
        assert sent["type"] == "series.point" and sent["point"] == taken
        assert "chat" in taken["deployments"]
    finally:
        async_to_sync(layer.group_discard)(live.GROUP, channel)


# ---- applications at a glance ----------------------------------------------------------------


def test_operators_see_every_keys_hourly_usage(ops, api, alice, olga):
    from apps.accounts.models import ApiKey

    key = ApiKey.objects.get(owner=alice)
    now = datetime.now(UTC)
    for hours_ago, tokens in ((0, 30), (0, 12), (5, 100), (30, 999)):
        UsageRecord.objects.create(
            request_id=f"u{hours_ago}-{tokens}", api_key=key, user=alice, app="shop",
            endpoint="chat", model="m", outcome="ok", prompt_tokens=tokens, completion_tokens=0,
            started_at=now - timedelta(hours=hours_ago),
        )  # fmt: skip
    body = ops.get("/api/v1/usage/by-key/?hours=24").json()
    assert len(body["hours"]) == 24
    (row,) = [k for k in body["keys"] if k["api_key"] == key.pk]
    assert row["owner"] == "alice" and row["app"] == "shop"
    assert row["tokens"][-1] == 42 and row["tokens"][-6] == 100 and row["total_tokens"] == 142
    assert row["requests"][-1] == 2 and row["total_requests"] == 3  # 30 h ago is outside
    # An application sees its own records through /usage/, never everyone's by key.
    assert api.get("/api/v1/usage/by-key/").status_code == 403
    assert ops.get("/api/v1/usage/by-key/?hours=0").status_code == 400
    assert ops.get("/api/v1/usage/by-key/?hours=abc").status_code == 400
