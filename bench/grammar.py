"""What grammar sampling (structured outputs, required tool calls) costs the sequences it
shares a batch with: `python bench/grammar.py` (needs the test model cache: run the tests once).

One engine (SmolLM2-135M Q4_1, 8 slots, 2 threads). Each round decodes 8 sequences together:
`free`: all 8 free text; `mixed`: 4 free plus 4 under a JSON-schema grammar (a long string
field, so they stay in the batch). Rounds alternate. The figure is the step time while all 8
decode (no prompt in the batch), which is what every sequence in the batch waits for, plus
the grammar's cost per constrained sequence per step. Writes bench/results/grammar.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.engine.core import BatchEngine, Request, Sampling  # noqa: E402
from workers.engine.grammar import grammar_for_schema  # noqa: E402

MODEL = (
    ROOT
    / "var"
    / "test-cache"
    / ("sha256-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53.gguf")
)
SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400}},
    "required": ["story"],
}
ROUNDS, TOKENS = 4, 96


def prompt(engine, text: str) -> list[int]:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    fmt = Jinja2ChatFormatter(
        template=engine.meta("tokenizer.chat_template"),
        eos_token=engine.eos_text(),
        bos_token=engine.bos_text(),
    )
    rendered = fmt(messages=[{"role": "user", "content": text}]).prompt
    return engine.tokenize(rendered, add_bos=False, special=True)


def one_round(engine, tokens: list[int], grammar: str, mixed: bool, tag: str) -> list[float]:
    """Step times (s) while all 8 sequences decode."""
    for i in range(8):
        s = Sampling(temperature=0.8, seed=i, grammar=grammar if mixed and i >= 4 else "")
        engine.submit(Request(f"{tag}{i}", tokens, TOKENS, s, cache_prompt=False))
    times = []
    while not engine.idle():
        decoding = len(engine.active) == 8 and all(
            s.prefill_pos >= len(s.prefill) for s in engine.active.values()
        )
        t = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t)
    return times


def main() -> None:
    if not MODEL.exists():
        sys.exit(f"{MODEL} is missing: run the tests once (they fetch it)")
    engine = BatchEngine(str(MODEL), context_length=4096, parallel=8, threads=2, max_queue=16)
    tokens = prompt(engine, "Tell me a long story about a lighthouse, as JSON.")
    grammar = grammar_for_schema(json.dumps(SCHEMA))
    steps = {"free": [], "mixed": []}
    for r in range(ROUNDS):
        for mode in ("free", "mixed") if r % 2 == 0 else ("mixed", "free"):
            steps[mode] += one_round(engine, tokens, grammar, mode == "mixed", f"{mode}{r}-")
    engine.close()
    free, mixed = statistics.median(steps["free"]), statistics.median(steps["mixed"])
    result = {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": "SmolLM2-135M Q4_1",
        "batch": "8 sequences decoding, 2 threads",
        "steps_measured": {k: len(v) for k, v in steps.items()},
        "step_ms_all_free": round(free * 1000, 2),
        "step_ms_4_under_grammar": round(mixed * 1000, 2),
        "slowdown_of_the_free_sequences": round(mixed / free, 3),
        "grammar_ms_per_constrained_sequence_per_step": round((mixed - free) * 1000 / 4, 2),
    }
    out = ROOT / "bench" / "results" / "grammar.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
