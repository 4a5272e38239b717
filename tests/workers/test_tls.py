"""Mutual TLS between the control plane and an agent, over real sockets: only a certificate of
the cluster CA gets through, and plaintext is refused off loopback on both ends."""

from __future__ import annotations

import os

import grpc
import pytest
from llamafleet.agent.v1 import agent_pb2 as pb
from llamafleet.agent.v1 import agent_pb2_grpc

from workers import tls

AUTH = (("authorization", f"Bearer {os.environ['LLAMAFLEET_NODE_TOKEN']}"),)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    cluster, other = tmp_path_factory.mktemp("cluster"), tmp_path_factory.mktemp("other")
    tls.make_ca(cluster)
    tls.make_ca(other)
    return {
        "agent": tls.issue(cluster, "agent", ["127.0.0.1"]),
        "client": tls.issue(cluster, "web", ["control-plane"]),
        "stranger": tls.issue(other, "web", ["control-plane"]),  # another CA's certificate
    }


@pytest.fixture(scope="module")
def tls_agent(model_store, pki):
    from tests.conftest import RunningAgent

    running = RunningAgent(model_store, tls_files=pki["agent"])
    yield running
    running.close()


def status(address: str, files) -> pb.GetStatusResponse:
    with tls.channel(address, files) as ch:
        return agent_pb2_grpc.NodeAgentStub(ch).GetStatus(
            pb.GetStatusRequest(), metadata=AUTH, timeout=5
        )


def test_a_cluster_certificate_gets_through(tls_agent, pki):
    assert status(tls_agent.address, pki["client"]).node_name == "node-a"


@pytest.mark.parametrize("who", ["plaintext", "stranger"])
def test_no_cluster_certificate_no_call(tls_agent, pki, who):
    with pytest.raises(grpc.RpcError) as err:
        status(tls_agent.address, None if who == "plaintext" else pki[who])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_without_tls_files_an_agent_listens_on_loopback_only():
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(1))
    for address in ("0.0.0.0:0", "[::]:0", "10.0.0.5:0"):
        with pytest.raises(tls.PlaintextRefused, match="not a loopback address"):
            tls.add_port(server, address, None)
    assert tls.add_port(server, "127.0.0.1:0", None) > 0


def test_the_control_plane_will_not_send_the_token_in_plaintext_off_loopback():
    with pytest.raises(tls.PlaintextRefused) as err:
        tls.channel("10.0.0.5:50051", None)
    assert (
        err.value.code() == grpc.StatusCode.UNAVAILABLE
        and "LLAMAFLEET_TLS_CA" in err.value.details()
    )
