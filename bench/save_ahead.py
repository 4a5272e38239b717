"""A new request's first token with the slot it takes copied to host RAM ahead of need.

`python bench/save_ahead.py [--rounds 6] [--history 128,1024]` steps one BatchEngine in
this process (8 slots of 2048 tokens, 2 threads, SmolLM2, as the serving bench's replica):
each round fills every slot with a conversation of about `history` tokens, then sends 8
cold prompts one at a time, each taking the least recently used slot and so pushing a
conversation out to host RAM. One arm lets the engine copy the slots while idle first
(`save_ahead`, what the engine process does after SAVE_AHEAD_AFTER idle seconds); the
other copies each slot when the cold prompt takes it (as llama-server does, and as the
engine did before). The arms alternate round by round on the same engine, and the
difference is what the copy costs on a request's way to its first token. Writes
bench/results/save_ahead.json. Needs the SmolLM2 file of a bench run (var/bench/models)
or of the tests (var/test-cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import serving  # noqa: E402

from workers.engine import core  # noqa: E402
from workers.engine.events import Token  # noqa: E402
from workers.engine.process import _build_prompt  # noqa: E402

GREEDY = core.Sampling(temperature=0)


def first_token_ms(engine: core.BatchEngine, req: core.Request) -> float:
    """Milliseconds from submitting the request to its first token; runs it to the end."""
    t0 = time.perf_counter()
    engine.submit(req)
    first = None
    while not engine.idle():
        for ev in engine.step():
            if first is None and isinstance(ev, Token) and ev.id == req.request_id:
                first = time.perf_counter()
    return 1000 * (first - t0)


def measure(engine: core.BatchEngine, tokens, history: int, rounds: int) -> dict:
    """Both arms, alternating, for slots holding about `history` tokens each."""
    arms: dict[str, list[float]] = {"ahead": [], "at_claim": []}
    sizes = []
    n = 0
    for r in range(rounds):
        for arm in ("ahead", "at_claim") if r % 2 == 0 else ("at_claim", "ahead"):
            for i in range(serving.SLOTS):  # every slot holds a conversation
                n += 1
                prompt = tokens(serving.story(i, f"fill {r} {arm}"))[:-1]
                while len(prompt) < history:  # a long history, read rather than generated
                    prompt += tokens(serving.story(i + len(prompt), f"more {n}"))[1:-1]
                engine.submit(core.Request(f"f{n}", prompt[:history], 4, GREEDY))
            while not engine.idle():
                engine.step()
            if arm == "at_claim":  # the size of a conversation's copy, for the record
                sizes += [
                    core.L.llama_state_seq_get_size(engine.ctx, s) for s in range(serving.SLOTS)
                ]
            for k in range(serving.SLOTS):
                if arm == "ahead":
                    while engine.save_ahead():
                        pass
                n += 1
                cold = core.Request(
                    f"c{n}", tokens(serving.story(1, f"cold {r}.{k} {arm}")), 2, GREEDY,
                    cache_prompt=False,
                )  # fmt: skip
                arms[arm].append(first_token_ms(engine, cold))
    med = {a: statistics.median(v) for a, v in arms.items()}
    return {
        "history_tokens": history,
        "cold_requests_per_arm": len(arms["ahead"]),
        "first_token_ms_median": {a: round(v, 2) for a, v in med.items()},
        "difference_ms": round(med["ahead"] - med["at_claim"], 2),
        "conversation_state_mib": round(statistics.median(sizes) / (1 << 20), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--history", default="128,1024", help="tokens a slot holds, per part")
    args = parser.parse_args()
    sha = serving.MODELS_BY_CATALOG["smollm2-135m-instruct"][0]
    path = serving.local_model(sha, "smollm2")
    if path is None:
        sys.exit("no SmolLM2 file under var/: run `make bench` or `make test` once")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    engine = core.BatchEngine(str(path), serving.CONTEXT, serving.SLOTS, serving.THREADS)
    fmt = Jinja2ChatFormatter(
        template=engine.meta("tokenizer.chat_template"),
        eos_token=engine.eos_text(),
        bos_token=engine.bos_text(),
    )

    def tokens(messages):  # as the engine process reads a chat request
        return _build_prompt(engine, fmt, {"messages": messages})

    try:
        parts = [measure(engine, tokens, int(h), args.rounds) for h in args.history.split(",")]
    finally:
        engine.close()
    result = {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": path.name,
        "slots": serving.SLOTS,
        "context_per_slot": serving.CONTEXT,
        "threads": serving.THREADS,
        "parts": parts,
    }
    print(json.dumps(result, indent=2))
    out = ROOT / "bench/results/save_ahead.json"
    old = json.loads(out.read_text()) if out.exists() else {}
    result["history"] = old.get("history", []) + [
        {"measured_at": result["measured_at"], **{f"h{p['history_tokens']}": p for p in parts}}
    ]
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
