"""One engine alone through the routing part's chats: the floor under the stack's figures.

`python bench/engine_turns.py [--threads 1] [--conversations 8]` steps a BatchEngine in this
process (no agent, web process or HTTP) through conversations like those of
`bench/serving.py`'s routing part with one shared system prompt: 5 turns of 32 greedy
tokens, history resent, each user pausing 0.2-1.5 s (the same seeds). It prints the median
time to first token of turns 2-5 and the step times, and also times single llama_decode
calls of a few batch shapes, the cost of a step by its tokens. Nothing is written: the
figures are for reading beside the routing part's, on the same machine in the same hour.
Needs the SmolLM2 file of a bench run (var/bench/models) or of the tests (var/test-cache).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import serving  # noqa: E402

from workers.engine import core  # noqa: E402
from workers.engine.events import Done, Token  # noqa: E402
from workers.engine.process import _build_prompt  # noqa: E402


def decode_costs(engine: core.BatchEngine) -> dict:
    """Median ms of one llama_decode per batch shape ((slot, tokens) pairs), on empty caches
    and after 500 cached tokens in each slot used."""
    shapes = {
        "8 streams x 1 token": [(i, 1) for i in range(8)],
        "1 prompt chunk of 64": [(0, 64)],
        "7 streams + a 57-token chunk": [(i, 1) for i in range(7)] + [(7, 57)],
    }
    out = {}
    for base in (0, 500):
        for name, shape in shapes.items():
            times = []
            for _ in range(5):
                core.L.llama_memory_clear(engine.memory, True)
                if base:
                    for slot, _ in shape:
                        for p in range(base):
                            engine._add(p, 100 + p % 50, p, slot, False)
                        engine.batch.n_tokens = base
                        core.L.llama_decode(engine.ctx, engine.batch)
                n = 0
                for slot, k in shape:
                    for j in range(k):
                        engine._add(n, 200 + j, base + j, slot, j == k - 1)
                        n += 1
                engine.batch.n_tokens = n
                t = time.perf_counter()
                core.L.llama_decode(engine.ctx, engine.batch)
                times.append(time.perf_counter() - t)
            out[f"{name}, {base} cached"] = round(1000 * statistics.median(times), 1)
    core.L.llama_memory_clear(engine.memory, True)
    return out


def chats(engine: core.BatchEngine, formatter, n: int) -> dict:
    convs = [
        {
            "messages": [{"role": "system", "content": serving.system_prompt("shared")}],
            "turn": 0,
            "ready": 0.0,
            "pause": random.Random(f"0.{c}"),
            "sent": None,
        }
        for c in range(n)
    ]
    active: dict[str, dict] = {}
    later, steps = [], []
    t0 = time.monotonic()
    while active or any(c["turn"] < 5 for c in convs):
        now = time.monotonic() - t0
        for i, c in enumerate(convs):
            if c["turn"] < 5 and c["sent"] is None and now >= c["ready"]:
                k = c["turn"]
                text = f"(e 0.{i}) " + serving.QUESTIONS[0] if k == 0 else serving.QUESTIONS[k]
                c["messages"].append({"role": "user", "content": text})
                tokens = _build_prompt(engine, formatter, {"messages": c["messages"]})
                rid = f"{i}.{k}"
                engine.submit(
                    core.Request(rid, tokens, max_tokens=32, sampling=core.Sampling(temperature=0))
                )
                c.update(sent=time.monotonic(), first=None, text="")
                active[rid] = c
        if not active:
            time.sleep(0.005)
            continue
        t = time.monotonic()
        events = engine.step()
        steps.append(time.monotonic() - t)
        for ev in events:
            c = active[ev.id]
            if isinstance(ev, Token):
                c["first"] = c["first"] or (time.monotonic() if ev.text else None)
                c["text"] += ev.text
            elif isinstance(ev, Done):
                if c["turn"]:
                    later.append(c["first"] - c["sent"])
                c["messages"].append({"role": "assistant", "content": c["text"]})
                c.update(turn=c["turn"] + 1, sent=None)
                c["ready"] = time.monotonic() - t0 + c["pause"].uniform(0.2, 1.5)
                del active[ev.id]
    return {
        "later_turns_median_ttft_ms": round(1000 * statistics.median(later)),
        "later_turns_ttft_quartiles_ms": [round(1000 * q) for q in statistics.quantiles(later)],
        "step_median_ms": round(1000 * statistics.median(steps), 1),
        "step_p90_ms": round(1000 * statistics.quantiles(steps, n=10)[-1], 1),
        "seconds": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=8)
    args = parser.parse_args()
    sha, name = serving.MODELS_BY_CATALOG["smollm2-135m-instruct"][0], "smollm2"
    path = serving.local_model(sha, name)
    if path is None:
        sys.exit("no SmolLM2 file under var/: run `make bench` or `make test` once")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    engine = core.BatchEngine(str(path), serving.CONTEXT, serving.SLOTS, args.threads)
    formatter = Jinja2ChatFormatter(
        template=engine.meta("tokenizer.chat_template"),
        eos_token=engine.eos_text(),
        bos_token=engine.bos_text(),
    )
    result = {
        "threads": args.threads,
        "decode_ms": decode_costs(engine),
        "chats": chats(engine, formatter, args.conversations),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
