"""Soak: many clients against the whole stack for a long time, within bounds.

    python bench/soak.py [--clients 64] [--seconds 600] [--max-in-flight 32]

A fresh bench stack (bench/serving.py's: SmolLM2, 8 slots) whose web process admits
`--max-in-flight` generations; the clients ask without pause, so beyond that they get 429.
Each honours Retry-After. Checked and written to bench/results/soak.json:
- no 5xx;
- every 429 carries Retry-After;
- every process's memory (web, worker, beat, agent, its engines) after the first tenth
  (warm-up) stays within 10% of where warm-up left it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402  (bench/serving.py: the bench stack and its helpers)

OUT = serving.ROOT / "bench/results/soak.json"


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))
    except (OSError, StopIteration):
        return 0


def processes() -> dict[str, int]:
    """The stack's processes by name, and the agent's children (engines and helpers)."""
    out = {}
    for name in ("web", "worker", "beat", "agent"):
        pid_file = serving.VAR / "run" / f"{name}.pid"
        if pid_file.exists():
            out[name] = int(pid_file.read_text())
    if "agent" in out:
        children = subprocess.run(
            ["pgrep", "-P", str(out["agent"])], capture_output=True, text=True
        ).stdout.split()
        for i, pid in enumerate(children):
            out[f"agent-child{i}"] = int(pid)
    return out


async def client(http: httpx.AsyncClient, key: str, deadline: float, counts, retry_after):
    rng = random.Random()
    while time.monotonic() < deadline:
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [
                {"role": "user", "content": f"Tell me about {rng.choice(serving.TOPICS)}."}
            ],
            "max_tokens": 24,
        }
        try:
            resp = await http.post(
                "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
        except httpx.HTTPError as exc:
            counts[f"transport: {type(exc).__name__}"] += 1
            await asyncio.sleep(1)
            continue
        counts[str(resp.status_code)] += 1
        if resp.status_code == 429:
            value = resp.headers.get("Retry-After")
            retry_after.append(value)
            await asyncio.sleep(float(value or 1))


async def soak(clients: int, seconds: float, key: str) -> dict:
    counts: collections.Counter = collections.Counter()
    retry_after: list = []
    samples: list[dict] = []
    started = time.monotonic()
    deadline = started + seconds

    async def sample():
        while time.monotonic() < deadline:
            samples.append(
                {
                    "t": round(time.monotonic() - started, 1),
                    "rss": {n: rss(p) for n, p in processes().items()},
                }
            )
            await asyncio.sleep(5)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=serving.URL, timeout=120, limits=limits) as http:
        await asyncio.gather(
            sample(), *(client(http, key, deadline, counts, retry_after) for _ in range(clients))
        )
    warm = [s for s in samples if s["t"] >= seconds / 10]
    memory = {}
    for name in warm[0]["rss"] if warm else []:
        series = [s["rss"].get(name, 0) for s in warm if s["rss"].get(name)]
        if not series:
            continue
        base = series[0]
        memory[name] = {
            "after_warmup_mib": round(base / 2**20, 1),
            "max_mib": round(max(series) / 2**20, 1),
            "last_mib": round(series[-1] / 2**20, 1),
            "growth_max_pct": round(100 * (max(series) - base) / base, 1),
        }
    five = sum(v for k, v in counts.items() if k.startswith("5"))
    return {
        "clients": clients,
        "seconds": seconds,
        "responses": dict(counts),
        "ok_per_second": round(counts["200"] / seconds, 2),
        "checks": {
            "no_5xx": five == 0,
            "every_429_has_retry_after": all(retry_after),
            "memory_within_10pct_after_warmup": all(
                m["growth_max_pct"] <= 10 for m in memory.values()
            ),
        },
        "memory": memory,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--max-in-flight", type=int, default=32)
    args = p.parse_args()
    serving.ENV["LLAMAFLEET_MAX_IN_FLIGHT"] = str(args.max_in_flight)
    serving.start_stack("smollm2-135m-instruct")
    try:
        result = asyncio.run(soak(args.clients, args.seconds, serving.bench_key()))
    finally:
        serving.stack("down")
    result["max_in_flight"] = args.max_in_flight
    result["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if not all(result["checks"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
