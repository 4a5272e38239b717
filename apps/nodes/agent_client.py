"""gRPC clients of node agents: blocking ones for Celery tasks, asyncio ones for serving.

Channels are cached per address: opening one costs a TCP and HTTP/2 handshake, which must
not land on every request's time to first token.
"""

from __future__ import annotations

import asyncio

import grpc
from django.conf import settings
from llamafleet.agent.v1 import agent_pb2_grpc

from workers import tls
from workers.engine import errors

_sync_channels: dict[tuple, grpc.Channel] = {}
_aio_channels: dict[tuple, grpc.aio.Channel] = {}


#: Deadlines of the control plane's calls to agents, in seconds (the serving path's own is
#: settings.REQUEST_TIMEOUT_SECONDS).
STATUS_TIMEOUT = 3.0  # GetStatus: is the agent there at all
CONTROL_TIMEOUT = 30.0  # FreeMemory, StopRpcServer
START_TIMEOUT = 60.0  # StartRpcServer, CheckRpcServers, MeasureLink (a transfer)
PROBE_TIMEOUT = 120.0  # one token through a split just loaded
LOAD_TIMEOUT = 900  # LoadModel, the model's download included


def metadata() -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {settings.NODE_TOKEN}"),)


def stub(address: str) -> agent_pb2_grpc.NodeAgentStub:
    """A blocking stub, for tasks. Mutual TLS under the cluster CA (settings.AGENT_TLS);
    plaintext only to loopback, else tls.PlaintextRefused (an RpcError, UNAVAILABLE)."""
    key = (address, settings.AGENT_TLS)
    channel = _sync_channels.get(key)
    if channel is None:
        channel = _sync_channels[key] = tls.channel(address, settings.AGENT_TLS)
    return agent_pb2_grpc.NodeAgentStub(channel)


def aio_stub(address: str) -> agent_pb2_grpc.NodeAgentStub:
    """An asyncio stub bound to the running event loop, for the serving path; as stub(), with
    grpc.aio.AioRpcError (UNAVAILABLE) for refused plaintext."""
    key = (id(asyncio.get_running_loop()), address, settings.AGENT_TLS)
    channel = _aio_channels.get(key)
    if channel is None:
        channel = _aio_channels[key] = tls.channel(address, settings.AGENT_TLS, aio=True)
    return agent_pb2_grpc.NodeAgentStub(channel)


def error_code(exc: grpc.RpcError) -> int:
    """The agent's ErrorCode value for a failed call (UNSPECIFIED when it sent none)."""
    try:
        trailing = exc.trailing_metadata() or ()
    except Exception:  # a call that never reached the agent has no trailers
        return errors.UNSPECIFIED
    return errors.code_of(dict(trailing).get(errors.METADATA_KEY, ""))
