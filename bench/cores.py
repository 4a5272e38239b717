"""Two replicas on one agent: what sharing the node's cores among busy engines is worth,
`python bench/cores.py` (needs the test model cache: run the tests once).

A real agent with 2 threads (this machine's cores) serves two SmolLM2 replicas (4 slots
each) over gRPC. Three ways to give them threads, each loaded in turn, rounds alternating:

- shared (the default: the deployment sets no count): the agent divides its threads among
  the engines generating now (workers.agent.service._share_cores);
- all_cores (what the agent did before: each engine all the node's threads, pinned);
- one_each (the node's threads divided once among the loaded engines, pinned);
- llama_server_all_cores and llama_server_one_each: what a user would run instead, two
  llama-server processes (scripts/build_llama_server.sh; 4 slots each, -t 2 or -t 1) on
  the same file, asked the same things over its OpenAI API (one chunk per token, so their
  client does a little more work than the gRPC one).

Two workloads: both replicas busy (4 greedy streams of TOKENS tokens on each, together), and
one busy beside an idle one (4 streams on the first). The figure is generated tokens/s
over the workload (prompts included, tokens counted from usage). Writes
bench/results/cores.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("LLAMAFLEET_NODE_TOKEN", "bench-node-token")

import grpc  # noqa: E402
import httpx  # noqa: E402
from llamafleet.agent.v1 import agent_pb2 as pb  # noqa: E402
from llamafleet.agent.v1 import agent_pb2_grpc  # noqa: E402
from serving import TOPICS, LlamaServer, Target, chat, http_client  # noqa: E402

from tests.conftest import RunningAgent, cached_model  # noqa: E402

ROUNDS, TOKENS, STREAMS = 3, 128, 4
MODEL = "smollm2-135m-instruct"
MODES = {"shared": 0, "all_cores": 2, "one_each": 1}  # LoadModelRequest.threads
SERVERS = {"llama_server_all_cores": 2, "llama_server_one_each": 1}  # -t of each process
SERVER_PORTS = (8301, 8302)
AUTH = (("authorization", f"Bearer {os.environ['LLAMAFLEET_NODE_TOKEN']}"),)


async def stream(stub, replica: str, prompt: str) -> int:
    request = pb.InferenceRequest(
        replica_id=replica,
        max_tokens=TOKENS,
        messages=[pb.ChatMessage(role="user", content=prompt)],
        sampling=pb.SamplingParams(temperature=0),
    )
    tokens = 0
    async for msg in stub.RunInference(request, metadata=AUTH):
        if msg.finish_reason:
            tokens = msg.usage.completion_tokens
    return tokens


async def server_stream(client: httpx.AsyncClient, target: Target, prompt: str) -> int:
    res = await chat(client, target, [{"role": "user", "content": prompt}], TOKENS)
    return res["tokens"]


async def workload(send, targets: list, r: int) -> float:
    """STREAMS stories at once on each target (send(target, prompt) -> tokens counted from
    usage); generated tokens/s over the whole workload."""
    t0 = time.perf_counter()
    counts = await asyncio.gather(
        *(
            send(t, f"Write a long story about {TOPICS[(i + k) % len(TOPICS)]} ({r}).")
            for k, t in enumerate(targets)
            for i in range(STREAMS)
        )
    )
    return sum(counts) / (time.perf_counter() - t0)


async def servers(path: Path, threads: int, r: int) -> tuple[float, float]:
    """Two llama-server processes of `threads` each: both busy, then one busy."""
    procs = [
        LlamaServer(path, ["--jinja"], port=p, slots=STREAMS, context=1024, threads=threads)
        for p in SERVER_PORTS
    ]
    try:
        targets = [Target(f"llama_server_{i}", ls.url, MODEL) for i, ls in enumerate(procs)]
        async with http_client() as client:

            def send(t, prompt):
                return server_stream(client, t, prompt)

            await workload(send, targets[:1], -1)  # warm
            both = await workload(send, targets, r)
            one = await workload(send, targets[:1], r)
        return both, one
    finally:
        for ls in procs:
            ls.stop()


async def run(address: str, sha: str, path: Path) -> dict:
    rows = {m: {"both_busy": [], "one_busy": []} for m in [*MODES, *SERVERS]}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.NodeAgentStub(channel)

        def send(replica, prompt):
            return stream(stub, replica, prompt)

        for r in range(ROUNDS):
            order = [*MODES, *SERVERS]
            for mode in order if r % 2 == 0 else order[::-1]:
                if mode in SERVERS:
                    both, one = await servers(path, SERVERS[mode], r)
                    rows[mode]["both_busy"].append(both)
                    rows[mode]["one_busy"].append(one)
                    continue
                ids = [f"{mode}-a", f"{mode}-b"]
                for rid in ids:
                    reply = await stub.LoadModel(
                        pb.LoadModelRequest(
                            replica_id=rid,
                            model_name=MODEL,
                            sha256=sha,
                            context_length=1024,
                            parallel=STREAMS,
                            threads=MODES[mode],
                        ),
                        metadata=AUTH,
                        timeout=300,
                    )
                    assert reply.state == pb.REPLICA_STATE_READY, reply.error
                await workload(send, ids[:1], -1)  # warm
                rows[mode]["both_busy"].append(await workload(send, ids, r))
                rows[mode]["one_busy"].append(await workload(send, ids[:1], r))
                for rid in ids:
                    await stub.FreeMemory(pb.FreeMemoryRequest(replica_id=rid), metadata=AUTH)
    out = {}
    for mode, v in rows.items():
        out[mode] = {f"{k}_tokens_per_s": round(statistics.median(x), 1) for k, x in v.items()}
    for k in ("both_busy", "one_busy"):
        base = out["shared"][f"{k}_tokens_per_s"]
        out[f"{k}_shared_over"] = {
            m: round(base / out[m][f"{k}_tokens_per_s"], 3) for m in rows if m != "shared"
        }
    return out


def main() -> None:
    path = cached_model(MODEL)
    store = Path(tempfile.mkdtemp(prefix="cores-bench-", dir=path.parent))
    try:
        os.link(path, store / path.name)
        agent = RunningAgent(store, name="bench-cores")
        try:
            sha = path.name.removeprefix("sha256-").removesuffix(".gguf")
            result = asyncio.run(run(agent.address, sha, path))
        finally:
            agent.close()
    finally:
        shutil.rmtree(store)
    result.update(
        {
            "agent_threads": 2,
            "machine_cores": os.cpu_count(),
            "streams_per_replica": STREAMS,
            "max_tokens": TOKENS,
            "rounds": ROUNDS,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    print(json.dumps(result, indent=2))
    dest = ROOT / "bench/results/cores.json"
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
