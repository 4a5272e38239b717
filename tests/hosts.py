"""Several hosts on one machine: Linux network namespaces on a bridge, each with its own
address, processes and (optionally) a shaped link. Used by the cross-host tests and by
bench/split.py; needs root.

This machine is 10.77.N.1 on the bridge; host i is 10.77.N.(10 + i). `tc` tbf shapes
each host's link; the kernel here has no netem, so latency comes from `relay`, a TCP relay
that holds every chunk for a fixed delay in each direction.

    python tests/hosts.py relay LISTEN_HOST:PORT TARGET_HOST:PORT DELAY_MS
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def available() -> str:
    """Why hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) is not installed"
    probe = f"lfprobe{os.getpid() % 10000}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode:
        return "cannot create network namespaces"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _sh(*argv: str, ns: str = "") -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")


class Hosts:
    """n namespaces on one bridge; `down()` removes everything `up()` made."""

    def __init__(self, n: int):
        tag = os.getpid() % 10000
        self.n = n
        self.bridge = f"lfb{tag}"
        self.subnet = 20 + tag % 200
        self.namespaces = [f"lf{tag}h{i}" for i in range(n)]
        self.veths = [f"lf{tag}v{i}" for i in range(n)]
        self.gateway = f"10.77.{self.subnet}.1"
        self.procs: list[subprocess.Popen] = []

    def ip(self, i: int) -> str:
        return f"10.77.{self.subnet}.{10 + i}"

    def up(self) -> Hosts:
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _sh("ip", "link", "set", self.bridge, "up")
            for i, (ns, veth) in enumerate(zip(self.namespaces, self.veths, strict=True)):
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _sh("ip", "link", "set", veth, "master", self.bridge, "up")
                _sh("ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0", ns=ns)
                _sh("ip", "link", "set", "eth0", "up", ns=ns)
                _sh("ip", "link", "set", "lo", "up", ns=ns)
        except Exception:
            self.down()
            raise
        return self

    def shape(self, rate: str = "1gbit") -> None:
        """tbf on both ends of every host's link: `rate` each way."""
        for ns, veth in zip(self.namespaces, self.veths, strict=True):
            for dev, where in ((veth, ""), ("eth0", ns)):
                _sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "20ms", ns=where)  # fmt: skip

    def unshape(self) -> None:
        for ns, veth in zip(self.namespaces, self.veths, strict=True):
            for dev, where in ((veth, ""), ("eth0", ns)):
                subprocess.run(
                    (["ip", "netns", "exec", where] if where else [])
                    + ["tc", "qdisc", "del", "dev", dev, "root"],
                    capture_output=True,
                )

    def spawn(self, i: int, argv: list[str], log: Path, env: dict | None = None):
        """Start a process on host i (None: on this machine), output to log."""
        prefix = ["ip", "netns", "exec", self.namespaces[i]] if i is not None else []
        with open(log, "ab") as out:
            p = subprocess.Popen(
                prefix + argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )  # fmt: skip
        self.procs.append(p)
        return p

    def kill_host(self, i: int) -> list[int]:
        """SIGKILL every process on host i, as a power cut would; returns their pids."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[i]], capture_output=True, text=True
        )
        pids = [int(p) for p in out.stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def down(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for i in range(self.n):
            self.kill_host(i)
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for veth in self.veths:
            subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def pki(directory: Path, hosts: Hosts):
    """A cluster CA with one certificate for every host's address and the tests' client."""
    from workers import tls

    tls.make_ca(directory)
    return tls.issue(directory, "cluster", [hosts.ip(i) for i in range(hosts.n)] + ["127.0.0.1"])


def start_agent(hosts: Hosts, i: int, store: Path, log_dir: Path, threads: int = 2, files=None):
    """A node agent on host i, listening on its own address (port 50051), with mutual TLS
    (files from pki()): plaintext gRPC is refused off loopback."""
    address = f"{hosts.ip(i)}:50051"
    argv = [sys.executable, "-m", "workers", "agent", "--name", f"host{i}", "--listen", address,
            "--advertise", address, "--models-dir", str(store), "--threads", str(threads),
            "--control-plane", ""]  # fmt: skip
    if files is not None:
        argv += ["--tls-ca", files.ca, "--tls-cert", files.cert, "--tls-key", files.key]
    hosts.spawn(i, argv, log_dir / f"agent-host{i}.log")
    return address


def wait_agent(address: str, token: str, timeout: float = 60, files=None) -> None:
    import grpc
    from llamafleet.agent.v1 import agent_pb2 as pb
    from llamafleet.agent.v1 import agent_pb2_grpc

    from workers import tls

    deadline = time.monotonic() + timeout
    with tls.channel(address, files) as ch:
        stub = agent_pb2_grpc.NodeAgentStub(ch)
        while True:
            try:
                stub.GetStatus(
                    pb.GetStatusRequest(),
                    metadata=(("authorization", f"Bearer {token}"),),
                    timeout=2,
                )
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


# ---- the delaying relay ----------------------------------------------------------------


def relay(listen: str, target: str, delay_ms: float) -> None:
    """Forward TCP connections from listen to target, holding each chunk delay_ms in each
    direction (order kept). Threads and time.sleep, not an event loop: epoll's timeouts are
    whole milliseconds, which would turn 0.5 ms into 1. Runs until killed."""
    import queue
    import socket
    import threading

    delay = delay_ms / 1000

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        chunks: queue.Queue = queue.Queue()

        def read():
            while data := src.recv(1 << 16):
                chunks.put((time.monotonic() + delay, data))
            chunks.put((0.0, b""))

        threading.Thread(target=read, daemon=True).start()
        while True:
            due, data = chunks.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            dst.sendall(data)
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def serve(client: socket.socket) -> None:
        host, _, port = target.rpartition(":")
        try:
            upstream = socket.create_connection((host, int(port)))
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
        pipe(upstream, client)

    host, _, port = listen.rpartition(":")
    server = socket.create_server((host, int(port)))
    while True:
        client, _ = server.accept()
        threading.Thread(target=serve, args=(client,), daemon=True).start()


if __name__ == "__main__":
    if sys.argv[1:2] == ["relay"]:
        relay(sys.argv[2], sys.argv[3], float(sys.argv[4]))
