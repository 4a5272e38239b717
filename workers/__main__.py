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
    _agent_options(sub.add_parser("agent", help="run the node agent"))
    _pki_options(sub.add_parser("pki", help="make a cluster CA and certificates for mutual TLS"))
    args = parser.parse_args(argv)
    if args.command == "pki":
        return _pki(args)
    return _agent(args, parser)


def _agent_options(a: argparse.ArgumentParser) -> None:
    from workers.engine.process import FLASH_ATTN_MODES, PROMPT_CACHE_MIB, STREAM_INTERVAL_MS

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
        help="decode threads of this node, 0 for all cores, divided among the engines "
        "generating at the moment (LLAMAFLEET_AGENT_THREADS)",
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
        help="address of GET /metrics, LLAMAFLEET_METRICS_TOKEN as Bearer; empty for none "
        "(LLAMAFLEET_AGENT_METRICS; default 127.0.0.1:9464)",
    )
    a.add_argument(
        "--health-listen",
        default=_env("LLAMAFLEET_AGENT_HEALTH"),
        help="address of a plaintext server with only the gRPC health service, for probes "
        "that cannot speak mutual TLS, such as Kubernetes' grpc probe (LLAMAFLEET_AGENT_HEALTH; "
        "default: none)",
    )
    a.add_argument(
        "--drain-seconds",
        type=float,
        default=float(_env("LLAMAFLEET_AGENT_DRAIN_SECONDS", "30")),
        help="on SIGTERM, how long generations in flight may run on before the engines stop; "
        "a second signal stops at once, and what is cut moves to another replica "
        "(LLAMAFLEET_AGENT_DRAIN_SECONDS; default 30)",
    )
    a.add_argument(
        "--stream-interval-ms",
        type=float,
        default=float(_env("LLAMAFLEET_STREAM_INTERVAL_MS", str(STREAM_INTERVAL_MS))),
        help="merge a stream's pieces produced within this many ms into one message; the "
        f"first is never held (LLAMAFLEET_STREAM_INTERVAL_MS; default {STREAM_INTERVAL_MS:g}, "
        "0 for one per token)",
    )
    a.add_argument(
        "--prompt-cache-mib",
        type=int,
        default=int(_env("LLAMAFLEET_AGENT_PROMPT_CACHE_MIB", str(PROMPT_CACHE_MIB))),
        help="host RAM per replica for prompt prefixes pushed out of its slots, restored when "
        "a later prompt shares them, as llama-server's --cache-ram "
        f"(LLAMAFLEET_AGENT_PROMPT_CACHE_MIB; default {PROMPT_CACHE_MIB}, 0 for none)",
    )
    a.add_argument(
        "--flash-attn",
        choices=FLASH_ATTN_MODES,
        default=_env("LLAMAFLEET_AGENT_FLASH_ATTN", "auto"),
        help="flash attention for whole replicas, as llama-server's -fa (LLAMAFLEET_AGENT_FLASH_"
        "ATTN; default auto: on where the backend has it). On CPUs off can pay for chats with "
        "long histories and costs for short prompts: see the README",
    )
    a.add_argument(
        "--rpc-host",
        default=_env("LLAMAFLEET_RPC_HOST"),
        help="address rpc servers listen on (LLAMAFLEET_RPC_HOST; default: the host of "
        "--advertise). The ggml RPC protocol has no authentication: keep it private",
    )
    a.add_argument(
        "--allow-public-rpc",
        action="store_true",
        default=_env("LLAMAFLEET_ALLOW_PUBLIC_RPC") in ("1", "true", "yes"),
        help="let rpc servers bind a wildcard or public address (LLAMAFLEET_ALLOW_PUBLIC_RPC); "
        "refused otherwise",
    )
    for name, what in (("ca", "CA certificate"), ("cert", "certificate"), ("key", "private key")):
        env = f"LLAMAFLEET_TLS_{name.upper()}"
        a.add_argument(
            f"--tls-{name}",
            default=_env(env),
            help=f"PEM {what} for mutual TLS under the cluster CA ({env}); without TLS files "
            "the agent listens on loopback only",
        )


def _pki_options(k: argparse.ArgumentParser) -> None:
    k.add_argument("--dir", default="var/pki", help="where the CA and certificates are kept")
    k.add_argument("--name", default="", help="issue a certificate of this name (else: CA only)")
    k.add_argument(
        "--host",
        action="append",
        default=[],
        help="a DNS name or IP address the certificate is for (repeat); an agent's advertise "
        "host, or anything for the control plane (it only dials)",
    )


def _pki(args) -> int:
    """A cluster CA (kept if it exists), and a certificate when a name is given."""
    from pathlib import Path

    from workers import tls

    directory = Path(args.dir)
    tls.make_ca(directory)
    print(f"CA: {directory / 'ca.pem'} (keep {directory / 'ca-key.pem'} private)")
    if args.name:
        files = tls.issue(directory, args.name, args.host or [args.name])
        print(f"LLAMAFLEET_TLS_CA={files.ca}")
        print(f"LLAMAFLEET_TLS_CERT={files.cert}")
        print(f"LLAMAFLEET_TLS_KEY={files.key}")
    return 0


def _agent(args, parser: argparse.ArgumentParser) -> int:
    """Run the agent until it is told to stop; 2 for a configuration it refuses."""
    token = _env("LLAMAFLEET_NODE_TOKEN")
    if not token:
        parser.error("LLAMAFLEET_NODE_TOKEN must be set: the secret shared with the control plane")
    logging.basicConfig(
        level=_env("LLAMAFLEET_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from workers.agent.server import AgentSettings, serve
    from workers.tls import TLSFiles

    tls_paths = [args.tls_ca, args.tls_cert, args.tls_key]
    if any(tls_paths) and not all(tls_paths):
        parser.error("give all of --tls-ca, --tls-cert and --tls-key, or none")

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
        health_listen=args.health_listen,
        metrics_token=_env("LLAMAFLEET_METRICS_TOKEN"),
        stream_interval_ms=args.stream_interval_ms,
        prompt_cache_mib=args.prompt_cache_mib,
        flash_attn=args.flash_attn,
        drain_seconds=args.drain_seconds,
        rpc_host=args.rpc_host,
        allow_public_rpc=args.allow_public_rpc,
        tls=TLSFiles(*tls_paths) if all(tls_paths) else None,
    )
    try:
        asyncio.run(serve(settings))
    except RuntimeError as exc:  # a refused configuration: say why, no traceback
        log = logging.getLogger("workers")
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
