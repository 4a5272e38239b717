"""The OpenAPI contract, /v1 included, fuzzed with schemathesis: no 5xx, and every documented
response matches its schema. Time-boxed: a fixed seed (reproducible) and a random one (new
cases each run; Hypothesis prints the seed of a failure, to replay it with --hypothesis-seed).

Requests go through Django's WSGI handler in this process, as an operator (every route open to
it), against an empty fleet: /v1 requests that validate end at 404 model_not_found.
"""

from __future__ import annotations

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, connection
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, seed, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

# On SQLite a test's transaction holds the one write lock until it ends, and the usage
# writer's own connection would wait for it on every /v1 case: there each test commits.
pytestmark = pytest.mark.django_db(transaction=connection.vendor == "sqlite")

schema = schemathesis.openapi.from_dict(SchemaGenerator().get_schema(request=None, public=True))
schema.app = get_wsgi_application()

CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
FUZZ = settings(
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,  # no example database under the source tree
    max_examples=15,
)


@pytest.fixture
def operator_headers(db, olga_key, monkeypatch):
    from apps.nodes import tasks

    # Fuzzing must not queue real link measurements on the shared broker.
    monkeypatch.setattr(tasks.measure_links, "delay", lambda *a: type("J", (), {"id": "x"})())
    # As Django's test client does: the handler must not close the test's connection.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield {"Authorization": f"Bearer {olga_key}"}
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@schema.parametrize()
@FUZZ
@seed(20261130)
def test_contract_fixed_seed(case, operator_headers):
    case.call_and_validate(headers=operator_headers, checks=CHECKS)


@schema.parametrize()
@settings(FUZZ, max_examples=8)
def test_contract_random_seed(case, operator_headers):
    case.call_and_validate(headers=operator_headers, checks=CHECKS)
