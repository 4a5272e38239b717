"""Node-hours from heartbeats, cost reports checked against numbers computed by hand, and the
report schedule running through beat, the real broker and a worker."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from apps.usage import services
from apps.usage.models import NodeUsage, Report, UsageRecord
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db

DAY = datetime(2026, 11, 20, tzinfo=UTC)
GiB = 2**30


def test_heartbeats_become_node_hours_with_who_held_the_memory(settings):
    from apps.catalog.models import CatalogModel
    from apps.deployments.models import Deployment, Replica
    from apps.nodes.models import Node

    settings.HEARTBEAT_TIMEOUT_SECONDS = 20
    node = Node.objects.create(
        name="n1", address="10.0.0.1:1", price_per_hour=Decimal("3.60"), memory_total_bytes=GiB
    )
    model = CatalogModel.objects.create(name="m", source="test", sha256="0" * 64)
    d = Deployment.objects.create(name="dep", model=model, context_length=512, parallel=1)
    r = Replica.objects.create(deployment=d, node=node)
    report = [{"replica_id": str(r.pk), "memory_bytes": GiB // 4}]
    t0 = DAY + timedelta(hours=5)
    services.account_heartbeat(node, report, None, t0)  # registration: nothing to credit
    services.account_heartbeat(node, report, t0, t0 + timedelta(seconds=10))
    services.account_heartbeat(node, report, t0 + timedelta(seconds=10), t0 + timedelta(hours=1))
    [first, second] = NodeUsage.objects.order_by("hour")
    assert first.seconds == 10 and first.cost == Decimal("0.01")  # 10 s at 3.60 an hour
    assert first.held == {"dep": {"model": "m", "byte_seconds": 10 * GiB // 4}}
    # An hour of silence counts only up to the heartbeat timeout.
    assert second.seconds == 20 and second.hour == t0 + timedelta(hours=1)


@pytest.fixture
def fleet(db, alice):
    """Two nodes, two deployments and six requests on 2026-11-20, numbers chosen by hand."""
    from apps.accounts.services import create_key
    from apps.nodes.models import Node

    big = Node.objects.create(name="big", address="a:1")
    small = Node.objects.create(name="small", address="b:1")
    hour = DAY + timedelta(hours=10)
    # big: 2 hours at 2.00/h; "chat" held half its memory, "code" a quarter, a quarter idle.
    for h in range(2):
        NodeUsage.objects.create(
            node=big,
            node_name="big",
            hour=hour + timedelta(hours=h),
            seconds=3600,
            cost=Decimal("2.00"),
            memory_total_bytes=4 * GiB,
            held={
                "chat": {"model": "smol", "byte_seconds": 2 * GiB * 3600},
                "code": {"model": "gem", "byte_seconds": 1 * GiB * 3600},
            },
        )
    # small: half an hour at 1.00/h = 0.50, all idle.
    NodeUsage.objects.create(
        node=small,
        node_name="small",
        hour=hour,
        seconds=1800,
        cost=Decimal("0.50"),
        memory_total_bytes=GiB,
    )
    # Outside the day: must not count.
    NodeUsage.objects.create(
        node=big,
        node_name="big",
        hour=DAY + timedelta(days=1),
        seconds=3600,
        cost=Decimal("9"),
        memory_total_bytes=GiB,
    )
    web = create_key("web", owner=alice, app="web")[0]
    batch = create_key("batch", owner=alice, app="batch")[0]
    rows = [
        # key, deployment, model, prompt, completion, outcome
        (web, "chat", "smol", 100, 300, "ok"),
        (web, "chat", "smol", 50, 150, "migrated"),
        (batch, "chat", "smol", 200, 200, "ok"),
        (batch, "code", "gem", 400, 600, "ok"),
        (batch, "code", "gem", 10, 0, "error"),
        (web, "", "nope", 0, 0, "rejected"),
    ]
    for i, (key, dep, model, p, c, outcome) in enumerate(rows):
        UsageRecord.objects.create(
            request_id=f"r{i}",
            api_key=key,
            app=key.app,
            endpoint="chat",
            model=model,
            deployment=dep,
            nodes=["big"] if dep else [],
            prompt_tokens=p,
            completion_tokens=c,
            outcome=outcome,
            started_at=hour + timedelta(minutes=i),
        )
    UsageRecord.objects.create(
        request_id="late", endpoint="chat", model="smol", deployment="chat",
        prompt_tokens=1, completion_tokens=1, outcome="ok", started_at=DAY + timedelta(days=1),
    )  # fmt: skip
    return web, batch


def test_report_numbers_match_the_hand_computed_ones(fleet, settings):
    web, batch = fleet
    data = services.build_report(DAY, DAY + timedelta(days=1))
    t = data["totals"]
    assert t["requests"] == 6 and t["errors"] == 2 and t["tokens"] == 2010
    assert t["node_hours"] == 2.5 and t["cost"] == 4.5
    # Idle: a quarter of big (2 x 2.00 x 0.25 = 1.00) plus all of small (0.50).
    assert t["idle_cost"] == 1.5
    assert t["cost_per_million_tokens"] == pytest.approx(4.5 / 2010 * 1e6, abs=1e-6)
    chat, code = data["by_deployment"]["chat"], data["by_deployment"]["code"]
    assert chat["cost"] == 2.0 and chat["node_hours"] == 1.0 and chat["tokens"] == 1000
    assert code["cost"] == 1.0 and code["node_hours"] == 0.5 and code["tokens"] == 1010
    assert chat["cost_per_million_tokens"] == 2000.0
    assert data["by_model"]["smol"]["cost"] == 2.0 and data["by_model"]["gem"]["errors"] == 1
    assert data["by_model"]["nope"] == data["by_model"]["nope"] | {"requests": 1, "cost": 0.0}
    keys = {row["app"]: row for row in data["by_key"]}
    # chat's 2.00 split by tokens: web 600 of 1000, batch 400; batch also pays all of code.
    assert keys["web"]["cost"] == 1.2 and keys["batch"]["cost"] == 1.8
    assert keys["web"]["requests"] == 3 and keys["batch"]["tokens"] == 1410
    big = data["by_node"]["big"]
    assert big == {
        "node_hours": 2.0,
        "cost": 4.0,
        "idle_cost": 1.0,
        "utilisation": 0.75,
        "requests": 5,  # the failed request reached big too
        "completion_tokens": 1250,
    }
    assert data["by_node"]["small"]["utilisation"] == 0.0
    # Cost and tokens over the day's hours add up to the totals.
    series = data["series"]
    assert len(series) == 24 and series[10]["at"] == (DAY + timedelta(hours=10)).isoformat()
    assert (series[10]["cost"], series[11]["cost"]) == (2.5, 2.0)
    assert sum(p["tokens"] for p in series) == 2010


def test_a_report_rerun_gives_the_same_numbers_and_a_csv(fleet):
    from apps.nodes.models import Node
    from apps.nodes.services import remove_node

    first = services.save_report(Report.Kind.DAILY, DAY, DAY + timedelta(days=1))
    remove_node(Node.objects.get(name="big"))  # a removed node's past still counts
    again = services.save_report(Report.Kind.DAILY, DAY, DAY + timedelta(days=1))
    assert first.pk == again.pk and Report.objects.count() == 1
    assert again.data == first.data
    rows = list(csv.DictReader(io.StringIO(services.report_csv(again))))
    assert rows[0]["section"] == "totals" and rows[0]["cost"] == "4.5"
    assert {r["name"] for r in rows if r["section"] == "deployment"} == {"chat", "code"}
    assert len([r for r in rows if r["section"] == "key"]) == 2


def test_periods_are_the_last_complete_day_and_week():
    wednesday = datetime(2026, 11, 25, 15, 30, tzinfo=UTC)
    assert services.period("daily", wednesday) == (
        datetime(2026, 11, 24, tzinfo=UTC),
        datetime(2026, 11, 25, tzinfo=UTC),
    )
    assert services.period("weekly", wednesday) == (
        datetime(2026, 11, 16, tzinfo=UTC),
        datetime(2026, 11, 23, tzinfo=UTC),
    )


def test_reports_api_is_for_staff_with_json_and_csv(fleet, api, alice, client):
    body = {"start": DAY.isoformat(), "end": (DAY + timedelta(days=1)).isoformat()}
    assert api.post("/api/v1/reports/", body, format="json").status_code == 403
    alice.is_staff = True
    alice.save()
    made = api.post("/api/v1/reports/", body, format="json")
    assert made.status_code == 201 and made.json()["data"]["totals"]["cost"] == 4.5
    rid = made.json()["id"]
    assert api.get("/api/v1/reports/").json()["results"][0]["id"] == rid
    download = api.get(f"/api/v1/reports/{rid}/csv/")
    assert download.status_code == 200 and download["Content-Type"] == "text/csv"
    assert "attachment" in download["Content-Disposition"]
    bad = api.post("/api/v1/reports/", {"start": body["end"], "end": body["start"]}, format="json")
    assert bad.status_code == 400
    assert api.get("/api/v1/usage/?outcome=rejected").json()["count"] == 1
    assert client.get("/api/v1/reports/").status_code in (401, 403)


def test_node_prices_are_set_by_staff(api, alice, settings):
    from apps.nodes.models import Node

    Node.objects.create(name="gpu-1", address="x:1")
    body = {"price_per_hour": "1.2500", "currency": "EUR"}
    assert api.post("/api/v1/nodes/gpu-1/price/", body, format="json").status_code == 403
    alice.is_staff = True
    alice.save()
    resp = api.post("/api/v1/nodes/gpu-1/price/", body, format="json")
    assert resp.status_code == 200 and resp.json()["price_per_hour"] == "1.2500"
    bad = api.post("/api/v1/nodes/gpu-1/price/", {"price_per_hour": "-1"}, format="json")
    assert bad.status_code == 400


@pytest.mark.django_db(transaction=True)
def test_the_beat_schedule_runs_the_report_through_the_broker(celery_worker_thread):
    """The stack's beat scheduler (django-celery-beat's), the real Redis broker and a worker
    make a report."""
    import json

    # The migration puts the daily and weekly schedules in the database, editable in the admin
    # (run again here: transactional tests before this one emptied the tables).
    from importlib import import_module

    from celery.beat import EmbeddedService
    from django.apps import apps
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from controlplane.celery import app

    import_module("apps.usage.migrations.0002_report_schedules").create(apps, None)
    names = set(PeriodicTask.objects.values_list("name", flat=True))
    assert {"usage: daily report", "usage: weekly report"} <= names
    every_second = IntervalSchedule.objects.create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name="test: report every second",
        task="apps.usage.tasks.make_report",
        interval=every_second,
        kwargs=json.dumps({"kind": "daily"}),
    )
    beat = EmbeddedService(app, thread=True, scheduler_cls=app.conf.beat_scheduler)
    beat.start()
    try:
        start, end = services.period("daily")
        wait_for(lambda: Report.objects.filter(start=start).exists(), timeout=30, interval=0.2)
        report = Report.objects.get(kind="daily", start=start, end=end)
        assert report.data["totals"]["requests"] == 0
    finally:
        beat.stop()


def test_usage_filters_check_their_values(fleet, api, alice):
    """django-filter: a known outcome filters, an unknown one or a bad date is a 400 naming
    the parameter, and any UTC offset is taken (PostgreSQL alone refuses those past 15:59)."""
    alice.is_staff = True  # an operator sees every application's records
    alice.save()
    assert api.get("/api/v1/usage/?outcome=rejected").json()["count"] == 1
    bad = api.get("/api/v1/usage/?outcome=exploded")
    assert bad.status_code == 400 and "outcome" in bad.json()
    bad = api.get("/api/v1/usage/?since=yesterday")
    assert bad.status_code == 400
    assert bad.json() == {"since": ["must be an ISO 8601 date and time"]}
    far = api.get("/api/v1/usage/", {"since": "2000-01-01T00:00:00+23:00"})
    assert far.status_code == 200 and far.json()["count"] >= 1
    later = api.get("/api/v1/usage/", {"since": "2999-01-01T00:00:00Z"})
    assert later.status_code == 200 and later.json()["count"] == 0
