"""Two replicas on one node: what the agent's division of cores among its engines is worth.
`python bench/cores.py` (needs the test model cache: run the tests once).

One agent service in this process (its gRPC methods called directly), two replicas of
SmolLM2-135M Q4_1 with 4 slots each, 4 streams on each at once, 64 greedy tokens a stream.
`every core`: the agent is started with --threads equal to the machine's cores, so each
engine takes all of them (how every agent behaved before); `shared`: --threads 0, the agent
divides the cores among its engines. Rounds alternate. The figure is aggregate generated
tokens per second over the round. Writes bench/results/cores.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llamafleet.agent.v1 import agent_pb2 as pb  # noqa: E402

from workers.agent import system  # noqa: E402
from workers.agent.service import NodeAgentService  # noqa: E402
from workers.agent.store import ModelStore  # noqa: E402

SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE = ROOT / "var" / "test-cache"
ROUNDS, STREAMS, TOKENS = 3, 4, 64
TOPICS = ["a lighthouse", "a dragon", "the sea", "a violin", "a garden", "a train", "ice", "a map"]


async def stream(agent: NodeAgentService, replica: str, topic: str) -> int:
    request = pb.InferenceRequest(
        replica_id=replica,
        max_tokens=TOKENS,
        messages=[pb.ChatMessage(role="user", content=f"Write a long story about {topic}.")],
        sampling=pb.SamplingParams(temperature=0),
    )
    done = 0
    async for msg in agent.RunInference(request, None):
        done = msg.usage.completion_tokens or done
    return done


async def one_round(threads: int) -> dict:
    agent = NodeAgentService("bench", ModelStore(CACHE, "bench"), threads=threads)
    try:
        for rid in ("a", "b"):
            load = pb.LoadModelRequest(
                replica_id=rid, model_name="smollm2", sha256=SHA, context_length=512, parallel=4
            )
            reply = await agent.LoadModel(load, None)
            assert reply.state == pb.REPLICA_STATE_READY, reply.error
        held = {rid: r.engine.threads for rid, r in agent.replicas.items()}
        started = time.perf_counter()
        counts = await asyncio.gather(
            *(
                stream(agent, rid, TOPICS[i % len(TOPICS)])
                for rid in ("a", "b")
                for i in range(STREAMS)
            )
        )
        seconds = time.perf_counter() - started
        return {"threads_per_engine": held, "tokens": sum(counts), "seconds": seconds}
    finally:
        await agent.shutdown()


def main() -> None:
    if not (CACHE / f"sha256-{SHA}.gguf").exists():
        sys.exit(f"{CACHE} has no SmolLM2: run the tests once (they fetch it)")
    os.environ.setdefault("LLAMAFLEET_NODE_TOKEN", "bench")
    cores = system.cpu_cores()
    modes = {"every core": cores, "shared": 0}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(ROUNDS):
        for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            run = asyncio.run(one_round(modes[mode]))
            runs[mode].append(run)
            print(f"round {r + 1} {mode}: {run['tokens'] / run['seconds']:.1f} tokens/s {run}")
    rate = {m: statistics.median(x["tokens"] / x["seconds"] for x in runs[m]) for m in modes}
    result = {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine_cores": cores,
        "replicas": 2,
        "streams_per_replica": STREAMS,
        "tokens_per_stream": TOKENS,
        "rounds": ROUNDS,
        "tokens_per_s": {m: round(v, 1) for m, v in rate.items()},
        "threads_per_engine": {m: runs[m][0]["threads_per_engine"] for m in modes},
        "shared_over_every_core": round(rate["shared"] / rate["every core"], 2),
        "runs": runs,
    }
    out = ROOT / "bench" / "results" / "cores.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
