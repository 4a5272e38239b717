"""RPC servers this agent runs for heads elsewhere: one process each (the server never
returns, has no stop call and serves one head at a time)."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import socket
import statistics
import sys
import time

import grpc
from llamafleet.agent.v1 import agent_pb2 as pb
from llamafleet.agent.v1 import agent_pb2_grpc

from workers import tls
from workers.engine import errors
from workers.engine.errors import EngineError
from workers.engine.process import describe_exit

log = logging.getLogger(__name__)


def _child(endpoint: str, threads: int, cache_dir: str) -> None:
    from workers.engine import rpc

    rpc.serve(endpoint, threads, cache_dir)


def _connect(host: str, port: int, timeout: float = 3.0) -> None:
    """Open and close a TCP connection; raises OSError when nothing answers."""
    with socket.create_connection((host, port), timeout=timeout):
        pass


def _answers(host: str, port: int) -> bool:
    try:
        _connect(host, port, timeout=0.2)
    except OSError:
        return False
    return True


def _bindable(host: str, port: int) -> bool:
    """Could a server bind host:port now? Not only a listener holds a port: a connection's
    local end can too (50052 is inside Linux's ephemeral range), and then nothing answers a
    connect but ggml's server still fails to bind ("Failed to create server socket", exit 0)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class RpcServer:
    """One llama.cpp RPC server process bound to host:port."""

    def __init__(self, host: str, port: int, threads: int, cache_dir: str = ""):
        self.host, self.port, self.threads, self.cache_dir = host, port, threads, cache_dir
        self.endpoint = f"{host}:{port}"
        self._proc = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def error(self) -> str:
        if self._proc is None or self._proc.is_alive():
            return ""
        return describe_exit(self._proc.exitcode).replace("engine", "rpc server")

    def _in_use(self) -> EngineError:
        return EngineError(errors.ENDPOINT_IN_USE, f"{self.endpoint} is already in use")

    async def start(self, timeout: float = 15.0) -> None:
        if _answers(self.host, self.port) or not _bindable(self.host, self.port):
            raise self._in_use()
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=_child,
            args=(self.endpoint, self.threads, self.cache_dir),
            name="llamafleet-rpc",
            daemon=True,
        )
        self._proc.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._proc.is_alive():
                if not _bindable(self.host, self.port):  # taken between the check and now
                    raise self._in_use()
                raise EngineError(
                    errors.ENGINE_FAILED, f"rpc server at {self.endpoint}: {self.error}"
                )
            if await asyncio.to_thread(_answers, self.host, self.port):
                log.info("rpc server listening at %s (%d threads)", self.endpoint, self.threads)
                return
            await asyncio.sleep(0.1)
        self.stop()
        raise EngineError(
            errors.ENGINE_FAILED, f"rpc server at {self.endpoint} did not start listening"
        )

    def stop(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    @property
    def pid(self) -> int:
        return self._proc.pid if self.running else 0


async def check(endpoint: str, timeout: float = 10.0) -> pb.RpcServerCheck:
    """Can a head on this node use the rpc server at endpoint? TCP first (a clear error and
    the connect time), then ggml's own HELLO handshake and memory query in a child process:
    llama.cpp aborts on a failed or incompatible connection."""
    out = pb.RpcServerCheck(endpoint=endpoint)
    host, _, port = endpoint.rpartition(":")
    started = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.to_thread(_connect, host, int(port)), timeout)
    except (OSError, ValueError, TimeoutError) as exc:
        out.error = f"cannot connect to {endpoint}: {exc or type(exc).__name__}"
        return out
    out.connect_ms = (time.perf_counter() - started) * 1000
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workers.engine.rpc", "check", endpoint,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        out.error = f"{endpoint} accepted a connection but did not answer the RPC handshake"
        return out
    if proc.returncode != 0:
        lines = [ln for ln in stderr.decode(errors="replace").splitlines() if ln.strip()]
        why = next((ln for ln in lines if "version" in ln.lower()), lines[-1] if lines else "")
        out.error = f"{endpoint} failed the RPC handshake: {why.split(': ', 1)[-1] or 'aborted'}"
        return out
    facts = json.loads(stdout.decode().strip().splitlines()[-1])
    out.ok, out.free_bytes, out.total_bytes = True, facts["free_bytes"], facts["total_bytes"]
    return out


async def measure_link(
    target: str, metadata, total_bytes: int, tls_files=None
) -> pb.LinkMeasurement:
    """Median round trip of 7 empty Echo calls, then throughput of 1 MiB Echo calls."""
    out = pb.LinkMeasurement(target=target)
    chunk = b"\0" * (1 << 20)
    try:
        async with tls.channel(
            target, tls_files, aio=True, options=[("grpc.max_receive_message_length", 8 << 20)]
        ) as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            rtts = []
            for _ in range(7):
                t = time.perf_counter()
                await stub.Echo(pb.EchoRequest(), metadata=metadata, timeout=5)
                rtts.append(time.perf_counter() - t)
            n = max(1, (total_bytes or 8 << 20) // len(chunk))
            t = time.perf_counter()
            for _ in range(n):
                await stub.Echo(pb.EchoRequest(payload=chunk), metadata=metadata, timeout=30)
            seconds = time.perf_counter() - t
    except grpc.RpcError as exc:
        out.error = f"{target}: {errors.describe(exc)}"
        return out
    out.rtt_ms = statistics.median(rtts) * 1000
    out.mbit_s = n * len(chunk) * 8 / seconds / 1e6
    return out
