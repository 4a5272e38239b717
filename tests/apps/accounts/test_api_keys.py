"""API keys: hashed at rest, scoped to their owner, revocable, printable from the CLI."""

import asyncio
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
    assert client_with(raw).get("/api/v1/api-keys/").status_code == 200
    assert client_with(raw).get("/api/v1/nodes/").status_code == 403  # an application's key


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
    resp = client_with(alice_key).get("/api/v1/usage/")
    assert resp.status_code == 401
    assert "revoked" in resp.json()["detail"]


def test_charlie_with_a_made_up_key_is_refused():
    assert client_with("lf-not-a-real-key-at-all-000000").get("/api/v1/nodes/").status_code == 401


def test_create_api_key_command_prints_a_working_key():
    out = StringIO()
    call_command("create_api_key", "ops", stdout=out)
    raw = out.getvalue().strip()
    assert raw.startswith("lf-")
    assert client_with(raw).get("/api/v1/models/").status_code == 200  # the admin's key
    # A fixed bootstrap key is created once and reused.
    fixed = "lf-bootstrap-key-for-tests-0001"
    for _ in range(2):
        call_command("create_api_key", "bootstrap", "--key", fixed, stdout=StringIO())
    assert ApiKey.objects.filter(key_hash=hash_key(fixed)).count() == 1


# ---- minting: an application's key never makes a key with more than it has ---------------------


def test_an_applications_key_mints_keys_no_looser_than_itself(alice):
    from apps.accounts.services import create_key

    _, raw = create_key(
        "limited", owner=alice, app="shop", requests_per_minute=10, tokens_per_day=500
    )
    c = client_with(raw)
    # Without limits given, the new key inherits the minting key's limits and app.
    made = c.post("/api/v1/api-keys/", {"name": "child"}, format="json")
    assert made.status_code == 201, made.json()
    body = made.json()
    assert (body["requests_per_minute"], body["tokens_per_day"], body["app"]) == (10, 500, "shop")
    # Tighter is fine; looser, or no limit where there is one, is refused by name.
    assert (
        c.post("/api/v1/api-keys/", {"name": "t", "tokens_per_day": 100}, format="json").status_code
        == 201
    )
    for field, value in (("tokens_per_day", 501), ("requests_per_minute", None)):
        resp = c.post("/api/v1/api-keys/", {"name": "loose", field: value}, format="json")
        assert resp.status_code == 400 and field in resp.json(), resp.json()
    # Loosening an existing key, or moving it to another app or owner, is refused too.
    child = body["id"]
    assert (
        c.patch(f"/api/v1/api-keys/{child}/", {"tokens_per_day": 9999}, format="json").status_code
        == 400
    )
    assert c.patch(f"/api/v1/api-keys/{child}/", {"app": "other"}, format="json").status_code == 400
    assert (
        c.patch(f"/api/v1/api-keys/{child}/", {"owner": "olga"}, format="json").status_code == 400
    )
    assert (
        c.patch(f"/api/v1/api-keys/{child}/", {"tokens_per_day": 50}, format="json").json()[
            "tokens_per_day"
        ]
        == 50
    )


def test_a_session_without_a_key_cannot_mint_for_an_application(alice):
    c = APIClient()
    c.force_login(alice)
    assert c.post("/api/v1/api-keys/", {"name": "x"}, format="json").status_code == 403


def test_operators_see_and_set_everyones_keys(api, alice, olga, ops, django_user_model):
    alices = api.get("/api/v1/api-keys/").json()["results"][0]["id"]
    assert {k["owner"] for k in ops.get("/api/v1/api-keys/").json()["results"]} == {"alice", "olga"}
    assert [k["owner"] for k in ops.get("/api/v1/api-keys/?owner=alice").json()["results"]] == [
        "alice"
    ]
    patched = ops.patch(f"/api/v1/api-keys/{alices}/", {"tokens_per_day": 1000}, format="json")
    assert patched.status_code == 200 and patched.json()["tokens_per_day"] == 1000
    made = ops.post(
        "/api/v1/api-keys/", {"name": "for alice", "owner": "alice", "app": "shop"}, format="json"
    )
    assert (
        made.status_code == 201 and made.json()["owner"] == "alice" and made.json()["app"] == "shop"
    )
    # An operator may not mint a key for another operator (that would be the admin's call).
    django_user_model.objects.create_user("oscar", is_staff=True)
    assert (
        ops.post("/api/v1/api-keys/", {"name": "x", "owner": "oscar"}, format="json").status_code
        == 400
    )


def test_keys_seen_lately_work_while_the_database_is_away(alice_key, django_assert_num_queries):
    """Once the database failed to answer, a key this process checked lately is taken from
    memory (no query, no wait on the pool) until the database answers again; a key never
    seen is not."""
    from apps.accounts import services
    from controlplane import db

    key = services.authenticate_key(alice_key)
    assert key is not None
    try:
        db.mark_unreachable()
        with django_assert_num_queries(0):
            assert services.authenticate_key(alice_key).pk == key.pk
        assert services.authenticate_key("lf-never-seen-key-000000000000") is None  # asks
    finally:
        db._unreachable_until = 0.0
    assert services.authenticate_key(alice_key).pk == key.pk


def test_a_key_checked_within_the_last_second_costs_no_query(
    alice_key, clock, django_assert_num_queries, settings
):
    """The serving hot path asks the database nothing per request: a key checked less
    than KEY_CACHE_SECONDS ago is taken as it was. A revocation through this process is
    refused at once; one made elsewhere (here raw SQL, which sends no signal, as another
    web process's write would look) once that second has passed."""
    from django.db import connection

    from apps.accounts import services

    settings.KEY_CACHE_SECONDS = 1.0
    key = services.authenticate_key(alice_key)
    with django_assert_num_queries(0):
        assert services.authenticate_key(alice_key).pk == key.pk
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {ApiKey._meta.db_table} SET revoked_at = %s WHERE id = %s",
            [key.created_at, key.pk],
        )
    assert services.authenticate_key(alice_key) is not None  # another process's change
    clock.shift(1.5)
    assert services.authenticate_key(alice_key) is None  # seen within the second

    other = ApiKey.objects.get(pk=key.pk)
    other.revoked_at = None
    other.save(update_fields=["revoked_at"])
    assert services.authenticate_key(alice_key).pk == key.pk
    services.revoke_key(other)  # through this process: refused at once
    assert services.authenticate_key(alice_key) is None
    other.revoked_at = None
    other.save(update_fields=["revoked_at"])
    assert services.authenticate_key(alice_key).pk == key.pk
    other.owner.is_active = False
    other.owner.save()  # the owner deactivated: at once too
    assert services.authenticate_key(alice_key) is None


@pytest.mark.django_db(transaction=True)  # the check's pool thread sees committed rows only
async def test_a_steady_client_never_waits_for_its_key_and_a_revocation_still_lands(
    alice_key, clock, settings
):
    """check_key, the serving path's: past half of KEY_CACHE_SECONDS a key is served from
    memory and checked again in the background, whose answer the next requests get. A key
    revoked elsewhere (raw SQL: no signal, as another process's write looks) is refused
    after that check, before KEY_CACHE_SECONDS have passed since the first."""
    from asgiref.sync import sync_to_async
    from django.db import connection

    from apps.accounts import services

    settings.KEY_CACHE_SECONDS = 1.0
    key = await services.check_key(alice_key)  # the first check waits for its query
    assert key is not None

    def revoke_elsewhere():
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {ApiKey._meta.db_table} SET revoked_at = %s WHERE id = %s",
                [key.created_at, key.pk],
            )

    await sync_to_async(revoke_elsewhere)()
    assert (await services.check_key(alice_key)).pk == key.pk  # within half: from memory
    assert not services._tasks, "no background check within the first half"
    clock.shift(0.6)
    assert (await services.check_key(alice_key)).pk == key.pk  # served, and checked again
    assert len(services._tasks) == 1
    assert (await services.check_key(alice_key)).pk == key.pk
    assert len(services._tasks) == 1, "one background check per key at a time"
    await asyncio.gather(*services._tasks)
    assert await services.check_key(alice_key) is None  # 0.6 s after the first check
    assert await services.check_key("lf-never-seen-key-000000000000") is None
