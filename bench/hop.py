"""What a leaner hop between the web process and a local agent could be worth.

`python bench/hop.py [--rounds 3] [--messages 60]` times one message each way between two
processes, as the cold request's path crosses them, over grpc.aio (what the web process and
the agent speak: a unary-stream call on a loopback channel, the call's headers sent at its
start as the agent does) and over a plain asyncio Unix socket with length-prefixed frames
(the leanest hop an asyncio process could have):

- request: the caller's loop starting a call until the handler runs in the other process's
  loop, on idle cores (a cold request arrives while the engine waits);
- response: an "engine" process writing to a pipe, the "agent" loop reading it and sending
  the message on, until the caller's loop has it; with two busy processes spinning on the
  two cores, as the engine's decode threads do while the first token travels.

Timestamps are CLOCK_MONOTONIC, shared by the processes. The two transports alternate round
by round. Writes bench/results/hop.json. It measures transports, not the stack: the
difference bounds what replacing gRPC for a replica on the web process's machine could take
off the time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench/results/hop.json"
STAMP = struct.Struct("d")
FRAME = struct.Struct("I")
GAP = 0.04  # seconds between messages: each one finds the receiver asleep


def _engine(conn, n: int) -> None:
    """Stands in for the engine process: a stamped message every GAP seconds."""
    for _ in range(n):
        time.sleep(GAP)
        conn.send_bytes(STAMP.pack(time.monotonic()))
    conn.send_bytes(b"")


def _spin(on) -> None:
    """Stands in for a decode thread: busy while `on` is set."""
    while True:
        while on.value:
            pass
        time.sleep(0.01)


async def _relay(send, n: int) -> None:
    """Read a fresh engine's pipe on this loop (as EngineProcess does) and pass each message
    to `send` (an async callable); b"" ends it."""
    ctx = mp.get_context("spawn")  # as the agent starts its engines: gRPC runs threads
    r, w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_engine, args=(w, n))
    proc.start()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    loop.add_reader(r.fileno(), lambda: queue.put_nowait(r.recv_bytes()))
    try:
        while True:
            msg = await queue.get()
            await send(msg)
            if not msg:
                return
    finally:
        loop.remove_reader(r.fileno())
        proc.join()


# ---- the "agent" side --------------------------------------------------------------------


async def _serve_grpc(port: int, ready, n: int) -> None:
    import grpc

    async def request(req, ctx):
        elapsed = time.monotonic() - STAMP.unpack(req)[0]
        await ctx.send_initial_metadata(())
        yield STAMP.pack(elapsed)

    async def response(req, ctx):
        await ctx.send_initial_metadata(())
        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(_relay(out.put, n))
        while msg := await out.get():
            yield msg
        await task

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "hop.Hop",
                {
                    "Request": grpc.unary_stream_rpc_method_handler(request),
                    "Response": grpc.unary_stream_rpc_method_handler(response),
                },
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


async def _serve_socket(path: str, ready, n: int) -> None:
    async def on_connection(reader, writer):
        kind = await reader.readexactly(1)
        if kind == b"q":  # request direction: stamps in, elapsed times out
            with contextlib.suppress(asyncio.IncompleteReadError):
                while True:
                    stamp = STAMP.unpack(await reader.readexactly(STAMP.size))[0]
                    writer.write(STAMP.pack(time.monotonic() - stamp))
        else:

            async def send(msg: bytes) -> None:
                writer.write(FRAME.pack(len(msg)) + msg)

            await _relay(send, n)
        writer.close()

    server = await asyncio.start_unix_server(on_connection, path)
    ready.set()
    await server.serve_forever()


def _agent(kind: str, address, ready, n: int) -> None:
    serve = _serve_grpc if kind == "grpc" else _serve_socket
    asyncio.run(serve(address, ready, n))


# ---- the "web process" side -------------------------------------------------------------


async def _requests(kind: str, address, n: int) -> list[float]:
    """Milliseconds from each call's start to its handler, n calls GAP seconds apart."""
    out = []
    if kind == "grpc":
        import grpc

        async with grpc.aio.insecure_channel(f"127.0.0.1:{address}") as channel:
            request = channel.unary_stream("/hop.Hop/Request")
            for i in range(n + 1):  # the first connects
                await asyncio.sleep(GAP)
                async for msg in request(STAMP.pack(time.monotonic())):
                    if i:
                        out.append(1000 * STAMP.unpack(msg)[0])
        return out
    reader, writer = await asyncio.open_unix_connection(address)
    writer.write(b"q")
    for _ in range(n):
        await asyncio.sleep(GAP)
        writer.write(STAMP.pack(time.monotonic()))
        out.append(1000 * STAMP.unpack(await reader.readexactly(STAMP.size))[0])
    writer.close()
    return out


async def _responses(kind: str, address) -> list[float]:
    """Milliseconds from the engine's pipe write to this loop, for each relayed message."""
    out = []
    if kind == "grpc":
        import grpc

        async with grpc.aio.insecure_channel(f"127.0.0.1:{address}") as channel:
            async for msg in channel.unary_stream("/hop.Hop/Response")(b""):
                out.append(1000 * (time.monotonic() - STAMP.unpack(msg)[0]))
        return out
    reader, writer = await asyncio.open_unix_connection(address)
    writer.write(b"r")
    while size := FRAME.unpack(await reader.readexactly(FRAME.size))[0]:
        msg = await reader.readexactly(size)
        out.append(1000 * (time.monotonic() - STAMP.unpack(msg)[0]))
    writer.close()
    return out


def _summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10)
    return {"n": len(ms), "median_ms": statistics.median(ms), "p90_ms": q[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--messages", type=int, default=60)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    busy = ctx.Value("b", 0, lock=False)
    spinners = [ctx.Process(target=_spin, args=(busy,), daemon=True) for _ in range(2)]
    for s in spinners:
        s.start()
    results = {k: {"request": [], "response": []} for k in ("grpc", "socket")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in ("grpc", "socket") if r % 2 == 0 else ("socket", "grpc"):
                address = 50600 + r if kind == "grpc" else os.path.join(tmp, f"{r}.sock")
                ready = ctx.Event()
                agent = ctx.Process(target=_agent, args=(kind, address, ready, args.messages))
                agent.start()
                ready.wait()
                up = asyncio.run(_requests(kind, address, args.messages))
                busy.value = 1
                try:
                    down = asyncio.run(_responses(kind, address))
                finally:
                    busy.value = 0
                agent.terminate()
                agent.join()
                results[kind]["request"] += up
                results[kind]["response"] += down
                print(
                    f"round {r} {kind}: request {statistics.median(up):.3f} ms, "
                    f"response {statistics.median(down):.3f} ms",
                    flush=True,
                )
    for s in spinners:
        s.terminate()
    out = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "messages": args.messages,
        "transports": {k: {d: _summary(v) for d, v in dirs.items()} for k, dirs in results.items()},
    }
    g, s = out["transports"]["grpc"], out["transports"]["socket"]
    out["grpc_minus_socket_ms"] = {
        d: g[d]["median_ms"] - s[d]["median_ms"] for d in ("request", "response")
    }
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
