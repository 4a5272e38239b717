"""Every route, every method, every role: who gets in and who is refused.

Routes are read from the URL configuration, so a new route fails here until it is placed in
ROUTES with the least role that may call it. DRF views default to `Undeclared` (closed to all):
a view that names no role is refused to everyone, operators included, and fails here too.
"""

from __future__ import annotations

import re

import pytest
from django.urls import URLResolver, get_resolver

from tests.conftest import key_client

pytestmark = pytest.mark.django_db

ANON, NODE, APP, OPERATOR = "anonymous", "node", "application", "operator"
RANK = {ANON: 0, APP: 1, OPERATOR: 2}
METHODS = ["get", "post", "put", "patch", "delete"]

#: route -> the least role that may call it (NODE: the node token, and nothing else).
ROUTES = {
    "healthz": ANON,
    "readyz": ANON,
    "metrics": OPERATOR,
    "api/v1/api-keys/": APP,
    "api/v1/api-keys/{pk}/": APP,
    "api/v1/nodes/": OPERATOR,
    "api/v1/nodes/links/": OPERATOR,
    "api/v1/nodes/measure-links/": OPERATOR,
    "api/v1/link-jobs/": OPERATOR,
    "api/v1/link-jobs/{pk}/": OPERATOR,
    "api/v1/nodes/{name}/": OPERATOR,
    "api/v1/nodes/{name}/drain/": OPERATOR,
    "api/v1/nodes/{name}/price/": OPERATOR,
    "api/v1/nodes/{name}/undrain/": OPERATOR,
    "api/v1/agent/heartbeat": NODE,
    "api/v1/models/": OPERATOR,
    "api/v1/models/known/": OPERATOR,
    "api/v1/models/pull/": OPERATOR,
    "api/v1/models/{name}/": OPERATOR,
    "api/v1/models/{name}/quantize/": OPERATOR,
    "api/v1/pulls/": OPERATOR,
    "api/v1/pulls/{pk}/": OPERATOR,
    "api/v1/quantizations/": OPERATOR,
    "api/v1/quantizations/{pk}/": OPERATOR,
    "api/v1/agent/models/{sha256}/file": NODE,
    "api/v1/deployments/": OPERATOR,
    "api/v1/deployments/plan/": OPERATOR,
    "api/v1/deployments/{name}/": OPERATOR,
    "api/v1/deployments/{name}/events/": OPERATOR,
    "api/v1/deployments/{name}/plans/": OPERATOR,
    "api/v1/deployments/{name}/redeploy/": OPERATOR,
    "api/v1/deployments/{name}/scale/": OPERATOR,
    "api/v1/deployments/{name}/autoscaling/": OPERATOR,
    "api/v1/deployments/{name}/undeploy/": OPERATOR,
    "api/v1/usage/": APP,
    "api/v1/usage/by-key/": OPERATOR,
    "api/v1/usage/{request_id}/": APP,
    "api/v1/reports/": OPERATOR,
    "api/v1/reports/{pk}/": OPERATOR,
    "api/v1/reports/{pk}/csv/": OPERATOR,
    "api/v1/schema": APP,
    "api/v1/docs": APP,
    "v1/chat/completions": APP,
    "v1/completions": APP,
    "v1/embeddings": APP,
    "v1/models": APP,
}
#: The console's pages (a session, not a key): the least role that may open them.
CONSOLE = {
    "console/login/": ANON,
    "console/logout/": ANON,
    "console/": OPERATOR,
    "console/playground/": OPERATOR,
    "console/reports/": OPERATOR,
    "console/reports/{pk}/": OPERATOR,
}
#: Path parameters: objects that do not exist (a dotted name, to check such names route), so
#: that an allowed caller gets 404 or 400 and nothing changes.
SAMPLES = {"pk": "999999", "name": "no.such-thing", "request_id": "nope", "sha256": "0" * 64}


def _routes(patterns, prefix=""):
    for p in patterns:
        if isinstance(p, URLResolver):
            yield from _routes(p.url_patterns, prefix + str(p.pattern))
        else:
            yield prefix + str(p.pattern)


def routes() -> list[str]:
    out = []
    for raw in _routes(get_resolver().url_patterns):
        if raw.startswith("admin/"):
            continue  # Django's admin: staff plus model permissions (test below)
        r = raw.replace("^", "").replace("$", "")
        r = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", r)
        out.append(re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", r))
    return out


def url(route: str) -> str:
    return "/" + re.sub(r"\{(\w+)\}", lambda m: SAMPLES[m.group(1)], route)


def test_every_route_declares_a_role():
    found = routes()
    assert sorted(set(found) - set(ROUTES) - set(CONSOLE)) == [], "routes with no role here"
    assert sorted((set(ROUTES) | set(CONSOLE)) - set(found)) == [], "roles for routes that are gone"


@pytest.fixture
def callers(alice_key, olga_key, settings, monkeypatch):
    from apps.nodes import tasks

    monkeypatch.setattr(tasks.measure_links, "delay", lambda *a: type("J", (), {"id": "x"})())
    return {
        ANON: key_client(None),
        APP: key_client(alice_key),
        OPERATOR: key_client(olga_key),
        NODE: key_client(settings.NODE_TOKEN),
    }


def _committed(route: str):
    """The serving endpoints check keys from a pool thread, on a connection of its own (see
    controlplane.db.in_pool_thread), which sees committed rows only."""
    serving = route.startswith("v1/") or route == "metrics"
    return pytest.param(route, marks=[pytest.mark.django_db(transaction=True)] if serving else [])


@pytest.mark.parametrize("route", [_committed(r) for r in sorted(ROUTES)])
def test_each_role_gets_what_its_route_allows(route, callers):
    least = ROUTES[route]
    statuses = {
        (role, method): getattr(client, method)(url(route), {}, format="json").status_code
        for role, client in callers.items()
        for method in METHODS
    }
    for (role, method), status in statuses.items():
        if least == ANON:
            assert status not in (401, 403) and status < 500, (role, method, status)
            continue
        if least == NODE:
            allowed = role == NODE
        else:
            allowed = role != NODE and RANK[role] >= RANK[least]
        if role == NODE and least != NODE:
            # The node token is not an API key: it is refused like a wrong key.
            assert status in (401, 403, 405), (role, method, status)
            continue
        if allowed:
            assert status not in (401, 403) and status < 500, (role, method, status)
        elif status == 405:
            # A method the route does not have at all: nobody gets further.
            assert statuses[(OPERATOR if least != NODE else NODE, method)] == 405
        else:
            assert status == (401 if role == ANON and least != NODE else 403), (
                role,
                method,
                status,
            )


def test_console_pages_follow_the_session_role(client, alice, olga):
    def login(user):
        client.logout()
        if user is not None:
            client.force_login(user)

    for route, least in CONSOLE.items():
        for user, rank in ((None, 0), (alice, 1), (olga, 2)):
            login(user)
            status = client.get(url(route)).status_code
            if route == "console/logout/":  # POST only; anyone may log out
                assert client.post(url(route)).status_code == 302
                continue
            if rank >= RANK[least]:
                assert status in (200, 404), (route, user, status)
            else:
                assert status == 302, (route, user, status)  # to the login page


def test_admin_site_is_the_admins(client, olga, django_user_model):
    client.force_login(olga)
    assert client.get("/admin/accounts/apikey/").status_code == 403  # staff, no model rights
    admin = django_user_model.objects.create_superuser("root", password="root-password-1")
    client.force_login(admin)
    assert client.get("/admin/accounts/apikey/").status_code == 200


def test_the_admin_only_shows_what_the_services_own(client, django_user_model):
    """Even a superuser cannot add, change or delete deployments, nodes or usage there: the
    services' checks would be skipped. They see them."""
    from apps.nodes.models import Node

    node = Node.objects.create(name="n1", address="10.0.0.1:1")
    admin = django_user_model.objects.create_superuser("root", password="root-password-1")
    client.force_login(admin)
    for path in ("deployments/deployment", "nodes/node", "usage/usagerecord", "catalog/pulljob"):
        assert client.get(f"/admin/{path}/").status_code == 200, path
        assert client.get(f"/admin/{path}/add/").status_code == 403, path
    page = client.get(f"/admin/nodes/node/{node.pk}/change/")
    assert page.status_code == 200 and b'name="_save"' not in page.content  # view only
    gone = client.post(f"/admin/nodes/node/{node.pk}/delete/", {"post": "yes"})
    assert gone.status_code == 403 and Node.objects.filter(pk=node.pk).exists()


async def _ws(path: str, headers: list) -> tuple[bool, int | None]:
    from channels.testing import WebsocketCommunicator

    from controlplane.asgi import application

    comm = WebsocketCommunicator(application, path, headers=headers)
    connected, code = await comm.connect(timeout=10)
    await comm.disconnect()
    return connected, code


@pytest.mark.django_db(transaction=True)
async def test_websockets_follow_the_role(alice, alice_key, olga, async_client):
    bearer = [(b"authorization", f"Bearer {alice_key}".encode())]
    assert await _ws("/ws/v1/generate", bearer) == (True, None)  # applications generate
    assert (await _ws("/ws/v1/console", bearer))[1] == 4403  # but do not watch the fleet
    assert (await _ws("/ws/v1/generate", []))[1] == 4401
    for user, allowed in ((alice, False), (olga, True)):
        await async_client.aforce_login(user)
        cookie = async_client.cookies["sessionid"].value
        same = [(b"cookie", f"sessionid={cookie}".encode()), (b"host", b"testserver")]
        for path in ("/ws/v1/generate", "/ws/v1/console"):
            connected, code = await _ws(path, same + [(b"origin", b"http://testserver")])
            assert connected == allowed, (user, path, code)
        # A session from another origin (scheme, host or port) is nobody's.
        for origin in (b"https://testserver", b"http://testserver:8080", b"http://evil.example"):
            connected, code = await _ws("/ws/v1/console", same + [(b"origin", origin)])
            assert not connected, origin
