"""Command line of the node agent: `python -m workers agent --name node-1 ...`.

Every option also reads an environment variable (shown in --help), so the same command
works from a shell, a unit file or docker-compose.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("agent", help="run the node agent")
    a.add_argument(
        "--name",
        default=_env("LLAMAFLEET_NODE_NAME", socket.gethostname()),
        help="node name (LLAMAFLEET_NODE_NAME; default: the host name)",
    )
    a.add_argument(
        "--listen",
        default=_env("LLAMAFLEET_AGENT_LISTEN", "127.0.0.1:50051"),
        help="gRPC bind address (LLAMAFLEET_AGENT_LISTEN; default 127.0.0.1:50051)",
    )
    a.add_argument(
        "--advertise",
        default=_env("LLAMAFLEET_AGENT_ADVERTISE"),
        help="address the control plane dials (LLAMAFLEET_AGENT_ADVERTISE; default: --listen)",
    )
    a.add_argument(
        "--control-plane",
        default=_env("LLAMAFLEET_CONTROL_PLANE", "http://127.0.0.1:8000"),
        help="control plane URL (LLAMAFLEET_CONTROL_PLANE)",
    )
    a.add_argument(
        "--models-dir",
        default=_env("LLAMAFLEET_AGENT_MODELS_DIR", "var/models"),
        help="where model files are kept (LLAMAFLEET_AGENT_MODELS_DIR)",
    )
    a.add_argument(
        "--threads",
        type=int,
        default=int(_env("LLAMAFLEET_AGENT_THREADS", "0")),
        help="decode threads per engine, 0 for all cores (LLAMAFLEET_AGENT_THREADS)",
    )
    a.add_argument(
        "--heartbeat",
        type=float,
        default=float(_env("LLAMAFLEET_HEARTBEAT_SECONDS", "5")),
        help="seconds between heartbeats (LLAMAFLEET_HEARTBEAT_SECONDS)",
    )
    a.add_argument(
        "--metrics-listen",
        default=_env("LLAMAFLEET_AGENT_METRICS", "127.0.0.1:9464"),
        help="address of GET /metrics, node token as Bearer; empty for none "
        "(LLAMAFLEET_AGENT_METRICS; default 127.0.0.1:9464)",
    )
    a.add_argument(
        "--stream-interval-ms",
        type=float,
        default=float(_env("LLAMAFLEET_STREAM_INTERVAL_MS", "20")),
        help="merge a stream's pieces produced within this many ms into one message; the "
        "first is never held (LLAMAFLEET_STREAM_INTERVAL_MS; default 20, 0 for one per token)",
    )
    a.add_argument(
        "--rpc-host",
        default=_env("LLAMAFLEET_RPC_HOST"),
        help="address rpc servers listen on (LLAMAFLEET_RPC_HOST; default: the host of "
        "--advertise). The ggml RPC protocol has no authentication: keep it private",
    )
    args = parser.parse_args(argv)

    token = _env("LLAMAFLEET_NODE_TOKEN")
    if not token:
        parser.error("LLAMAFLEET_NODE_TOKEN must be set: the secret shared with the control plane")
    logging.basicConfig(
        level=_env("LLAMAFLEET_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from workers.agent.server import AgentSettings, serve

    settings = AgentSettings(
        name=args.name,
        listen=args.listen,
        advertise=args.advertise or args.listen,
        control_plane=args.control_plane,
        node_token=token,
        models_dir=args.models_dir,
        threads=args.threads,
        heartbeat_seconds=args.heartbeat,
        metrics_listen=args.metrics_listen,
        stream_interval_ms=args.stream_interval_ms,
        rpc_host=args.rpc_host,
    )
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
