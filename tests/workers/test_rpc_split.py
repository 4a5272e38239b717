"""One model split across two agents over llama.cpp's RPC backend, on loopback sockets.

The head agent loads the model with the other agent's rpc server as a device for its last
layers: greedy text equals llama-cpp-python's in-process text. Killing the rpc server kills
the head's engine (llama.cpp aborts), and the head agent says so and keeps serving.
"""

from __future__ import annotations

import os
import signal
import socket

import grpc
import pytest
from llamafleet.agent.v1 import agent_pb2 as pb
from llamafleet.agent.v1 import agent_pb2_grpc

from tests.conftest import CHAT, RunningAgent, free_port

SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
AUTH = (("authorization", f"Bearer {os.environ['LLAMAFLEET_NODE_TOKEN']}"),)


@pytest.fixture
def head_and_stage(model_store):
    agents = [RunningAgent(model_store, "head"), RunningAgent(model_store, "stage")]
    channels = [grpc.insecure_channel(a.address) for a in agents]
    yield [(a, agent_pb2_grpc.NodeAgentStub(c)) for a, c in zip(agents, channels, strict=True)]
    for a, c in zip(agents, channels, strict=True):
        c.close()
        a.close()


def test_a_model_split_over_an_rpc_server_gives_the_single_node_text(
    head_and_stage, reference_text
):
    (head, head_stub), (stage, stage_stub) = head_and_stage
    port = free_port()
    status = stage_stub.StartRpcServer(
        pb.StartRpcServerRequest(port=port, threads=1), metadata=AUTH
    )
    assert status.running and status.endpoint == f"127.0.0.1:{port}" and status.pid
    # Idempotent, and reported in the node's status for the control plane.
    assert (
        stage_stub.StartRpcServer(pb.StartRpcServerRequest(port=port), metadata=AUTH).pid
        == status.pid
    )
    [reported] = stage_stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).rpc_servers
    assert reported.endpoint == status.endpoint and reported.running

    load = head_stub.LoadModel(
        pb.LoadModelRequest(
            replica_id="split",
            model_name="smollm2",
            sha256=SHA,
            context_length=512,
            parallel=2,
            rpc_servers=[status.endpoint],
            n_gpu_layers=16,  # of 30 layers: 14 stay on the head
        ),
        metadata=AUTH,
        timeout=120,
    )
    assert load.state == pb.REPLICA_STATE_READY, load.error
    request = pb.InferenceRequest(
        replica_id="split",
        max_tokens=48,
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT],
        sampling=pb.SamplingParams(temperature=0),
    )
    text = "".join(m.text for m in head_stub.RunInference(request, metadata=AUTH))
    assert text == reference_text(CHAT, 48)

    # The stage dies: the head's engine aborts with it; the head agent reports it and lives.
    os.kill(status.pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        list(head_stub.RunInference(request, metadata=AUTH))
    assert dict(err.value.trailing_metadata())["llamafleet-error-code"] == "ENGINE_FAILED"
    [replica] = head_stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).replicas
    assert replica.state == pb.REPLICA_STATE_FAILED and "SIGABRT" in replica.error
    [gone] = stage_stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH).rpc_servers
    assert not gone.running and "SIGKILL" in gone.error
    assert stage_stub.StopRpcServer(pb.StopRpcServerRequest(port=port), metadata=AUTH).stopped


def test_a_split_keeps_the_window_cache_with_a_whole_replicas_text(
    head_and_stage, model_store, gemma_path
):
    """A split keeps its deployment's window cache (LoadModel's swa_window): the stages hold
    their own layers' cells, a sliding layer's only the window. A conversation past
    gemma-3-270m's 512-token window, with its last 10 layers on the other agent's rpc
    server, gives the text of a whole replica on the head; its next turn reuses the whole
    history in its slot, with the whole replica's text again."""
    from apps.catalog.sources import GEMMA_CHAT_TEMPLATE

    (head, head_stub), (_, stage_stub) = head_and_stage
    stored = model_store / gemma_path.name
    if not stored.exists():
        os.link(gemma_path, stored)
    sha = gemma_path.name.removeprefix("sha256-").removesuffix(".gguf")
    port = free_port()
    rpc = stage_stub.StartRpcServer(pb.StartRpcServerRequest(port=port, threads=1), metadata=AUTH)
    notes = "Notes on owls. " * 250 + "What do the notes say?"
    texts, last_10 = {}, {"rpc_servers": [rpc.endpoint], "n_gpu_layers": 10}
    for rid, split in (("whole", {}), ("split", last_10)):
        load = head_stub.LoadModel(
            pb.LoadModelRequest(
                replica_id=rid,
                model_name="gemma",
                sha256=sha,
                chat_template=GEMMA_CHAT_TEMPLATE,
                context_length=2048,
                parallel=1,
                swa_window=True,
                **split,
            ),
            metadata=AUTH,
            timeout=120,
        )
        assert load.state == pb.REPLICA_STATE_READY, load.error
        assert head.agent.service.replicas[rid].engine.info["swa_full"] is False

        def ask(messages, rid=rid):
            request = pb.InferenceRequest(
                replica_id=rid,
                max_tokens=12,
                messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
                sampling=pb.SamplingParams(temperature=0),
            )
            replies = list(head_stub.RunInference(request, metadata=AUTH))
            return "".join(m.text for m in replies), replies[-1].usage

        first, usage = ask([("user", notes)])
        assert usage.prompt_tokens > 700 and first
        history = [("user", notes), ("assistant", first), ("user", "And at night?")]
        second, again = ask(history)
        assert again.cached_tokens >= usage.prompt_tokens
        texts[rid] = (first, second)
        head_stub.FreeMemory(pb.FreeMemoryRequest(replica_id=rid), metadata=AUTH)
    assert texts["split"] == texts["whole"]
    assert stage_stub.StopRpcServer(pb.StopRpcServerRequest(port=port), metadata=AUTH).stopped


def test_rpc_servers_refuse_bad_ports(head_and_stage):
    (_, stub), _ = head_and_stage
    with pytest.raises(grpc.RpcError) as err:
        stub.StartRpcServer(pb.StartRpcServerRequest(port=0), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_port_held_by_a_connection_is_in_use_though_nothing_listens(head_and_stage):
    """The port a connection holds as its local end answers no connect, yet ggml's server
    could not bind it (seen in CI: 50052 is inside the ephemeral range). The agent says
    ENDPOINT_IN_USE, so the control plane moves on to the next port."""
    (_, stub), _ = head_and_stage
    with socket.create_server(("127.0.0.1", 0)) as listener:
        held = free_port()
        client = socket.socket()
        client.bind(("127.0.0.1", held))
        client.connect(listener.getsockname())
        try:
            with pytest.raises(grpc.RpcError) as err:
                stub.StartRpcServer(pb.StartRpcServerRequest(port=held), metadata=AUTH)
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value.details()
            assert "already in use" in err.value.details()
        finally:
            client.close()


def test_a_head_checks_rpc_servers_and_measures_links(head_and_stage):
    (head, head_stub), (stage, stage_stub) = head_and_stage
    port, dead = free_port(), free_port()
    status = stage_stub.StartRpcServer(
        pb.StartRpcServerRequest(port=port, threads=1), metadata=AUTH
    )
    checks = head_stub.CheckRpcServers(
        pb.CheckRpcServersRequest(endpoints=[status.endpoint, f"127.0.0.1:{dead}"]), metadata=AUTH
    ).servers
    assert checks[0].ok and checks[0].total_bytes > 0 and checks[0].connect_ms > 0, checks[0]
    assert not checks[1].ok and "cannot connect" in checks[1].error
    # Something that accepts but does not speak ggml RPC: the handshake fails, clearly.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        ep = f"127.0.0.1:{listener.getsockname()[1]}"
        [bad] = head_stub.CheckRpcServers(
            pb.CheckRpcServersRequest(endpoints=[ep]), metadata=AUTH, timeout=30
        ).servers
    assert not bad.ok and "handshake" in bad.error
    # The server still serves a head after the check.
    [again] = head_stub.CheckRpcServers(
        pb.CheckRpcServersRequest(endpoints=[status.endpoint]), metadata=AUTH
    ).servers
    assert again.ok

    link = head_stub.MeasureLink(
        pb.MeasureLinkRequest(target=stage.address, bytes=4 << 20), metadata=AUTH, timeout=60
    )
    assert not link.error and 0 < link.rtt_ms < 100 and link.mbit_s > 10, link
    gone = head_stub.MeasureLink(
        pb.MeasureLinkRequest(target=f"127.0.0.1:{dead}"), metadata=AUTH, timeout=60
    )
    assert gone.error
