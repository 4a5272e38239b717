"""Every request leaves a usage record, however it ends; quotas answer 429 in OpenAI's terms."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from controlplane.redis import key as redis_key
from tests.apps.serving_client import post, read_killing_replica
from tests.conftest import CHAT, SMOLLM2

pytestmark = pytest.mark.django_db(transaction=True)

STORY = [{"role": "user", "content": "Write a long story."}]


async def records(**filters):
    from apps.usage import services
    from apps.usage.models import UsageRecord

    await services.flush()
    return [r async for r in UsageRecord.objects.filter(**filters).order_by("started_at")]


async def test_a_streamed_request_is_recorded_with_its_key_and_numbers(two_replicas, alice_key):
    from apps.accounts.models import ApiKey

    resp = await post(
        alice_key,
        {"model": SMOLLM2, "messages": CHAT, "max_tokens": 16, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    chunks = [c async for c in resp.streaming_content]
    usage = json.loads(chunks[-2].decode().removeprefix("data: "))["usage"]
    [r] = await records()
    key = await ApiKey.objects.aget(prefix=alice_key[:10])
    assert r.api_key_id == key.pk and r.app == "alice's app" and r.endpoint == "chat"
    assert (r.outcome, r.model, r.deployment) == ("ok", SMOLLM2, SMOLLM2)
    assert (
        r.prompt_tokens == usage["prompt_tokens"]
        and r.completion_tokens == usage["completion_tokens"]
    )
    assert r.replicas == [resp["X-LlamaFleet-Replica"]] and r.nodes == [resp["X-LlamaFleet-Node"]]
    assert 0 < r.time_to_first_token_ms < r.duration_ms


async def test_migrated_failed_and_rejected_requests_are_recorded(
    two_replicas, alice_key, settings
):
    _, agents = two_replicas
    # Greedy: a sampled story may end before its 60 tokens (seen once in CI, 42).
    resp = await post(
        alice_key,
        {"model": SMOLLM2, "messages": STORY, "max_tokens": 60, "stream": True,
         "temperature": 0, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    first = agents[resp["X-LlamaFleet-Replica"]]
    chunks = await read_killing_replica(resp, agents, after=4)
    usage = json.loads(chunks[-2].decode().removeprefix("data: "))["usage"]
    [moved] = await records()
    assert moved.outcome == "migrated" and moved.completion_tokens == 60
    assert usage["completion_tokens"] == 60  # what the client was told, from both replicas
    assert len(moved.replicas) == 2 and moved.replicas[0] == first.replica_id
    # Now only one replica is left: killing it fails the stream.
    resp = await post(
        alice_key, {"model": SMOLLM2, "messages": STORY, "max_tokens": 200, "stream": True}
    )
    await read_killing_replica(resp, agents, after=4)
    failed = (await records())[-1]
    assert failed.outcome == "error" and failed.error_code == "replica_failed"
    assert failed.prompt_tokens > 0 and 0 < failed.completion_tokens < 200
    settings.MAX_IN_FLIGHT = 0
    assert (await post(alice_key, {"model": SMOLLM2, "messages": CHAT})).status_code == 429
    rejected = (await records())[-1]
    assert rejected.outcome == "rejected" and rejected.error_code == "server_busy"
    assert (await post(alice_key, {"model": "nope", "messages": CHAT})).status_code == 429


async def test_a_cancelled_generation_is_recorded_with_what_was_generated(two_replicas, alice_key):
    from controlplane.asgi import application

    comm = WebsocketCommunicator(application, f"/ws/v1/generate?api_key={alice_key}")
    assert (await comm.connect(timeout=10))[0]
    await comm.send_json_to(
        {"type": "generate", "id": "g", "model": SMOLLM2, "messages": STORY, "max_tokens": 300}
    )
    tokens = 0
    while tokens < 3:
        msg = await comm.receive_json_from(timeout=30)
        tokens += msg["type"] == "token"
    await comm.send_json_to({"type": "cancel", "id": "g"})
    while (await comm.receive_json_from(timeout=30))["type"] != "done":
        pass
    await comm.disconnect()
    [r] = await records()
    assert r.outcome == "cancelled" and r.endpoint == "websocket"
    assert r.prompt_tokens > 0 and 3 <= r.completion_tokens < 300


async def test_a_stream_is_recorded_while_it_runs_and_settled_if_its_process_dies(
    two_replicas, alice_key
):
    """The record is written when the request arrives, before its stream ends: a web
    process killed mid-stream (here: a stream never finished, as a dead process leaves it)
    leaves it RUNNING, and the sweeper settles it."""
    from apps.serving.services import GenerationParams, Piece, generate
    from apps.usage import services
    from apps.usage.models import UsageRecord
    from apps.usage.services import Caller

    params = GenerationParams(model=SMOLLM2, messages=STORY, max_tokens=200, temperature=0)
    events = generate(params, Caller(user_id=None), "chat")
    gen = await anext(events)
    assert isinstance(await anext(events), Piece)
    [r] = await records()
    assert r.outcome == "running" and r.finished_at is None and r.model == SMOLLM2
    assert gen.target.replica_id  # routed; the record learns where at the end
    # Not yet stale: left alone.
    assert await sync_to_async(services.settle_interrupted)() == 0
    assert await sync_to_async(services.settle_interrupted)(older_than=0) == 1
    r = await UsageRecord.objects.aget(pk=r.pk)
    assert (r.outcome, r.error_code) == ("error", "interrupted") and r.finished_at is not None
    # With the tokens the agent counted for it (the web process's own count died with it).
    assert r.prompt_tokens == gen.prompt_tokens > 0 and r.completion_tokens >= 1
    assert r.nodes == [gen.target.node_name]
    await events.aclose()  # (a live process would complete it; a settled record stays)
    [r] = await records()
    assert r.error_code == "interrupted"


async def test_a_finished_stream_completes_its_admitted_record(two_replicas, alice_key):
    resp = await post(
        alice_key, {"model": SMOLLM2, "messages": CHAT, "max_tokens": 8, "stream": True}
    )
    [_ async for _ in resp.streaming_content]
    [r] = await records()  # one record: the admitted one, completed
    assert r.outcome == "ok" and r.completion_tokens > 0 and r.finished_at > r.started_at


async def test_embeddings_are_recorded(two_replicas, alice_key):
    resp = await post(alice_key, {"model": SMOLLM2, "input": ["a", "b c"]}, "/v1/embeddings")
    assert resp.status_code == 200
    [r] = await records()
    assert r.endpoint == "embedding" and r.outcome == "ok"
    assert r.prompt_tokens == resp.json()["usage"]["prompt_tokens"] and r.completion_tokens == 0


# ---- quotas ------------------------------------------------------------------------------------


async def limited_key(alice, **limits) -> str:
    from asgiref.sync import sync_to_async

    from apps.accounts.services import create_key

    return (await sync_to_async(create_key)("limited", owner=alice, app="batch-app", **limits))[1]


async def test_requests_per_minute_limit_answers_429_with_retry_after(two_replicas, alice):
    key = await limited_key(alice, requests_per_minute=2)
    # A second key of the same application shares the count: more keys are not more quota.
    other = await limited_key(alice, requests_per_minute=2)
    body = {"model": SMOLLM2, "messages": CHAT, "max_tokens": 1}
    assert [(await post(k, body)).status_code for k in (key, other)] == [200, 200]
    over = await post(key, body)
    assert over.status_code == 429 and 1 <= int(over["Retry-After"]) <= 60
    error = over.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert (await records())[-1].outcome == "rejected"


async def test_tokens_per_day_quota_survives_redis_losing_its_count(two_replicas, alice):
    from apps.usage import services

    key = await limited_key(alice, tokens_per_day=30)
    body = {"model": SMOLLM2, "messages": CHAT, "max_tokens": 20}
    first = await post(key, body)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] > 30
    await services.flush()
    over = await post(key, body)
    assert over.status_code == 429 and int(over["Retry-After"]) > 0
    assert over.json()["error"]["code"] == "insufficient_quota"
    # Redis restarts empty: the count is rebuilt from the usage records, still over.
    client = services._redis()
    await client.delete(*[k async for k in client.scan_iter(redis_key("tokens", "*"))])
    again = await post(key, body)
    assert again.status_code == 429 and again.json()["error"]["type"] == "insufficient_quota"
