"""A fake node agent: the real gRPC contract on a real socket, with no model behind it.

For fast tests of the control plane's services (deploy, scale, fail, free, typed errors),
beside the tests that load SmolLM2 in a real agent. It records every call, answers LoadModel
at once (or with the failure a test sets), and reports what it holds as a real agent would.
"""

from __future__ import annotations

import uuid
from concurrent import futures

import grpc
from google.protobuf.json_format import MessageToDict
from llamafleet.agent.v1 import agent_pb2 as pb
from llamafleet.agent.v1 import agent_pb2_grpc

import workers
from workers.engine import errors

GIB = 1 << 30


class FakeAgent(agent_pb2_grpc.NodeAgentServicer):
    def __init__(self, name: str = "fake-a", memory_gib: int = 16):
        self.name = name
        self.memory = memory_gib * GIB
        self.boot_id = uuid.uuid4().hex
        self.calls: list[tuple[str, object]] = []
        self.replicas: dict[str, pb.ReplicaStatus] = {}
        self.load_error = ""  # LoadModel answers FAILED with this, when set
        self.unreachable: set[str] = set()  # MeasureLink to these addresses fails
        #: StartRpcServer fails for these ports with these ErrorCode values.
        self.port_errors: dict[int, int] = {}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        agent_pb2_grpc.add_NodeAgentServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(0)

    def calls_of(self, method: str) -> list:
        return [request for name, request in self.calls if name == method]

    # ---- the contract ----------------------------------------------------------------------

    def LoadModel(self, request, context):
        self.calls.append(("LoadModel", request))
        if self.load_error:
            return pb.LoadModelResponse(state=pb.REPLICA_STATE_FAILED, error=self.load_error)
        self.replicas[request.replica_id] = pb.ReplicaStatus(
            replica_id=request.replica_id,
            model_name=request.model_name,
            state=pb.REPLICA_STATE_READY,
            memory_bytes=GIB // 4,
        )
        return pb.LoadModelResponse(
            state=pb.REPLICA_STATE_READY, memory_bytes=GIB // 4, load_seconds=0.01
        )

    def FreeMemory(self, request, context):
        self.calls.append(("FreeMemory", request))
        return pb.FreeMemoryResponse(freed=self.replicas.pop(request.replica_id, None) is not None)

    def StartRpcServer(self, request, context):
        self.calls.append(("StartRpcServer", request))
        if request.port in self.port_errors:
            code = self.port_errors[request.port]
            abort(context, code, f"127.0.0.1:{request.port} is already in use")
        return pb.RpcServerStatus(endpoint=f"127.0.0.1:{request.port}", running=True, pid=1)

    def MeasureLink(self, request, context):
        self.calls.append(("MeasureLink", request))
        if request.target in self.unreachable:
            why = f"{request.target} did not answer"
            return pb.LinkMeasurement(target=request.target, error=why)
        return pb.LinkMeasurement(target=request.target, rtt_ms=0.4, mbit_s=940.0)

    def GetStatus(self, request, context):
        self.calls.append(("GetStatus", request))
        return self.status()

    # ---- what a real agent reports ---------------------------------------------------------

    def status(self) -> pb.NodeStatus:
        return pb.NodeStatus(
            node_name=self.name,
            version="fake",
            memory_total_bytes=self.memory,
            memory_available_bytes=self.memory - GIB,
            cpu_cores=8,
            replicas=list(self.replicas.values()),
            boot_id=self.boot_id,
            features=workers.FEATURES,
        )

    def payload(self) -> dict:
        """A heartbeat, as the real agent posts it."""
        d = MessageToDict(self.status(), preserving_proto_field_name=True)
        d["address"] = self.address
        return d


def abort(context, code: int, message: str) -> None:
    """Fail the call the way the real agent does: a status and its ErrorCode's name."""
    context.set_trailing_metadata(((errors.METADATA_KEY, errors.code_name(code)),))
    context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
