"""Two real agents serving one deployment: routing policies, drain, migration, backpressure."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.test import AsyncClient

from tests.apps.serving_client import post, read_killing_replica, sse_payloads
from tests.conftest import CHAT, SMOLLM2, async_wait_for

pytestmark = pytest.mark.django_db(transaction=True)

STORY = [{"role": "user", "content": "Write a long story."}]


def text_of(payloads: list) -> str:
    out = []
    for p in payloads:
        if p.startswith("{"):
            for c in json.loads(p).get("choices", []):
                out.append(c["delta"].get("content") or "")
    return "".join(out)


async def generate_killing_replica(params, agents: dict, after: int):
    """Run a generation through the serving path; after `after` pieces, SIGKILL the engine
    serving it. Returns the Generation, the texts of its pieces and its Finished event."""
    from apps.serving.services import generate

    events = generate(params)
    gen = await anext(events)
    serving = agents[gen.target.replica_id]
    text = []
    async for ev in events:
        if hasattr(ev, "text"):
            text.append(ev.text)
            if len(text) == after:
                os.kill(serving.engine_pid(serving.replica_id), signal.SIGKILL)
        else:
            finished = ev
    return gen, text, finished


def metric(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("two_replicas", ["invariant"], indirect=True)
async def test_a_stream_moves_to_another_replica_when_its_replica_dies(
    two_replicas, alice_key, reference_text
):
    """Batch-invariant mode: the moved stream has the text of an uninterrupted run."""
    _, agents = two_replicas
    migrated_before = metric("llamafleet_migrations_total", model=SMOLLM2)
    resp = await post(
        alice_key,
        {
            "model": SMOLLM2,
            "messages": STORY,
            "max_tokens": 120,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert resp.status_code == 200
    serving = agents[resp["X-LlamaFleet-Replica"]]
    # A dozen pieces are with the client when its replica is killed.
    chunks = await read_killing_replica(resp, agents, after=12)
    payloads = sse_payloads(chunks)
    assert len(chunks) > 12 and payloads[-1] == "[DONE]", payloads[-3:]
    # One uninterrupted stream: nothing lost, nothing repeated, the text of a solo run.
    assert text_of(payloads) == reference_text(STORY, 120)
    usage = json.loads(payloads[-2])["usage"]
    assert usage["completion_tokens"] == 120
    assert metric("llamafleet_migrations_total", model=SMOLLM2) == migrated_before + 1
    other = next(a for a in agents.values() if a is not serving)
    assert other.agent.service.metrics.tokens.labels(other.replica_id, SMOLLM2)._value.get() > 0


async def test_a_moved_stream_loses_and_repeats_nothing_in_throughput_mode(
    two_replicas, reference_llama
):
    """Default mode: the new replica continues from the exact tokens already sent. The
    engine sends each piece's token ids; the client's text must be exactly their text."""
    from apps.serving.services import GenerationParams

    _, agents = two_replicas
    params = GenerationParams(model=SMOLLM2, messages=STORY, max_tokens=120, temperature=0)
    gen, text, finished = await generate_killing_replica(params, agents, after=12)
    assert finished.migrations == 1 and finished.completion_tokens == 120
    assert len(gen.token_ids) == 120
    expected = reference_llama.detokenize(gen.token_ids).decode("utf-8", errors="replace")
    assert "".join(text) == expected


async def test_a_structured_output_keeps_its_grammar_across_a_move(two_replicas):
    """The new replica replays the tokens already sent through the grammar: the answer
    still parses and matches the schema after the engine that started it was killed."""
    from typing import Annotated

    from pydantic import BaseModel, Field

    from apps.serving.services import GenerationParams

    class Story(BaseModel):  # bounded, so a small model cannot ramble to the token limit
        title: Annotated[str, Field(max_length=40)]
        lines: Annotated[
            list[Annotated[str, Field(max_length=60)]], Field(min_length=2, max_length=3)
        ]

    _, agents = two_replicas
    params = GenerationParams(
        model=SMOLLM2,
        messages=[{"role": "user", "content": "A short story as JSON with a title and lines."}],
        max_tokens=400,
        temperature=0,
        json_schema=json.dumps(Story.model_json_schema()),
    )
    gen, text, finished = await generate_killing_replica(params, agents, after=6)
    assert finished.migrations == 1 and finished.finish_reason == "stop", "".join(text)
    Story.model_validate_json("".join(text))


async def test_a_stream_ends_with_an_error_event_when_no_replica_can_continue(
    two_replicas, alice_key, settings
):
    settings.MAX_MIGRATIONS = 0
    _, agents = two_replicas
    resp = await post(
        alice_key, {"model": SMOLLM2, "messages": STORY, "max_tokens": 200, "stream": True}
    )
    chunks = await read_killing_replica(resp, agents, after=4)
    last = json.loads(sse_payloads(chunks)[-1])
    assert last["error"]["code"] == "replica_failed" and "SIGKILL" in last["error"]["message"]


async def test_least_connections_sees_streams_of_other_processes(two_replicas, alice_key):
    """In-flight counts live in Redis: a replica busy through another process is avoided."""
    from apps.deployments.models import Deployment
    from apps.serving import balancer

    d, agents = two_replicas
    await Deployment.objects.filter(pk=d.pk).aupdate(routing_policy="least_connections")
    busy, idle = list(agents)
    client = balancer._redis()
    key = balancer._key(busy)
    # Three streams another control-plane process holds, and one left by a dead process.
    await client.zadd(key, {"other-1": time.time(), "other-2": time.time(), "other-3": time.time()})
    await client.zadd(key, {"dead": time.time() - 10_000})
    try:
        assert (await balancer.in_flight([busy, idle])) == {busy: 3, idle: 0}
        for _ in range(3):
            resp = await post(alice_key, {"model": SMOLLM2, "messages": CHAT, "max_tokens": 2})
            assert resp.status_code == 200
            assert resp["X-LlamaFleet-Replica"] == idle
    finally:
        await client.delete(key)
    # Each request released its count when it ended.
    assert (await balancer.in_flight([busy, idle])) == {busy: 0, idle: 0}


async def test_round_robin_alternates(two_replicas, alice_key):
    from apps.deployments.models import Deployment

    d, agents = two_replicas
    await Deployment.objects.filter(pk=d.pk).aupdate(routing_policy="round_robin")
    served = []
    for _ in range(4):
        resp = await post(alice_key, {"model": SMOLLM2, "messages": CHAT, "max_tokens": 2})
        served.append(resp["X-LlamaFleet-Replica"])
    assert set(served) == set(agents)
    assert served[0] != served[1] and served[0] == served[2]


async def test_a_draining_node_finishes_its_streams_and_gets_no_new_ones(
    two_replicas, alice_key, reference_text
):
    from apps.nodes.models import Node
    from apps.nodes.services import set_draining

    _, agents = two_replicas
    resp = await post(
        alice_key,
        {"model": SMOLLM2, "messages": CHAT, "max_tokens": 48, "temperature": 0, "stream": True},
    )
    first = agents[resp["X-LlamaFleet-Replica"]]
    node = await Node.objects.aget(name=first.node.name)
    await sync_to_async(set_draining)(node, True)
    chunks = [chunk async for chunk in resp.streaming_content]
    assert text_of(sse_payloads(chunks)) == reference_text(CHAT, 48)  # in flight: finished
    for _ in range(3):
        r = await post(alice_key, {"model": SMOLLM2, "messages": CHAT, "max_tokens": 2})
        assert r["X-LlamaFleet-Replica"] != first.replica_id
    await sync_to_async(set_draining)(node, False)


async def test_an_agent_stopping_lets_its_streams_finish_and_moves_the_rest(two_replicas):
    """SIGTERM on an agent (Agent.drain, then stop): what finishes within the grace period
    finishes there; new requests go to the other replica; what runs past it moves there."""
    from apps.serving.services import GenerationParams, generate

    _, agents = two_replicas

    async def run(max_tokens: int, on_piece=None):
        params = GenerationParams(model=SMOLLM2, messages=STORY, max_tokens=max_tokens)
        events = generate(params)
        gen = await anext(events)
        pieces, finished = 0, None
        async for ev in events:
            if hasattr(ev, "text"):
                pieces += 1
                if on_piece:
                    on_piece(gen, pieces)
            else:
                finished = ev
        return gen, finished

    def drain_after(n: int, grace: float, started: dict):
        def on_piece(gen, pieces):
            if pieces == n and not started:
                agent = agents[gen.target.replica_id]
                started["agent"] = agent
                started["done"] = asyncio.run_coroutine_threadsafe(
                    _drain_and_stop(agent.agent, grace), agent.loop
                )

        return on_piece

    # A short answer outlives nothing: it finishes where it started, and meanwhile new
    # requests are refused there and served by the other replica.
    started: dict = {}
    gen, finished = await run(48, drain_after(3, 30.0, started))
    assert finished.migrations == 0 and finished.completion_tokens == 48
    other = next(a for a in agents.values() if a is not started["agent"])
    for _ in range(3):
        g, f = await run(2)
        assert g.target.replica_id == other.replica_id and f.completion_tokens == 2
    await asyncio.wrap_future(started["done"])
    stopped = started["agent"].agent.service.replicas.values()
    assert all(r.engine.state == "stopped" for r in stopped)  # engines stopped after the drain


async def _drain_and_stop(agent, grace: float) -> None:
    await agent.drain(grace)
    await agent.stop()


async def test_a_stream_longer_than_the_grace_period_moves_on(two_replicas):
    from apps.serving.services import GenerationParams, generate

    _, agents = two_replicas
    params = GenerationParams(model=SMOLLM2, messages=STORY, max_tokens=300, temperature=0)
    events = generate(params)
    gen = await anext(events)
    first = agents[gen.target.replica_id]
    pieces, finished, stopping = 0, None, None
    async for ev in events:
        if hasattr(ev, "text"):
            pieces += 1
            if pieces == 5:
                stopping = asyncio.run_coroutine_threadsafe(
                    _drain_and_stop(first.agent, 0.5), first.loop
                )
        else:
            finished = ev
    await asyncio.wrap_future(stopping)
    assert finished.migrations == 1 and finished.completion_tokens == 300
    assert gen.target.replica_id != first.replica_id


async def test_beyond_the_in_flight_limit_requests_get_a_fast_429(
    two_replicas, alice_key, settings
):
    settings.MAX_IN_FLIGHT = 1
    rejected_before = metric(
        "llamafleet_requests_total", model=SMOLLM2, deployment="", outcome="rejected"
    )
    resp = await post(
        alice_key, {"model": SMOLLM2, "messages": STORY, "max_tokens": 100, "stream": True}
    )
    stream = resp.streaming_content
    await anext(stream)  # the first stream is running
    started = time.monotonic()
    busy = await post(alice_key, {"model": SMOLLM2, "messages": CHAT, "max_tokens": 2})
    assert time.monotonic() - started < 1.0
    assert busy.status_code == 429 and busy["Retry-After"] == "1"
    assert busy.json()["error"]["type"] == "rate_limit_error"
    assert (
        metric("llamafleet_requests_total", model=SMOLLM2, deployment="", outcome="rejected")
        == rejected_before + 1
    )
    async for _ in stream:  # the first one ends; its place is free again
        pass
    ok = await post(alice_key, {"model": SMOLLM2, "messages": CHAT, "max_tokens": 2})
    assert ok.status_code == 200


async def test_metrics_need_a_staff_key_and_count_requests(two_replicas, alice, alice_key):
    assert (await AsyncClient().get("/metrics")).status_code == 401
    await post(alice_key, {"model": SMOLLM2, "messages": CHAT, "max_tokens": 2})
    scrape = {"Authorization": f"Bearer {alice_key}"}
    assert (await AsyncClient().get("/metrics", headers=scrape)).status_code == 403
    alice.is_staff = True
    await alice.asave()
    resp = await AsyncClient().get("/metrics", headers=scrape)
    body = resp.content.decode()
    assert resp.status_code == 200
    assert (
        f'llamafleet_requests_total{{deployment="{SMOLLM2}",model="{SMOLLM2}",outcome="ok"}}'
        in (body)
    )
    assert "llamafleet_time_to_first_token_seconds_bucket" in body


# ---- over a real HTTP server ---------------------------------------------------------------


async def test_a_client_that_hangs_up_frees_its_slot_at_once(two_replicas, alice_key, asgi_server):
    from apps.serving import balancer

    _, agents = two_replicas
    body = {"model": SMOLLM2, "messages": STORY, "max_tokens": 400, "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream(
            "POST",
            asgi_server + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {alice_key}"},
        ) as resp:
            replica = resp.headers["X-LlamaFleet-Replica"]
            lines = 0
            async for _ in resp.aiter_lines():
                lines += 1
                if lines == 6:
                    break
            assert agents[replica].agent.service.replicas[replica].engine.in_flight == 1
    # The connection is closed: the agent's slot and the shared count go back to zero.
    engine = agents[replica].agent.service.replicas[replica].engine

    async def settled():
        return not engine.in_flight and not (await balancer.in_flight([replica]))[replica]

    await async_wait_for(settled, timeout=5)


async def test_a_stopping_web_process_finishes_its_streams_and_writes_their_usage(
    two_replicas, alice_key, asgi_server
):
    """SIGTERM on the web process (uvicorn's should_exit): it takes no new connections, the
    stream in flight runs to its end, and its usage record is written before it exits."""
    from apps.usage.models import UsageRecord

    body = {"model": SMOLLM2, "messages": STORY, "max_tokens": 200, "stream": True}
    body["temperature"] = 0  # greedy: the story runs to max_tokens
    lines, stopping = [], None
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream(
            "POST",
            asgi_server + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {alice_key}"},
        ) as resp:
            async for line in resp.aiter_lines():
                lines.append(line)
                if len(lines) == 4:
                    stopping = asyncio.get_running_loop().run_in_executor(None, asgi_server.stop)
                    await asyncio.sleep(0.5)  # the server is shutting down from here on
                    with pytest.raises(httpx.ConnectError):
                        await httpx.AsyncClient().get(asgi_server + "/healthz")
    await stopping
    assert "data: [DONE]" in lines
    record = await UsageRecord.objects.aget()
    assert record.outcome == "ok" and record.completion_tokens == 200


async def test_embeddings_in_openais_shape(two_replicas, alice_key):
    import base64
    import struct

    async def embeddings(body, key=alice_key):
        return await AsyncClient().post(
            "/v1/embeddings",
            json.dumps(body),
            content_type="application/json",
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )

    floats = await embeddings({"model": SMOLLM2, "input": ["hello there", "general kenobi"]})
    assert floats.status_code == 200
    body = floats.json()
    assert body["object"] == "list" and body["model"] == SMOLLM2
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert len(body["data"][0]["embedding"]) == 576 and body["usage"]["prompt_tokens"] >= 4
    packed = (
        await embeddings({"model": SMOLLM2, "input": "hello there", "encoding_format": "base64"})
    ).json()["data"][0]["embedding"]
    vector = struct.unpack("<576f", base64.b64decode(packed))
    assert max(abs(a - b) for a, b in zip(vector, body["data"][0]["embedding"], strict=True)) < 1e-6
    for bad, param in (
        ({"model": SMOLLM2, "input": []}, "input"),
        ({"model": SMOLLM2, "input": "x", "dimensions": 64}, "dimensions"),
        ({"model": SMOLLM2, "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ):
        resp = await embeddings(bad)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    too_long = await embeddings({"model": SMOLLM2, "input": "word " * 700})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert (await embeddings({"model": "nope", "input": "x"})).status_code == 404
    assert (await embeddings({"model": SMOLLM2, "input": "x"}, key="")).status_code == 401


async def test_a_generation_past_the_request_timeout_ends_with_a_timeout_error(
    two_replicas, alice_key, settings
):
    settings.REQUEST_TIMEOUT_SECONDS = 0.6
    # Greedy: this story runs all 400 tokens (well past 0.6 s); a sampled one could end early.
    body = {"model": SMOLLM2, "messages": STORY, "max_tokens": 400, "temperature": 0}
    resp = await post(alice_key, {**body, "stream": True})
    chunks = [chunk async for chunk in resp.streaming_content]
    last = json.loads(sse_payloads(chunks)[-1])
    assert last["error"]["code"] == "timeout"
    # The replica is not blamed: the next request is served normally.
    settings.REQUEST_TIMEOUT_SECONDS = 600
    ok = await post(alice_key, {"model": SMOLLM2, "messages": CHAT, "max_tokens": 2})
    assert ok.status_code == 200


async def test_a_conversation_follows_its_cached_prefix(two_replicas, alice_key):
    """Prefix routing (the default for chat models): each turn of a conversation goes to
    the replica that served the turn before, and reuses its KV cache there."""
    from apps.serving import balancer

    d, agents = two_replicas
    assert d.routing_policy == "prefix"
    for c in range(4):  # several conversations, so both replicas get some
        messages = [
            {"role": "system", "content": f"You are assistant number {c}. " * 8},
            {"role": "user", "content": "Name a colour."},
        ]
        body = {"model": SMOLLM2, "messages": messages, "max_tokens": 8, "temperature": 0}
        first = await post(alice_key, body)
        replica = first["X-LlamaFleet-Replica"]
        answer = json.loads(first.content)["choices"][0]["message"]["content"]
        for turn in range(2):
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"And another one ({turn})?"},
            ]
            resp = await post(alice_key, body | {"messages": messages})
            data = json.loads(resp.content)
            assert resp["X-LlamaFleet-Replica"] == replica
            usage = data["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] // 2
            answer = data["choices"][0]["message"]["content"]
    # Bounded by slots: when every slot of the holder is busy (4), the other replica serves.
    client = balancer._redis()
    key = balancer._key(replica)
    await client.zadd(key, {f"busy-{i}": time.time() for i in range(4)})
    try:
        resp = await post(alice_key, body | {"messages": messages})
        assert resp["X-LlamaFleet-Replica"] != replica
    finally:
        await client.delete(key)


async def test_cache_prompt_false_evaluates_the_whole_prompt(two_replicas, alice_key):
    body = {"model": SMOLLM2, "messages": CHAT, "max_tokens": 4, "temperature": 0}
    await post(alice_key, body)
    warm = json.loads((await post(alice_key, body)).content)["usage"]
    cold = json.loads((await post(alice_key, body | {"cache_prompt": False})).content)["usage"]
    assert warm["prompt_tokens_details"]["cached_tokens"] == warm["prompt_tokens"] - 1
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    bad = await post(alice_key, body | {"cache_prompt": "no"})
    assert bad.status_code == 400 and json.loads(bad.content)["error"]["param"] == "cache_prompt"
