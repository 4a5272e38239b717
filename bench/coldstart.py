"""Time to first token from zero replicas, against the least a cold start can cost.

    .venv/bin/python bench/coldstart.py [--rounds 5]

The bench stack (bench/serving.py's: SmolLM2, var/bench) with its deployment under an
autoscaling policy of min 0: after a short idle delay it scales to zero, then one chat
request (OpenAI SDK, streamed) wakes it. Measured per round, alternating in one run:
- from zero: the request's time to first token while the first replica is placed, loaded
  and routed to (the SDK sees an ordinary stream);
- warm: the same request with the replica up;
- the floor: what a cold start costs at the least on the same file, in a fresh process:
  llama-cpp-python loading it (same context and slots) and producing a first token. A user
  who starts llama-server on demand (KubeAI's pattern) pays at least that.
Writes bench/results/coldstart.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402  (the bench stack and its helpers)

OUT = serving.ROOT / "bench/results/coldstart.json"
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Say hello in five words."}]
CONTEXT = serving.CONTEXT * serving.SLOTS  # what the bench stack's replica allocates
FLOOR = """
import sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=2, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": "Say hello in five words."}],
                                 max_tokens=1, temperature=0)
print(time.perf_counter() - t0)
"""


def ttft(key: str) -> float:
    from openai import OpenAI

    client = OpenAI(base_url=f"{serving.URL}/v1", api_key=key, max_retries=0, timeout=300)
    began = time.perf_counter()
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - began
    return first


def state(key: str) -> str:
    return serving.api("GET", f"/api/v1/deployments/{MODEL}/", key)["state"]


def wait_state(key: str, want: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if state(key) == want:
            return
        time.sleep(0.5)
    raise SystemExit(f"{MODEL} did not become {want} within {timeout:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    model_path = serving.start_stack(MODEL)
    key = serving.bench_key()
    policy = {"mode": "on", "min_replicas": 0, "max_replicas": 1, "window_seconds": 5,
              "scale_down_delay_seconds": 5, "cooldown_seconds": 0}  # fmt: skip
    r = httpx.put(
        f"{serving.URL}/api/v1/deployments/{MODEL}/autoscaling/",
        json=policy, headers={"Authorization": f"Bearer {key}"}, timeout=30,
    )  # fmt: skip
    r.raise_for_status()
    rows = []
    try:
        for i in range(args.rounds):
            wait_state(key, "idle")
            cold = ttft(key)
            warm = ttft(key)
            floor = float(
                subprocess.run(
                    [serving.PY, "-c", FLOOR, str(model_path), str(CONTEXT)],
                    capture_output=True, text=True, check=True,
                ).stdout.strip()
            )  # fmt: skip
            rows.append({"from_zero_s": round(cold, 3), "warm_s": round(warm, 3),
                         "floor_s": round(floor, 3)})  # fmt: skip
            print(f"round {i + 1}: {rows[-1]}")
    finally:
        serving.stack("down")
    med = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    result = {
        "model": MODEL,
        "rounds": rows,
        "median": med,
        "from_zero_over_floor": round(med["from_zero_s"] / med["floor_s"], 2),
        "note": "from_zero includes placing, loading (engine process start, weights) and "
        "routing; the floor is llama-cpp-python loading the file and answering one token "
        "in a fresh process",
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
