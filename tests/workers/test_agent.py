"""The node agent over real gRPC sockets, with real engine processes."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llamafleet.agent.v1 import agent_pb2 as pb
from llamafleet.agent.v1 import agent_pb2_grpc

from tests.conftest import CHAT, OWLS, TRAINS, wait_for

SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
AUTH = (("authorization", f"Bearer {os.environ['LLAMAFLEET_NODE_TOKEN']}"),)


@pytest.fixture
def stub(agent):
    channel = grpc.insecure_channel(agent.address)
    yield agent_pb2_grpc.NodeAgentStub(channel)
    channel.close()


def load(stub, replica_id="r1", sha=SHA, context_length=512, parallel=2, **fields):
    return stub.LoadModel(
        pb.LoadModelRequest(
            replica_id=replica_id,
            model_name="smollm2",
            sha256=sha,
            context_length=context_length,
            parallel=parallel,
            **fields,
        ),
        metadata=AUTH,
        timeout=120,
    )


def chat(replica_id="r1", messages=CHAT, max_tokens=48):
    return pb.InferenceRequest(
        replica_id=replica_id,
        max_tokens=max_tokens,
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        sampling=pb.SamplingParams(temperature=0),
    )


def error_code(err: grpc.RpcError) -> str:
    return dict(err.trailing_metadata() or ()).get("llamafleet-error-code", "")


def test_calls_need_the_node_token_but_health_is_open(agent, stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.GetStatus(pb.GetStatusRequest())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        list(stub.RunInference(chat(), metadata=(("authorization", "Bearer wrong"),)))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel = grpc.insecure_channel(agent.address)
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="llamafleet.agent.v1.NodeAgent"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_load_stream_and_status(stub, reference_text):
    reply = load(stub)
    assert reply.state == pb.REPLICA_STATE_READY, reply.error
    assert reply.memory_bytes > 50_000_000
    msgs = list(stub.RunInference(chat(), metadata=AUTH))
    text = "".join(m.text for m in msgs)
    assert text == reference_text(CHAT, 48)
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert last.usage.completion_tokens > 0 and last.usage.prompt_tokens > 0
    assert last.timings.time_to_first_token > 0
    assert [m.index for m in msgs[:-1] if m.text] == list(range(len(msgs) - 1))
    status = stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH)
    assert status.cpu_cores >= 1 and status.memory_total_bytes > 0
    [replica] = status.replicas
    assert replica.state == pb.REPLICA_STATE_READY and replica.pid > 0
    assert replica.context_length == 512 and replica.parallel == 2
    tokens = stub.Tokenize(pb.TokenizeRequest(replica_id="r1", text="Hello world"), metadata=AUTH)
    assert len(tokens.tokens) >= 2 and tokens.context_length == 512


def test_load_is_idempotent(stub):
    first = load(stub)
    pid = stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).replicas[0].pid
    second = load(stub)
    assert first.state == second.state == pb.REPLICA_STATE_READY
    assert stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).replicas[0].pid == pid


def test_prompt_over_context_gets_its_error_code(stub):
    load(stub, context_length=128, parallel=1)
    long = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(grpc.RpcError) as err:
        list(stub.RunInference(chat(messages=long), metadata=AUTH))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_code(err.value) == "CONTEXT_LENGTH_EXCEEDED"
    assert "context window is 128" in err.value.details()


def test_unknown_replica_and_bad_requests(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.RunInference(chat(replica_id="nope"), metadata=AUTH))
    assert error_code(err.value) == "REPLICA_NOT_FOUND"
    load(stub)
    both = chat()
    both.prompt = "also a prompt"
    with pytest.raises(grpc.RpcError) as err:
        list(stub.RunInference(both, metadata=AUTH))
    assert error_code(err.value) == "INVALID_ARGUMENT"
    bad_role = chat(
        messages=[{"role": "assistant", "content": "x"}, {"role": "tool", "content": "y"}]
    )
    msgs = list(stub.RunInference(bad_role, metadata=AUTH))  # templates accept or refuse...
    assert msgs[-1].finish_reason  # ...but never crash the engine


def test_killed_engine_fails_the_stream_the_agent_survives_and_reloads(agent, stub, reference_text):
    load(stub)
    pid = agent.engine_pid("r1")
    call = stub.RunInference(
        chat(messages=[{"role": "user", "content": "Write a long story."}], max_tokens=400),
        metadata=AUTH,
    )
    received = 0
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            received += 1
            if received == 3:
                os.kill(pid, signal.SIGKILL)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_code(err.value) == "ENGINE_FAILED"
    assert "SIGKILL" in err.value.details()
    [replica] = stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).replicas
    assert replica.state == pb.REPLICA_STATE_FAILED and "SIGKILL" in replica.error
    assert load(stub).state == pb.REPLICA_STATE_READY  # loading again replaces the dead engine
    text = "".join(m.text for m in stub.RunInference(chat(), metadata=AUTH))
    assert text == reference_text(CHAT, 48)


def test_a_request_reaching_an_engine_that_just_died_fails_as_the_replicas_failure(agent, stub):
    """Between an engine's death and the agent reading its pipe's end, the replica still
    looks ready: a request sent then must fail as ENGINE_FAILED (UNAVAILABLE), which the
    control plane retries elsewhere, not as an unexpected BrokenPipeError (UNKNOWN)."""
    from workers.agent.service import inference_payload
    from workers.engine import errors as codes
    from workers.engine.errors import EngineError

    load(stub)
    engine = agent.agent.service.replicas["r1"].engine

    async def kill_then_generate():
        os.kill(engine.pid, signal.SIGKILL)
        engine._proc.join(10)  # blocks the agent's loop: the pipe's end is not read yet
        assert engine.state == "ready"
        try:
            async for _ in engine.generate(inference_payload(chat())):
                pass
        except EngineError as exc:
            return exc
        return None

    err = agent.call(kill_then_generate())
    assert err is not None and err.code == codes.ENGINE_FAILED, err
    wait_for(lambda: engine.state == "failed", timeout=10)  # then the exit is read as before
    assert "SIGKILL" in engine.error


def test_corrupt_or_missing_model_file_fails_clearly(agent, stub, smollm2_path, model_store):
    import hashlib

    data = smollm2_path.read_bytes()[:3_000_000]
    sha = hashlib.sha256(data).hexdigest()
    (model_store / f"sha256-{sha}.gguf").write_bytes(data)
    try:
        reply = load(stub, replica_id="bad", sha=sha)
        assert reply.state == pb.REPLICA_STATE_FAILED
        assert "could not load" in reply.error
        missing = load(stub, replica_id="missing", sha="0" * 64)
        assert missing.state == pb.REPLICA_STATE_FAILED and "no download URL" in missing.error
        assert load(stub).state == pb.REPLICA_STATE_READY  # the agent still serves
    finally:
        (model_store / f"sha256-{sha}.gguf").unlink()


def test_cancelling_a_stream_frees_its_slot(agent, stub):
    load(stub, parallel=1)
    call = stub.RunInference(
        chat(messages=[{"role": "user", "content": "Write a long story."}], max_tokens=500),
        metadata=AUTH,
    )
    next(call)
    call.cancel()
    wait_for(
        lambda: stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).in_flight == 0,
        timeout=10,
        interval=0.05,
    )
    # With its only slot free again, the next request is served at once.
    started = time.monotonic()
    msgs = list(stub.RunInference(chat(max_tokens=4), metadata=AUTH))
    assert msgs[-1].finish_reason and time.monotonic() - started < 30


def test_headers_go_out_before_the_first_token(agent, stub):
    """A call's headers do not wait for its first token (sent with it, they cost the caller
    one more wake-up on the way to that token): here they arrive while the request still
    waits for the only slot."""
    load(stub, parallel=1)
    busy = stub.RunInference(
        chat(messages=[{"role": "user", "content": "Write a long story."}], max_tokens=500),
        metadata=AUTH,
    )
    next(busy)  # it holds the slot for hundreds of tokens
    waiting = stub.RunInference(chat(max_tokens=4), metadata=AUTH)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(waiting.initial_metadata).result(timeout=30)
    # Both still in flight: the waiting request has no token yet, and no slot.
    assert stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).in_flight == 2
    busy.cancel()
    assert list(waiting)[-1].finish_reason


def test_time_to_first_token_counts_the_wait_for_the_step_in_progress(stub):
    """The engine reads new requests between steps: one arriving while a long prompt is
    being read waits in the pipe until that step ends. The time to first token the agent
    reports (its metrics, the usage it returns) starts when the agent hands the request
    over, so that wait is in it: it is about what the agent's caller saw."""
    load(stub, context_length=2048, parallel=2)
    story = [{"role": "user", "content": "Tell me everything about owls. " * 250}]
    long = stub.RunInference(chat(messages=story, max_tokens=2), metadata=AUTH)
    with ThreadPoolExecutor(1) as pool:
        first_long = pool.submit(next, long)
        time.sleep(0.3)  # the long prompt's first steps (512 tokens each) are under way
        start = time.monotonic()
        short = stub.RunInference(chat(max_tokens=2), metadata=AUTH)
        first = next(short)
        seen = time.monotonic() - start
        msgs = [first, *short]
        first_long.result(timeout=60)
    long.cancel()
    reported = msgs[-1].timings.time_to_first_token
    assert seen > 0.1  # it did wait for a step (each reads 512 prompt tokens)
    # What the agent reports covers what was seen here, short of the two gRPC hops.
    assert reported >= 0.9 * seen - 0.02, (reported, seen)
    assert reported <= seen


def test_free_memory_stops_the_engine_and_is_idempotent(agent, stub):
    load(stub)
    pid = agent.engine_pid("r1")
    assert stub.FreeMemory(pb.FreeMemoryRequest(replica_id="r1"), metadata=AUTH).freed
    assert not stub.FreeMemory(pb.FreeMemoryRequest(replica_id="r1"), metadata=AUTH).freed
    with pytest.raises(OSError):
        os.kill(pid, 0)
    assert not stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).replicas


def test_metrics_need_the_node_token_and_describe_replicas(model_store):
    """GET /metrics of an agent over a real socket."""
    import httpx

    from tests.conftest import METRICS_TOKEN, RunningAgent

    running = RunningAgent(model_store, metrics_listen="127.0.0.1:0")
    try:
        channel = grpc.insecure_channel(running.address)
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        assert load(stub).state == pb.REPLICA_STATE_READY
        list(stub.RunInference(chat(max_tokens=4), metadata=AUTH))
        port = running.agent.metrics_server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/metrics"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        scrape = {"Authorization": f"Bearer {METRICS_TOKEN}"}
        # The node token does everything else; /metrics takes only the scrape-only token.
        assert httpx.get(url, headers={"Authorization": AUTH[0][1]}).status_code == 401
        assert httpx.get(url.replace("/metrics", "/other"), headers=scrape).status_code == 404
        body = httpx.get(url, headers=scrape).text
        assert 'llamafleet_agent_replica_ready{model="smollm2",replica="r1"} 1.0' in body
        assert 'llamafleet_agent_in_flight{model="smollm2",replica="r1"} 0.0' in body
        assert (
            'llamafleet_agent_generations_total{model="smollm2",outcome="length",replica="r1"} 1.0'
            in body
        )
        assert 'llamafleet_agent_completion_tokens_total{model="smollm2",replica="r1"} 4.0' in body
        channel.close()
    finally:
        running.close()


def test_a_conversation_pushed_out_of_the_slots_is_restored_from_host_ram(agent, stub, monkeypatch):
    """A one-slot replica and two conversations taking turns over gRPC: the third turn's
    history comes back from the agent's host-RAM prompt cache, and the metrics say so. The
    part of the cache's budget not filled yet is reported as not available, so the planner
    does not promise it to another replica."""
    from workers.agent import system

    gib = 1 << 30
    monkeypatch.setattr(system, "meminfo", lambda: (16 * gib, 8 * gib))
    budget = agent.agent.service.prompt_cache_bytes
    assert budget > 0

    def available() -> int:
        return stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).memory_available_bytes

    assert available() == 8 * gib
    load(stub, parallel=1, context_length=1024)
    assert available() == 8 * gib - budget
    for messages in (OWLS, TRAINS):
        list(stub.RunInference(chat(messages=messages, max_tokens=8), metadata=AUTH))
    last = list(stub.RunInference(chat(messages=OWLS, max_tokens=8), metadata=AUTH))[-1]
    assert last.usage.cached_tokens == last.usage.prompt_tokens - 1
    metrics = agent.agent.service.metrics.registry
    labels = {"replica": "r1", "model": "smollm2"}
    assert metrics.get_sample_value("llamafleet_agent_prompt_cache_host_hits_total", labels) == 1
    assert (
        metrics.get_sample_value("llamafleet_agent_prompt_cache_host_tokens_total", labels)
        == last.usage.cached_tokens
    )
    held = metrics.get_sample_value("llamafleet_agent_prompt_cache_host_bytes", labels)
    assert held > 0
    assert available() == 8 * gib - (budget - held)
    stub.FreeMemory(pb.FreeMemoryRequest(replica_id="r1"), metadata=AUTH)
    assert available() == 8 * gib


def test_an_idle_engine_copies_finished_conversations_to_host_ram(agent, stub):
    """Between requests the engine copies a finished conversation to host RAM before any
    request needs its slot (save_ahead): with a slot still free, nothing was pushed out,
    and the host cache holds a copy all the same. The agent counts the copy's bytes as
    taken when the engine makes it, not at the next request's end (CacheSize)."""
    load(stub, parallel=2, context_length=1024)
    metrics = agent.agent.service.metrics.registry
    labels = {"replica": "r1", "model": "smollm2"}

    def host_bytes() -> float:
        return metrics.get_sample_value("llamafleet_agent_prompt_cache_host_bytes", labels)

    list(stub.RunInference(chat(messages=OWLS, max_tokens=8), metadata=AUTH))
    # Idle (over SAVE_AHEAD_AFTER): the engine copies OWLS's slot, and says so.
    deadline = time.monotonic() + 5
    while host_bytes() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    copied = host_bytes()
    assert copied > 0
    replica = agent.agent.service.replicas["r1"]
    assert replica.host_cache_unfilled() == replica.engine.config.host_cache_bytes - copied
    list(stub.RunInference(chat(messages=TRAINS, max_tokens=8), metadata=AUTH))
    assert host_bytes() >= copied
    assert not metrics.get_sample_value("llamafleet_agent_prompt_cache_host_hits_total", labels)
    stub.FreeMemory(pb.FreeMemoryRequest(replica_id="r1"), metadata=AUTH)


def test_the_agents_flash_attention_setting_reaches_its_engines(agent, stub, monkeypatch):
    """--flash-attn off (a CPU node serving chats with long histories) loads whole replicas
    with it off; the engine process reports what it asked llama.cpp for."""
    monkeypatch.setattr(agent.agent.service, "flash_attn", "off")
    load(stub)
    replies = list(stub.RunInference(chat(max_tokens=8), metadata=AUTH))
    assert replies[-1].usage.completion_tokens > 0
    assert agent.agent.service.replicas["r1"].engine.info["flash_attn"] == "off"
    stub.FreeMemory(pb.FreeMemoryRequest(replica_id="r1"), metadata=AUTH)


@pytest.mark.parametrize("swa_window", [True, False])
def test_the_load_requests_sliding_window_cache_reaches_its_engine(agent, stub, swa_window):
    """LoadModel's swa_window (a deployment's swa_cache) loads the replica with llama.cpp's
    window-sized cache, or the full one without it; the engine reports what it asked for,
    and the agent serves either way. The agent says it honours the field (its features):
    the control plane plans an agent that does not with the full cache."""
    assert "swa-window" in stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).features
    load(stub, swa_window=swa_window)
    replies = list(stub.RunInference(chat(max_tokens=8), metadata=AUTH))
    assert replies[-1].usage.completion_tokens > 0
    assert agent.agent.service.replicas["r1"].engine.info["swa_full"] is not swa_window
    stub.FreeMemory(pb.FreeMemoryRequest(replica_id="r1"), metadata=AUTH)


def test_busy_engines_share_the_agents_cores_and_one_alone_takes_them_all(agent, stub):
    """Two replicas on one agent of 2 threads: each decodes with both while the other is
    idle, with one each while both generate (all cores each oversubscribe the machine), and
    the one left running gets both back when the other ends. A replica loaded with a count
    of its own keeps it, and that count comes off what the others share."""

    def threads() -> dict[str, int]:
        status = stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH)
        return {r.replica_id: r.threads for r in status.replicas}

    long = [{"role": "user", "content": "Write a very long story about the sea."}]
    for rid in ("r1", "r2"):
        assert load(stub, rid, parallel=1).state == pb.REPLICA_STATE_READY
    assert threads() == {"r1": 2, "r2": 2}
    first = stub.RunInference(chat("r1", long, max_tokens=400), metadata=AUTH)
    next(first)
    assert threads() == {"r1": 2, "r2": 2}  # r2 is idle: it takes no share
    second = stub.RunInference(chat("r2", long, max_tokens=400), metadata=AUTH)
    next(second)
    assert threads() == {"r1": 1, "r2": 1}
    first.cancel()
    wait_for(lambda: threads() == {"r1": 1, "r2": 2}, timeout=10, interval=0.05)
    # The engine of r2 took the new count between steps and streams on to its end.
    rest = list(second)
    assert rest[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert rest[-1].usage.completion_tokens > 1

    pinned = stub.LoadModel(
        pb.LoadModelRequest(
            replica_id="r3", model_name="smollm2", sha256=SHA, context_length=512, parallel=1,
            threads=1,
        ),
        metadata=AUTH,
        timeout=120,
    )  # fmt: skip
    assert pinned.state == pb.REPLICA_STATE_READY
    wait_for(lambda: agent.agent.service.replicas["r2"].engine.generating == 0, timeout=10)
    third = stub.RunInference(chat("r3", long, max_tokens=400), metadata=AUTH)
    next(third)
    again = stub.RunInference(chat("r1", long, max_tokens=400), metadata=AUTH)
    next(again)
    assert threads()["r3"] == 1 and threads()["r1"] == 1  # 2 cores, 1 of them pinned to r3
    third.cancel()
    again.cancel()
