"""One engine alone through the routing part's chats: the floor under the stack's figures.

`python bench/engine_turns.py [--threads 1] [--conversations 8] [--rounds 1]
[--distinct-first] [--flash-attn auto|on|off] [--prompt-first on|off|both]` steps a
BatchEngine in this process (no agent, web process or HTTP) through conversations like
those of `bench/serving.py`'s routing part with one shared system prompt: 5 turns of 32
greedy tokens, history resent, each user pausing 0.2-1.5 s (the same seeds). It prints the
median time to first token of turns 2-5, from the user sending a turn and from the loop
taking it between steps (what the agent's histogram measures), and the step times. Before
that it times single llama_decode calls of a few batch shapes over 0 to 1024 cached tokens
a slot: the cost of a step by its tokens. `--rounds N` runs N rounds on the same engine:
the first reads the system prompt 8 times, which spreads its conversations out, while later
rounds find it cached and take their turns together, as the routing part's rounds do
(`--distinct-first` runs a round with a system prompt each before them). `--rounds 0` times
the decode calls only. `--prompt-first both` compares the engine's two orders for a short
prompt beside running streams, round by round. Nothing is written: the figures are for
reading beside the routing part's, on the same machine in the same hour. Needs the SmolLM2
file of a bench run (var/bench/models) or of the tests (var/test-cache).
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


def decode_costs(engine: core.BatchEngine, bases=(0, 128, 256, 512, 1024)) -> dict:
    """Median ms of one llama_decode per batch shape ((slot, tokens) pairs) with `base`
    tokens cached in each of the 8 slots (the first of 4 calls left out)."""
    shapes = {
        "8 streams x 1 token": [(i, 1) for i in range(8)],
        "a 64-token chunk alone": [(0, 64)],
        "7 streams + a 32-token chunk": [(i, 1) for i in range(1, 8)] + [(0, 32)],
    }
    L = core.L
    L.llama_memory_clear(engine.memory, True)
    pos = [0] * 8  # next position of each slot

    def decode(batch: list[tuple[int, int]], logits: bool) -> float:
        n = 0
        for slot, k in sorted(batch):
            for j in range(k):
                engine._add(
                    n, 100 + (pos[slot] + j) % 50, pos[slot] + j, slot, logits and j == k - 1
                )
                n += 1
            pos[slot] += k
        engine.batch.n_tokens = n
        t = time.perf_counter()
        L.llama_decode(engine.ctx, engine.batch)
        return time.perf_counter() - t

    def timed(shape: list[tuple[int, int]], base: int) -> float:
        took = decode(shape, True)
        for slot, _ in shape:  # back to the base: every timed batch sits on the same cache
            L.llama_memory_seq_rm(engine.memory, slot, base, -1)
            pos[slot] = base
        return took

    out = {}
    for base in bases:
        for slot in range(8):
            while pos[slot] < base:
                decode([(slot, min(core.N_BATCH, base - pos[slot]))], False)
        for name, shape in shapes.items():
            times = [timed(shape, base) for _ in range(4)]
            out[f"{name}, {base} cached"] = round(1000 * statistics.median(times[1:]), 1)
    L.llama_memory_clear(engine.memory, True)
    return out


def chats(
    engine: core.BatchEngine, formatter, n: int, r: int = 0, shared: bool = True, tag: str = ""
) -> dict:
    """One round of n conversations (round r's seeds, and its tags unless `tag` is given),
    all starting together."""
    convs = [
        {
            "messages": [
                {
                    "role": "system",
                    "content": serving.system_prompt("shared" if shared else f"{r}.{c}"),
                }
            ],
            "turn": 0,
            "ready": 0.0,
            "pause": random.Random(f"{r}.{c}"),
            "sent": None,
        }
        for c in range(n)
    ]
    active: dict[str, dict] = {}
    later, taken, steps, evaluated, beside, generated = [], [], [], [], [], 0
    t0 = time.monotonic()
    while active or any(c["turn"] < 5 for c in convs):
        now = time.monotonic() - t0
        for i, c in enumerate(convs):
            if c["turn"] < 5 and c["sent"] is None and now >= c["ready"]:
                k = c["turn"]
                first = f"(e {tag or r}.{i}) " + serving.QUESTIONS[0]
                text = first if k == 0 else serving.QUESTIONS[k]
                c["messages"].append({"role": "user", "content": text})
                tokens = _build_prompt(engine, formatter, {"messages": c["messages"]})
                rid = f"{r}.{i}.{k}"
                engine.submit(
                    core.Request(rid, tokens, max_tokens=32, sampling=core.Sampling(temperature=0))
                )
                # Timed from when the user sent it (a turn that comes in during a step waits
                # for that step, as in the agent's engine) and from when the loop took it
                # (what the agent's own histogram measures).
                c.update(sent=t0 + c["ready"], taken=time.monotonic(), first=None, text="")
                # Turns still waiting for their first token beside this one: arrivals that
                # come together share a step, and each waits for all their prompts.
                c["beside"] = sum(1 for o in active.values() if o["first"] is None)
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
                generated += ev.usage["completion_tokens"]
                if c["turn"]:
                    later.append(c["first"] - c["sent"])
                    taken.append(c["first"] - c["taken"])
                    evaluated.append(ev.usage["prompt_tokens"] - ev.usage["cached_tokens"])
                    beside.append(c["beside"])
                c["messages"].append({"role": "assistant", "content": c["text"]})
                c.update(turn=c["turn"] + 1, sent=None)
                c["ready"] = time.monotonic() - t0 + c["pause"].uniform(0.2, 1.5)
                del active[ev.id]
    return {
        "later_turns_median_ttft_ms": round(1000 * statistics.median(later)),
        "later_turns_ttft_quartiles_ms": [round(1000 * q) for q in statistics.quantiles(later)],
        "later_turns_median_ttft_from_taken_ms": round(1000 * statistics.median(taken)),
        "later_turns_evaluated_tokens_median_mean": [
            statistics.median(evaluated),
            round(statistics.fmean(evaluated), 1),
        ],
        "generated_tokens": generated,
        "later_turns_mean_waiting_beside": round(statistics.fmean(beside), 2),
        "step_median_ms": round(1000 * statistics.median(steps), 1),
        "step_p90_ms": round(1000 * statistics.quantiles(steps, n=10)[-1], 1),
        "seconds": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--flash-attn", choices=core.FLASH_ATTN_MODES, default="auto")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of shared-prompt chats, one engine"
    )
    parser.add_argument(
        "--prompt-first",
        choices=("on", "off", "both"),
        default="on",
        help="a short prompt beside running streams read in a step of its own (the engine's "
        "default) or in theirs; both: after a warm round, each round once each way, in "
        "alternating order, the same pauses and new conversations for each",
    )
    parser.add_argument(
        "--distinct-first",
        action="store_true",
        help="a round with a system prompt per conversation first, as in the routing part",
    )
    args = parser.parse_args()
    sha, name = serving.MODELS_BY_CATALOG["smollm2-135m-instruct"][0], "smollm2"
    path = serving.local_model(sha, name)
    if path is None:
        sys.exit("no SmolLM2 file under var/: run `make bench` or `make test` once")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    engine = core.BatchEngine(
        str(path), serving.CONTEXT, serving.SLOTS, args.threads, flash_attn=args.flash_attn
    )
    formatter = Jinja2ChatFormatter(
        template=engine.meta("tokenizer.chat_template"),
        eos_token=engine.eos_text(),
        bos_token=engine.bos_text(),
    )
    result = {
        "threads": args.threads,
        "flash_attn": args.flash_attn,
        "decode_ms": decode_costs(engine),
    }
    if args.distinct_first:
        result["distinct"] = chats(engine, formatter, args.conversations, -1, shared=False)
    if args.prompt_first == "both":
        chats(engine, formatter, args.conversations, 0)  # reads the shared prompt once
        arms: dict[str, list[dict]] = {"on": [], "off": []}
        for r in range(1, args.rounds + 1):
            for arm in ("on", "off") if r % 2 else ("off", "on"):
                engine.prompt_first = arm == "on"
                arms[arm].append(chats(engine, formatter, args.conversations, r, tag=f"{r}{arm}"))
        result["prompt_first"] = arms
        print(json.dumps(result, indent=2))
        return
    engine.prompt_first = args.prompt_first == "on"
    rounds = [chats(engine, formatter, args.conversations, r) for r in range(args.rounds)]
    if rounds:
        result["chats"] = rounds[0] if len(rounds) == 1 else rounds
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
