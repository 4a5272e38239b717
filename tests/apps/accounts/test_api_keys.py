"""API keys: hashed at rest, scoped to their owner, revocable, printable from the CLI."""

from io import StringIO

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from apps.accounts.models import ApiKey, hash_key

pytestmark = pytest.mark.django_db


def client_with(key: str | None) -> APIClient:
    c = APIClient()
    if key:
        c.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return c


def test_every_api_endpoint_needs_a_key_but_health_does_not(client):
    for url in [
        "/api/v1/nodes/",
        "/api/v1/models/",
        "/api/v1/deployments/",
        "/api/v1/api-keys/",
        "/api/v1/pulls/",
        "/api/v1/schema",
    ]:
        assert client.get(url).status_code in (401, 403), url
    assert client.get("/healthz").json() == {"status": "ok"}


def test_alice_creates_a_key_that_is_stored_hashed_and_works(api, alice):
    resp = api.post("/api/v1/api-keys/", {"name": "ci"}, format="json")
    assert resp.status_code == 201
    raw = resp.json()["key"]
    row = ApiKey.objects.get(pk=resp.json()["id"])
    assert row.key_hash == hash_key(raw) and raw not in (row.key_hash, row.prefix)
    assert client_with(raw).get("/api/v1/nodes/").status_code == 200


def test_bob_does_not_see_or_revoke_alices_keys(api, bob):
    from apps.accounts.services import create_key

    _, bob_raw = create_key("bob's", owner=bob)
    bobs = client_with(bob_raw)
    alice_key_id = api.get("/api/v1/api-keys/").json()["results"][0]["id"]
    assert [k["name"] for k in bobs.get("/api/v1/api-keys/").json()["results"]] == ["bob's"]
    assert bobs.delete(f"/api/v1/api-keys/{alice_key_id}/").status_code == 404


def test_revoked_key_is_refused(api, alice_key):
    key_id = api.get("/api/v1/api-keys/").json()["results"][0]["id"]
    assert api.delete(f"/api/v1/api-keys/{key_id}/").status_code == 204
    resp = client_with(alice_key).get("/api/v1/nodes/")
    assert resp.status_code == 401
    assert "revoked" in resp.json()["detail"]


def test_charlie_with_a_made_up_key_is_refused():
    assert client_with("lf-not-a-real-key-at-all-000000").get("/api/v1/nodes/").status_code == 401


def test_create_api_key_command_prints_a_working_key():
    out = StringIO()
    call_command("create_api_key", "ops", stdout=out)
    raw = out.getvalue().strip()
    assert raw.startswith("lf-")
    assert client_with(raw).get("/api/v1/models/").status_code == 200
    # A fixed bootstrap key is created once and reused.
    fixed = "lf-bootstrap-key-for-tests-0001"
    for _ in range(2):
        call_command("create_api_key", "bootstrap", "--key", fixed, stdout=StringIO())
    assert ApiKey.objects.filter(key_hash=hash_key(fixed)).count() == 1
