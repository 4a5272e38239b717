"""How long the planner takes on large made-up clusters: `python bench/planner.py`.

Writes bench/results/planner.json. Clusters of 10 to 1,000 nodes with mixed free memory and
measured links, a 70B-class model (split) and a small one (replicas), best of 5 runs each.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from apps.deployments import planner as P  # noqa: E402

GiB = P.GiB
BIG = P.ModelFacts(
    name="llama-70b-q4",
    n_layers=80,
    bytes_per_layer=tuple([int(0.48 * GiB)] * 80),
    bytes_embeddings=int(0.5 * GiB),
    bytes_output=int(0.5 * GiB),
    file_bytes=int(39.4 * GiB),
    n_heads=64,
    n_kv_heads=8,
    head_dim=128,
    n_embd=8192,
    n_vocab=128256,
    n_ff=28672,
)
SMALL = P.ModelFacts(
    name="8b-q4",
    n_layers=32,
    bytes_per_layer=tuple([int(0.13 * GiB)] * 32),
    bytes_embeddings=int(0.5 * GiB),
    bytes_output=int(0.5 * GiB),
    file_bytes=int(5.2 * GiB),
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    n_embd=4096,
    n_vocab=128256,
    n_ff=14336,
)


def cluster(n: int, rng: random.Random):
    nodes = [
        P.NodeState(f"node-{i:04d}", int(rng.choice([8, 12, 16, 24]) * GiB * rng.uniform(0.5, 1)))
        for i in range(n)
    ]
    links = {}
    for i in range(n):  # each node measured against 8 others, as a link sweep would
        for j in rng.sample(range(n), min(8, n - 1)):
            if i != j:
                links[(nodes[i].name, nodes[j].name)] = P.Link(
                    rng.uniform(0.05, 3), rng.choice([1000, 10000, 25000])
                )
    return nodes, links


def best_of(fn, runs=5) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    rng = random.Random(7)
    rows = []
    for n in (10, 100, 1000):
        nodes, links = cluster(n, rng)
        for model, req in (
            (BIG, P.Request(8192, 4)),
            (SMALL, P.Request(8192, 4, replicas=8)),
            (BIG, P.Request(131072, 64)),  # too big for any 16 nodes: the slowest path
        ):
            result = P.plan(model, req, nodes, links)
            seconds = best_of(lambda m=model, r=req, c=nodes, lk=links: P.plan(m, r, c, lk))
            rows.append(
                {
                    "nodes": n,
                    "links": len(links),
                    "model": model.name,
                    "kind": result.kind,
                    "plan_nodes": len(result.stages),
                    "milliseconds": round(seconds * 1000, 2),
                }
            )
            print(json.dumps(rows[-1]))
    out = ROOT / "bench" / "results" / "planner.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
