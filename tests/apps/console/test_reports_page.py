"""The console's report page: login, staff only, charts' data, the form, safe rendering."""

from datetime import UTC, datetime, timedelta

import pytest

from apps.usage.models import Report, UsageRecord

pytestmark = pytest.mark.django_db

DAY = datetime(2026, 11, 20, tzinfo=UTC)
EVIL = "<img src=x onerror=alert(1)>"


@pytest.fixture
def staff(alice, client):
    alice.is_staff = True
    alice.save()
    client.force_login(alice)
    return client


def test_the_page_needs_a_staff_login(client, alice):
    resp = client.get("/console/reports/")
    assert resp.status_code == 302 and resp["Location"].startswith("/console/login/")
    login = client.get(resp["Location"])
    assert login.status_code == 200 and b"csrfmiddlewaretoken" in login.content
    ok = client.post(
        "/console/login/?next=/console/reports/",
        {"username": "alice", "password": "alice-password-123", "next": "/console/reports/"},
    )
    assert ok.status_code == 302
    # alice is not staff: sent back to the login page.
    assert client.get("/console/reports/")["Location"].startswith("/console/login/")


def test_a_report_renders_with_its_figures_and_chart_data_escaped(staff):
    from apps.usage.services import save_report

    UsageRecord.objects.create(
        request_id="x", endpoint="chat", model=EVIL, deployment="d", prompt_tokens=5,
        completion_tokens=7, outcome="ok", started_at=DAY + timedelta(hours=3),
    )  # fmt: skip
    report = save_report(Report.Kind.DAILY, DAY, DAY + timedelta(days=1))
    page = staff.get(f"/console/reports/{report.pk}/").content.decode()
    assert "Daily report: 2026-11-20 00:00" in page and "<b>12</b>" in page
    assert 'id="report-data"' in page and "chart-cost" in page
    assert EVIL not in page  # in tables escaped, in the JSON for the charts escaped too
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert f"/api/v1/reports/{report.pk}/csv/" in page


def test_the_form_makes_a_report_for_a_period(staff):
    resp = staff.post("/console/reports/", {"start": "2026-11-01", "end": "2026-11-08"})
    report = Report.objects.get(kind="custom")
    assert resp.status_code == 302 and resp["Location"] == f"/console/reports/{report.pk}/"
    assert (report.start, report.end) == (
        datetime(2026, 11, 1, tzinfo=UTC),
        datetime(2026, 11, 8, tzinfo=UTC),
    )
    assert len(report.data["series"]) == 7  # days, for a week
    bad = staff.post("/console/reports/", {"start": "2026-11-08", "end": "2026-11-01"}, follow=True)
    assert b"Not a period of days" in bad.content


def test_the_forms_need_csrf(alice):
    from django.test import Client

    alice.is_staff = True
    alice.save()
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    assert (
        client.post("/console/reports/", {"start": "2026-11-01", "end": "2026-11-02"}).status_code
        == 403
    )


def test_static_files_are_served_without_a_build_step(client):
    resp = client.get("/static/console/vendor/chart.umd.min.js")
    assert resp.status_code == 200
    assert b"Chart.js v4" in b"".join(resp.streaming_content)[:200]
