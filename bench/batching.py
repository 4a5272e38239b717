"""What the batch-invariant mode costs against the default throughput mode, in the engine
alone: `python bench/batching.py` (needs the test model cache: run the tests once).

For each bundled model, one engine per mode (8 slots, 2 threads) decodes 8 greedy stories of
TOKENS tokens submitted together; rounds alternate between the modes. The figure is
generated tokens per second over the whole run (prompts included, as a client sees it).
Writes bench/results/batching.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from serving import TOPICS  # noqa: E402  (the serving bench's stories)

from tests.conftest import cached_model  # noqa: E402
from workers.engine.core import BatchEngine, Request, Sampling  # noqa: E402
from workers.engine.events import Done  # noqa: E402

MODELS = ("smollm2-135m-instruct", "gemma-3-270m")
ROUNDS, TOKENS, SLOTS = 3, 128, 8


def one_round(engine: BatchEngine, r: int) -> float:
    for i, topic in enumerate(TOPICS[:SLOTS]):
        text = f"Write a long story about {topic}. ({r})"
        tokens = engine.tokenize(text, add_bos=True, special=False)
        engine.submit(Request(f"{r}.{i}", tokens, TOKENS, Sampling(temperature=0)))
    generated, t0 = 0, time.perf_counter()
    while not engine.idle():
        for event in engine.step():
            if isinstance(event, Done):  # counted from usage, as the serving bench does
                generated += event.usage["completion_tokens"]
    return generated / (time.perf_counter() - t0)


def main() -> None:
    out = {"slots": SLOTS, "threads": 2, "max_tokens": TOKENS, "rounds": ROUNDS}
    for name in MODELS:
        path = str(cached_model(name))
        engines = {
            mode: BatchEngine(path, 1024, SLOTS, threads=2, batch_invariant=mode == "invariant")
            for mode in ("throughput", "invariant")
        }
        rows = {mode: [] for mode in engines}
        try:
            for r in range(ROUNDS):
                for mode in engines if r % 2 == 0 else list(engines)[::-1]:
                    rows[mode].append(one_round(engines[mode], r))
        finally:
            for e in engines.values():
                e.close()
        res = {f"{m}_tokens_per_s": statistics.median(v) for m, v in rows.items()}
        res["invariant_over_throughput"] = (
            res["invariant_tokens_per_s"] / res["throughput_tokens_per_s"]
        )
        out[name] = res
        print(json.dumps({name: res}, indent=2), flush=True)
    out["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    dest = ROOT / "bench/results/batching.json"
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
