"""A request's record: admitted on arrival, completed once at the end, in as few queries."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.usage import services
from apps.usage.models import UsageRecord

pytestmark = pytest.mark.django_db


def usage(request_id: str, **fields) -> services.Usage:
    return services.Usage(request_id, None, "chat", "m", deployment="d", **fields)


def test_an_admitted_record_is_completed_by_one_update():
    services.admit(usage("r1"))
    assert UsageRecord.objects.get(request_id="r1").outcome == UsageRecord.Outcome.RUNNING
    done = usage("r1", prompt_tokens=7, completion_tokens=3, outcome="ok", duration=0.5)
    with CaptureQueriesContext(connection) as queries:
        services.record(done)
    # Once per request on every web process: nothing is read back.
    assert [q["sql"].split()[0] for q in queries.captured_queries] == ["UPDATE"]
    r = UsageRecord.objects.get(request_id="r1")
    assert (r.outcome, r.prompt_tokens, r.completion_tokens) == ("ok", 7, 3)
    assert r.finished_at is not None


def test_a_record_never_admitted_is_stored_and_the_first_final_one_stays():
    services.record(usage("r2", completion_tokens=5, outcome="ok"))
    services.record(usage("r2", completion_tokens=9, outcome="error", error_code="x"))
    services.admit(usage("r2"))  # an admission that arrives late changes nothing
    [r] = UsageRecord.objects.filter(request_id="r2")
    assert (r.outcome, r.completion_tokens, r.error_code) == ("ok", 5, "")
