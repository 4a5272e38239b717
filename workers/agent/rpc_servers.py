"""RPC servers this agent runs for heads elsewhere: one process each (the server never
returns, has no stop call and serves one head at a time)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import socket
import time

from workers.engine.errors import EngineError
from workers.engine.process import describe_exit

log = logging.getLogger(__name__)


def _child(endpoint: str, threads: int, cache_dir: str) -> None:
    from workers.engine import rpc

    rpc.serve(endpoint, threads, cache_dir)


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


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

    async def start(self, timeout: float = 15.0) -> None:
        if _answers(self.host, self.port):
            raise EngineError("INVALID_ARGUMENT", f"{self.endpoint} is already in use")
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
                raise EngineError("ENGINE_FAILED", f"rpc server at {self.endpoint}: {self.error}")
            if await asyncio.to_thread(_answers, self.host, self.port):
                log.info("rpc server listening at %s (%d threads)", self.endpoint, self.threads)
                return
            await asyncio.sleep(0.1)
        self.stop()
        raise EngineError("ENGINE_FAILED", f"rpc server at {self.endpoint} did not start listening")

    def stop(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    @property
    def pid(self) -> int:
        return self._proc.pid if self.running else 0
