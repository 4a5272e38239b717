"""The generation websocket on the real ASGI application (Channels' WebsocketCommunicator)."""

import asyncio

import pytest
from channels.testing import WebsocketCommunicator

from controlplane.asgi import application
from tests.conftest import CHAT, SMOLLM2, async_wait_for

pytestmark = pytest.mark.django_db(transaction=True)


async def connect(key="", headers=None):
    path = "/ws/v1/generate" + (f"?api_key={key}" if key else "")
    comm = WebsocketCommunicator(application, path, headers=headers or [])
    connected, code = await comm.connect(timeout=10)
    return comm, connected, code


async def collect(comm, gid, timeout=60):
    """Messages for one generation until its done or error message."""
    out = []
    while True:
        msg = await comm.receive_json_from(timeout=timeout)
        if msg.get("id") != gid:
            continue
        out.append(msg)
        if msg["type"] in ("done", "error"):
            return out


async def test_unauthenticated_socket_is_refused(deployed):
    comm, connected, code = await connect()
    assert not connected and code == 4401
    comm, connected, code = await connect("lf-not-a-key-0000000000000000")
    assert not connected


async def test_tokens_stream_and_equal_llama_in_process(deployed, alice_key, reference_text):
    comm, connected, _ = await connect(alice_key)
    assert connected
    await comm.send_json_to(
        {
            "type": "generate",
            "id": "g1",
            "model": SMOLLM2,
            "messages": CHAT,
            "temperature": 0,
            "max_tokens": 48,
        }
    )
    msgs = await collect(comm, "g1")
    assert msgs[0]["type"] == "start" and msgs[0]["node"] == "node-a"
    tokens = [m for m in msgs if m["type"] == "token"]
    # The first piece goes at once; later ones may be merged (the agent's stream interval).
    assert len(tokens) >= 2 and [t["index"] for t in tokens] == list(range(len(tokens)))
    assert "".join(t["text"] for t in tokens) == reference_text(CHAT, 48)
    assert msgs[-1]["type"] == "done" and msgs[-1]["usage"]["completion_tokens"] > 0
    await comm.disconnect()


async def test_bearer_header_also_authenticates(deployed, alice_key):
    comm, connected, _ = await connect(headers=[(b"authorization", f"Bearer {alice_key}".encode())])
    assert connected
    await comm.disconnect()


async def test_concurrent_generations_and_cancel(deployed, alice_key, reference_text):
    comm, _, _ = await connect(alice_key)
    long = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    await comm.send_json_to(
        {
            "type": "generate",
            "id": "long",
            "model": SMOLLM2,
            "messages": long,
            "max_tokens": 400,
            "temperature": 0,
        }
    )
    await comm.send_json_to(
        {
            "type": "generate",
            "id": "short",
            "model": SMOLLM2,
            "messages": CHAT,
            "temperature": 0,
            "max_tokens": 48,
        }
    )
    by_id = {"long": [], "short": []}
    cancelled = False
    while not (
        by_id["short"]
        and by_id["short"][-1]["type"] == "done"
        and by_id["long"]
        and by_id["long"][-1]["type"] == "done"
    ):
        msg = await comm.receive_json_from(timeout=60)
        by_id[msg["id"]].append(msg)
        if msg["id"] == "long" and msg["type"] == "token" and not cancelled:
            await comm.send_json_to({"type": "cancel", "id": "long"})
            cancelled = True
    assert by_id["long"][-1]["finish_reason"] == "cancelled"
    assert len([m for m in by_id["long"] if m["type"] == "token"]) < 100
    short = "".join(m["text"] for m in by_id["short"] if m["type"] == "token")
    assert short == reference_text(CHAT, 48)
    await comm.disconnect()


async def test_bad_messages_get_errors_and_the_socket_stays_usable(deployed, alice_key):
    comm, _, _ = await connect(alice_key)
    await comm.send_json_to({"type": "dance", "id": "x"})
    assert (await comm.receive_json_from())["error"]["param"] == "type"
    await comm.send_json_to({"type": "generate", "id": "y", "model": "nope", "messages": CHAT})
    assert (await collect(comm, "y"))[-1]["error"]["code"] == "model_not_found"
    await comm.send_json_to(
        {
            "type": "generate",
            "id": "z",
            "model": SMOLLM2,
            "messages": [{"role": "user", "content": "hi " * 700}],
        }
    )
    assert (await collect(comm, "z"))[-1]["error"]["code"] == "context_length_exceeded"
    await comm.send_json_to(
        {"type": "generate", "id": "ok", "model": SMOLLM2, "messages": CHAT, "max_tokens": 3}
    )
    assert (await collect(comm, "ok"))[-1]["type"] == "done"
    await comm.disconnect()


async def test_disconnect_frees_the_slot_at_once(deployed, alice_key):
    comm, _, _ = await connect(alice_key)
    await comm.send_json_to(
        {
            "type": "generate",
            "id": "g",
            "model": SMOLLM2,
            "max_tokens": 400,
            "messages": [{"role": "user", "content": "Write a long story."}],
        }
    )
    while (await comm.receive_json_from(timeout=30))["type"] != "token":
        pass
    await comm.disconnect()
    service = deployed.agent.service
    engine = service.replicas[deployed.replica_id].engine
    await async_wait_for(lambda: engine.in_flight == 0, timeout=5)


async def test_an_idle_socket_outlives_the_channel_layers_read_timeout(deployed, alice_key):
    """Regression: channels-redis reads block 5 s, as long as redis-py's default timeout."""
    comm, connected, _ = await connect(alice_key)
    assert connected
    await asyncio.sleep(6.5)
    await comm.send_json_to(
        {"type": "generate", "id": "late", "model": SMOLLM2, "messages": CHAT, "max_tokens": 2}
    )
    msgs = await collect(comm, "late")
    assert msgs[-1]["type"] == "done"
    await comm.disconnect()


async def test_a_key_revoked_while_its_socket_is_open_serves_no_more(deployed, alice_key):
    from asgiref.sync import sync_to_async

    from apps.accounts.models import ApiKey
    from apps.accounts.services import revoke_key

    comm, connected, _ = await connect(alice_key)
    assert connected
    key = await ApiKey.objects.aget(prefix=alice_key[:10])
    await sync_to_async(revoke_key)(key)
    await comm.send_json_to(
        {"type": "generate", "id": "r", "model": SMOLLM2, "messages": CHAT, "max_tokens": 2}
    )
    msg = await comm.receive_json_from(timeout=10)
    assert msg["type"] == "error" and msg["error"]["code"] == "invalid_api_key"
    assert (await comm.receive_output(timeout=5))["type"] == "websocket.close"
