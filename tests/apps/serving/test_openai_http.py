"""/v1 endpoints through the real ASGI handler, served by a real agent and llama.cpp."""

import json
import os
import signal

import pytest
from django.test import AsyncClient

from tests.conftest import CHAT, SMOLLM2

pytestmark = pytest.mark.django_db(transaction=True)


def auth(key) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def post(key, body, path="/v1/chat/completions"):
    return await AsyncClient().post(
        path, json.dumps(body), content_type="application/json", headers=auth(key)
    )


async def sse_events(response) -> list:
    raw = b"".join([chunk async for chunk in response.streaming_content]).decode()
    assert raw.endswith("\n\n")
    return [line.removeprefix("data: ") for line in raw.split("\n\n") if line]


async def test_chat_completion_equals_llama_in_process(deployed, alice_key, reference_text):
    resp = await post(
        alice_key, {"model": SMOLLM2, "messages": CHAT, "temperature": 0, "max_tokens": 48}
    )
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == SMOLLM2
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": reference_text(CHAT, 48),
    }
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert resp["X-LlamaFleet-Node"] == "node-a"


async def test_streamed_chat_is_openai_sse(deployed, alice_key, reference_text):
    resp = await post(
        alice_key,
        {
            "model": SMOLLM2,
            "messages": CHAT,
            "temperature": 0,
            "max_tokens": 48,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert resp.status_code == 200 and resp["Content-Type"] == "text/event-stream"
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == reference_text(CHAT, 48)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert len({c["id"] for c in chunks}) == 1


async def test_text_completion(deployed, alice_key, reference_llama):
    prompt = "The three primary colours are"
    expected = reference_llama.create_completion(prompt, temperature=0, max_tokens=16)
    resp = await post(
        alice_key,
        {"model": SMOLLM2, "prompt": prompt, "temperature": 0, "max_tokens": 16},
        "/v1/completions",
    )
    assert resp.status_code == 200, resp.content
    assert resp.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    assert resp.json()["choices"][0]["finish_reason"] == "length"


async def test_penalties_reach_the_engine(deployed, alice_key):
    """presence_penalty, frequency_penalty and repeat_penalty travel through the API, gRPC and
    the agent to the engine's sampler: greedy decoding that repeats a word without them
    stops repeating it with any of them (their numbers against llama-cpp-python's are the
    engine tests'; this replica's batching numerics differ from Llama's in the last bits)."""

    async def teas(**penalties) -> int:
        resp = await post(
            alice_key,
            {"model": SMOLLM2, "prompt": "tea, tea, tea, tea, tea, tea,", "temperature": 0,
             "max_tokens": 24, **penalties},
            "/v1/completions",
        )  # fmt: skip
        assert resp.status_code == 200, resp.content
        return resp.json()["choices"][0]["text"].lower().count("tea")

    assert await teas() >= 10
    assert await teas(presence_penalty=1.0, frequency_penalty=2.0) <= 3
    assert await teas(repeat_penalty=1.3) <= 3  # this once ended the engine process


async def test_models_lists_what_is_deployed(deployed, alice_key):
    resp = await AsyncClient().get("/v1/models", headers=auth(alice_key))
    assert [m["id"] for m in resp.json()["data"]] == [SMOLLM2]


async def test_errors_have_openais_shape(deployed, alice_key):
    cases = [
        (None, {"model": SMOLLM2, "messages": CHAT}, 401, "invalid_api_key"),
        (
            "lf-wrong-key-000000000000000",
            {"model": SMOLLM2, "messages": CHAT},
            401,
            "invalid_api_key",
        ),
        (alice_key, {"model": "gpt-4", "messages": CHAT}, 404, "model_not_found"),
        (
            alice_key,
            {"model": SMOLLM2, "messages": [{"role": "user", "content": "hi " * 700}]},
            400,
            "context_length_exceeded",
        ),
        (alice_key, {"model": SMOLLM2, "messages": []}, 400, None),
        (alice_key, {"model": SMOLLM2, "messages": CHAT, "temperature": 5}, 400, None),
        (
            alice_key,
            {"model": SMOLLM2, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            None,
        ),
        (
            alice_key,
            {"model": SMOLLM2, "messages": CHAT, "n": 16},
            400,
            None,
        ),  # more choices than slots
    ]
    for key, body, status, code in cases:
        resp = await post(key, body)
        assert resp.status_code == status, (body, resp.content)
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["code"] == code, body
    resp = await AsyncClient().post(
        "/v1/chat/completions",
        "{not json",
        content_type="application/json",
        headers=auth(alice_key),
    )
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]


async def test_nothing_to_serve_is_503_with_retry_after(smollm2_model, alice_key):
    resp = await post(alice_key, {"model": SMOLLM2, "messages": CHAT})
    assert resp.status_code == 503 and resp["Retry-After"]
    assert resp.json()["error"]["code"] == "no_replica"


async def test_engine_killed_mid_stream_ends_with_an_error_event(deployed, alice_key):
    resp = await post(
        alice_key,
        {
            "model": SMOLLM2,
            "stream": True,
            "max_tokens": 300,
            "messages": [{"role": "user", "content": "Write a long story."}],
        },
    )
    events, killed = [], False
    async for chunk in resp.streaming_content:
        events.append(chunk)
        if len(events) == 4 and not killed:
            os.kill(deployed.engine_pid(deployed.replica_id), signal.SIGKILL)
            killed = True
    last = json.loads(events[-1].decode().removeprefix("data: "))
    assert last["error"]["code"] == "replica_failed" and "SIGKILL" in last["error"]["message"]
    assert b"[DONE]" not in b"".join(events)
