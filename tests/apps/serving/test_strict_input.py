"""Malformed requests get a clear 400 (413 for size) in OpenAI's shape with `param` set, never a
5xx; malformed websocket frames get an error event and the socket stays open; afterwards
/metrics still renders and holds no label a client made up."""

from __future__ import annotations

import json

import pytest
from channels.testing import WebsocketCommunicator
from django.test import AsyncClient

from tests.conftest import SMOLLM2

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"
OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields) -> dict:
    return OK | fields


# (path, raw body, the param the error names)
CASES = [
    (CHAT, b"", "body"),
    (CHAT, b"{", "body"),
    (CHAT, b"[1, 2]", "body"),
    (CHAT, b"\xff\xfe not utf-8", "body"),
    (CHAT, b'{"model": "m", "messages": [], "x": NaN}', "body"),
    (CHAT, b'{"model": "m", "temperature": Infinity}', "body"),
    (CHAT, b'{"model": "m", "temperature": 1e400}', "body"),
    (CHAT, b'{"model": "m", "seed": ' + b"9" * 5000 + b"}", "body"),
    (CHAT, b'{"model": "\\ud800", "messages": []}', "body"),
    (CHAT, json.dumps(chat(messages=[{"role": "user", "content": "a\ud800"}])).encode(), "body"),
    (CHAT, b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body"),
    (
        CHAT,
        json.dumps(chat(messages=[{"role": ["user"], "content": "x"}])).encode(),
        "messages[0].role",
    ),
    (
        CHAT,
        json.dumps(chat(messages=[{"role": "user", "content": {"a": 1}}])).encode(),
        "messages[0].content",
    ),
    (
        CHAT,
        json.dumps(chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])).encode(),
        "messages[0].content",
    ),
    (CHAT, json.dumps(chat(messages=[])).encode(), "messages"),
    (CHAT, json.dumps(chat(messages="hi")).encode(), "messages"),
    (CHAT, json.dumps({"messages": OK["messages"]}).encode(), "model"),
    (CHAT, json.dumps(chat(model="")).encode(), "model"),
    (CHAT, json.dumps(chat(model="m" * 300)).encode(), "model"),
    (CHAT, json.dumps(chat(model="m\x01")).encode(), "model"),
    (CHAT, json.dumps(chat(user="a\x00b")).encode(), "body"),
    (CHAT, json.dumps(chat(seed=2**70)).encode(), "seed"),
    (CHAT, json.dumps(chat(seed="1")).encode(), "seed"),
    (CHAT, json.dumps(chat(seed=True)).encode(), "seed"),
    (CHAT, json.dumps(chat(temperature=3)).encode(), "temperature"),
    (CHAT, json.dumps(chat(temperature="hot")).encode(), "temperature"),
    (CHAT, json.dumps(chat(top_p=-0.5)).encode(), "top_p"),
    (CHAT, json.dumps(chat(max_tokens=0)).encode(), "max_tokens"),
    (CHAT, json.dumps(chat(max_tokens=1.5)).encode(), "max_tokens"),
    (CHAT, json.dumps(chat(stop=["a", "b", "c", "d", "e"])).encode(), "stop"),
    (CHAT, json.dumps(chat(stop=[1])).encode(), "stop"),
    (CHAT, json.dumps(chat(stream="yes")).encode(), "stream"),
    (CHAT, json.dumps(chat(stream_options=[1])).encode(), "stream_options"),
    (CHAT, json.dumps(chat(n=17)).encode(), "n"),
    (CHAT, json.dumps(chat(n=0)).encode(), "n"),
    (CHAT, json.dumps(chat(top_logprobs=2)).encode(), "body"),  # without logprobs: true
    (CHAT, json.dumps(chat(logprobs=True, top_logprobs=21)).encode(), "top_logprobs"),
    (
        "/v1/completions",
        json.dumps({"model": "m", "prompt": "x", "logprobs": 6}).encode(),
        "logprobs",
    ),
    (
        CHAT,
        json.dumps(chat(response_format={"type": "xml"})).encode(),
        "response_format",
    ),
    (
        CHAT,
        json.dumps(
            chat(response_format={"type": "json_schema", "json_schema": {"name": "a b"}})
        ).encode(),
        "response_format.json_schema.name",
    ),
    (CHAT, json.dumps(chat(tools=[{"type": "function"}])).encode(), "tools[0].function"),
    (CHAT, json.dumps(chat(tool_choice="required")).encode(), "body"),  # no tools
    (
        CHAT,
        json.dumps(chat(messages=[{"role": "tool", "content": "18 C"}])).encode(),
        "messages[0]",
    ),
    (CHAT, json.dumps(chat(presence_penalty=2.5)).encode(), "presence_penalty"),
    (CHAT, json.dumps(chat(frequency_penalty="high")).encode(), "frequency_penalty"),
    (CHAT, json.dumps(chat(whatever=1)).encode(), "whatever"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": ""}).encode(), "prompt"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": ["a", "b"]}).encode(), "prompt"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "x", "echo": True}).encode(), "echo"),
    ("/v1/embeddings", json.dumps({"model": "m", "input": []}).encode(), "input"),
    ("/v1/embeddings", json.dumps({"model": "m", "input": ["x"] * 2049}).encode(), "input"),
    (
        "/v1/embeddings",
        json.dumps({"model": "m", "input": "x", "encoding_format": "hex"}).encode(),
        "encoding_format",
    ),
    (
        "/v1/embeddings",
        json.dumps({"model": "m", "input": "x", "dimensions": 8}).encode(),
        "dimensions",
    ),
]


async def send(key: str, path: str, body: bytes):
    return await AsyncClient().post(
        path, body, content_type="application/json", headers={"Authorization": f"Bearer {key}"}
    )


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=[f"{i}" for i in range(len(CASES))])
async def test_malformed_requests_get_a_400_naming_the_field(alice_key, path, body, param):
    resp = await send(alice_key, path, body)
    assert resp.status_code == 400, resp.content[:300]
    assert resp["Content-Type"] == "application/json"
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"]


async def test_oversized_bodies_get_413_in_the_same_shape(alice_key, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = json.dumps(chat(messages=[{"role": "user", "content": "x" * 2000}])).encode()
    resp = await send(alice_key, CHAT, body)
    assert resp.status_code == 413 and resp.json()["error"]["param"] == "body"
    # The REST API too.
    resp = await AsyncClient().post(
        "/api/v1/api-keys/", body, content_type="application/json",
        headers={"Authorization": f"Bearer {alice_key}"},
    )  # fmt: skip
    assert resp.status_code == 413


async def test_a_valid_request_for_an_unknown_model_is_404_and_metrics_stay_clean(
    alice_key, olga_key
):
    weird = "no-such-model-\u00e9\u2603"
    for seed in (-1, 2**63 - 1, None):
        resp = await send(alice_key, CHAT, json.dumps(chat(model=weird, seed=seed)).encode())
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    metrics = await AsyncClient().get("/metrics", headers={"Authorization": f"Bearer {olga_key}"})
    assert metrics.status_code == 200
    text = metrics.content.decode()
    assert weird not in text and 'model="unknown"' in text


async def test_metrics_take_the_scrape_token_and_nothing_else(alice_key, settings):
    settings.METRICS_TOKEN = "scrape-only-token-123"
    get = lambda token: AsyncClient().get(  # noqa: E731
        "/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    assert (await get("scrape-only-token-123")).status_code == 200
    assert (await get(alice_key)).status_code == 403
    # The scrape token opens nothing else.
    assert (await AsyncClient().get(
        "/v1/models", headers={"Authorization": "Bearer scrape-only-token-123"}
    )).status_code == 401  # fmt: skip


# ---- the websocket ----------------------------------------------------------------------------


async def test_every_bad_frame_gets_an_error_and_the_socket_stays_open(alice_key, settings):
    from controlplane.asgi import application

    comm = WebsocketCommunicator(
        application, "/ws/v1/generate", headers=[(b"authorization", f"Bearer {alice_key}".encode())]
    )
    assert (await comm.connect(timeout=10))[0]
    frames = [
        {"text_data": "not json"},
        {"bytes_data": b"\x00\x01"},
        {"text_data": "[1, 2]"},
        {"text_data": "{}"},
        {"text_data": json.dumps({"type": "dance", "id": "a"})},
        {"text_data": json.dumps({"type": "generate", "model": SMOLLM2, "prompt": "x"})},
        {
            "text_data": json.dumps(
                {"type": "generate", "id": "b", "model": "m", "prompt": "x", "seed": 2**70}
            )
        },
        {
            "text_data": json.dumps(
                {
                    "type": "generate",
                    "id": "c",
                    "model": "m",
                    "prompt": "x",
                    "messages": OK["messages"],
                }
            )
        },
        {"text_data": '{"type": "generate", "id": "d", "model": "\\ud800", "prompt": "x"}'},
        {"text_data": '{"type": "generate", "id": "e", "x": ' + "[" * 3000 + "]" * 3000 + "}"},
        {"text_data": json.dumps({"type": "cancel"})},
        {"text_data": "x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1)},
    ]
    for frame in frames:
        await comm.send_to(**frame)
        event = await comm.receive_json_from(timeout=10)
        assert event["type"] == "error" and event["error"]["message"], (frame, event)
        assert event["error"]["type"] == "invalid_request_error", event
    # Still open: a well-formed request for an unknown model ends with its own error.
    await comm.send_json_to({"type": "generate", "id": "z", "model": "nope", "prompt": "hi"})
    event = await comm.receive_json_from(timeout=10)
    assert event == {"type": "error", "id": "z"} | {
        "error": {
            "message": "The model 'nope' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    await comm.disconnect()
