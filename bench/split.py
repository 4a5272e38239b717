"""Split inference across hosts: tokens/s and time to first token against one node.

Needs root: three hosts are network namespaces on a bridge (tests/hosts.py), with a node
agent each. Host0 is the head; hosts 1 and 2 run rpc servers. Configurations:
  one node | layer split over 2 hosts | layer split over 3 hosts | tensor split over 2 stages
on two networks:
  veth     - plain veth links
  shaped   - tc tbf at 1 Gbit/s on every host link, plus a relay holding each chunk
             0.5 ms in each direction between the head and every stage
Every configuration is loaded at once and measured in alternating rounds (median of ROUNDS),
so a noisy machine affects them alike; each is reported as a ratio to one node measured in
the same phase. Writes bench/results/split.json.

    sudo .venv/bin/python bench/split.py [--rounds 7] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

from llamafleet.agent.v1 import agent_pb2 as pb  # noqa: E402
from llamafleet.agent.v1 import agent_pb2_grpc  # noqa: E402

from tests import hosts as H  # noqa: E402
from workers import tls  # noqa: E402

SMOLLM2_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
DELAY_MS = 0.5
N_LAYERS = 30


def configs(port: int) -> dict[str, dict]:
    """name -> rpc stages (host index, port) and how the head splits the model."""
    return {
        "one node": {"stages": [], "split": {}},
        "layer split, 2 hosts": {
            "stages": [(1, port)],
            "split": {"n_gpu_layers": 16, "tensor_split": [16]},  # head 0-14, stage 15-29
        },
        "layer split, 3 hosts": {
            "stages": [(1, port + 1), (2, port + 1)],
            "split": {"n_gpu_layers": 21, "tensor_split": [10, 11]},  # 0-9 | 10-19 | 20-29
        },
        "tensor split, 2 hosts": {
            "stages": [(1, port + 2), (2, port + 2)],
            "split": {"n_gpu_layers": -1, "split_mode": 3, "tensor_split": [0.5, 0.5]},
        },
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument(
        "--threads", type=int, default=1,
        help="threads of every process (head engine, rpc servers): the hosts share 2 cores",
    )  # fmt: skip
    args = p.parse_args()
    why = H.available()
    if why:
        sys.exit(f"bench/split.py: {why}")
    token = os.environ.setdefault("LLAMAFLEET_NODE_TOKEN", "bench-node-token")
    auth = (("authorization", f"Bearer {token}"),)
    store = Path(tempfile.mkdtemp(prefix="llamafleet-split-"))
    model = ROOT / "var" / "test-cache" / f"sha256-{SMOLLM2_SHA}.gguf"
    if not model.exists():
        sys.exit(f"{model} is missing: run the tests once (they fetch it)")
    os.link(model, store / model.name)
    hosts = H.Hosts(3).up()
    results: dict[str, dict] = {}
    try:
        files = H.pki(store / "pki", hosts)
        addresses = [
            H.start_agent(hosts, i, store, store, args.threads, files=files) for i in range(3)
        ]
        for a in addresses:
            H.wait_agent(a, token, files=files)
        stubs = [agent_pb2_grpc.NodeAgentStub(tls.channel(a, files)) for a in addresses]
        for phase, base in (("veth", 50200), ("shaped", 50300)):
            if phase == "shaped":
                hosts.shape("1gbit")
            results[phase] = run_phase(hosts, stubs, auth, configs(base), phase, args)
            for name in list(configs(base)):
                stubs[0].FreeMemory(
                    pb.FreeMemoryRequest(replica_id=_rid(phase, name)), metadata=auth
                )
            for i in (1, 2):
                for port in range(base, base + 3):
                    stubs[i].StopRpcServer(pb.StopRpcServerRequest(port=port), metadata=auth)
        hosts.unshape()
    finally:
        hosts.down()
    out = ROOT / "bench" / "results" / "split.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "model": "SmolLM2-135M-Instruct Q4_1",
        "tokens": args.tokens,
        "rounds": args.rounds,
        "note": "tensor splits generate min(tokens, 32) per round",
        "threads": f"{args.threads} per process (head engine, each rpc server); 2 cores shared",
        "shaped": f"tc tbf 1gbit on every host link + {DELAY_MS} ms relay delay each way",
        "results": results,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))


def _rid(phase: str, name: str) -> str:
    return f"bench-{phase}-{name.replace(' ', '-').replace(',', '')}"


def run_phase(hosts, stubs, auth, cfgs, phase, args) -> dict:
    relays = []
    for name, cfg in cfgs.items():
        endpoints = []
        for i, port in cfg["stages"]:
            s = stubs[i].StartRpcServer(pb.StartRpcServerRequest(port=port), metadata=auth)
            endpoint = s.endpoint
            if phase == "shaped":  # through a delaying relay on this machine
                relay_port = port + 1000
                relays.append(
                    hosts.spawn(
                        None,
                        [
                            sys.executable,
                            str(ROOT / "tests" / "hosts.py"),
                            "relay",
                            f"{hosts.gateway}:{relay_port}",
                            endpoint,
                            str(DELAY_MS),
                        ],  # fmt: skip
                        Path(tempfile.gettempdir()) / "llamafleet-relay.log",
                    )
                )
                time.sleep(0.5)
                endpoint = f"{hosts.gateway}:{relay_port}"
            endpoints.append(endpoint)
        resp = stubs[0].LoadModel(
            pb.LoadModelRequest(
                replica_id=_rid(phase, name),
                model_name="smollm2",
                sha256=SMOLLM2_SHA,
                context_length=1024,
                parallel=1,
                rpc_servers=endpoints,
                **cfg["split"],
            ),
            metadata=auth,
            timeout=300,
        )
        if resp.state != pb.REPLICA_STATE_READY:
            raise SystemExit(f"{phase} / {name}: {resp.error}")
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in cfgs}
    for name in cfgs:  # warm up
        measure(stubs[0], auth, _rid(phase, name), 16)
    for _ in range(args.rounds):
        for name in cfgs:
            # Tensor splits run at a few tokens/s over a delayed link: a rate from 32 tokens.
            n = min(args.tokens, 32) if name.startswith("tensor") else args.tokens
            samples[name].append(measure(stubs[0], auth, _rid(phase, name), n))
    for r in relays:
        r.kill()
    base_tps = statistics.median(s[1] for s in samples["one node"])
    base_ttft = statistics.median(s[0] for s in samples["one node"])
    out = {}
    for name, s in samples.items():
        ttft = statistics.median(x[0] for x in s)
        tps = statistics.median(x[1] for x in s)
        out[name] = {
            "tokens_per_second": round(tps, 1),
            "ttft_ms": round(ttft * 1000, 1),
            "tokens_per_second_ratio": round(tps / base_tps, 3),
            "ttft_ratio": round(ttft / base_ttft, 3),
        }
        print(phase, name, out[name], flush=True)
    return out


def measure(stub, auth, replica_id: str, max_tokens: int) -> tuple[float, float]:
    """(time to first token, decode tokens/s after it) for one greedy generation."""
    request = pb.InferenceRequest(
        replica_id=replica_id,
        max_tokens=max_tokens,
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES],
        sampling=pb.SamplingParams(temperature=0),
    )
    start = time.perf_counter()
    first = last = None
    tokens = 0
    for msg in stub.RunInference(request, metadata=auth, timeout=300):
        now = time.perf_counter()
        if first is None and msg.text:
            first = now
        last = now
        if msg.HasField("usage"):
            tokens = msg.usage.completion_tokens
    first = first or last
    return first - start, (tokens - 1) / max(last - first, 1e-9)


if __name__ == "__main__":
    main()
