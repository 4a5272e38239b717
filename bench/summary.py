"""Every run of the serving benchmark against its targets, as a Markdown table.

One run's ratio proves little on a shared machine, so bench/serving.py keeps each run's
headline figures under "history"; this prints, per figure, the latest run, how many runs
measured it, their range and median, and how many met the target (for 8 streams also the
median of every round, each one comparing the two targets back to back). The README's
summary tables are this script's output. Usage:
  .venv/bin/python bench/summary.py [bench/results/serving.json] [--since 2026-12-04]
                                   [--node-core]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def at_least(bound: float) -> tuple[str, object]:
    return f">= {bound}x", lambda v: v >= bound


def at_most(bound: float) -> tuple[str, object]:
    return f"<= {bound}x", lambda v: v <= bound


def within_ms(bound: float) -> tuple[str, object]:
    return f"within {bound} ms", lambda v: v <= bound


NO_TARGET = ("", None)
ROUTING = "prefix_routing"
EACH, SHARED = "routing, a system prompt each", "routing, one shared system prompt"

#: (part, figure, what it is, target: its text and the test of one value)
TARGETS = [
    ("single_stream", "decode_ratio", "one stream, decode", at_least(0.95)),
    (
        "single_stream",
        "cold_ttft_paired_difference_ms",
        "one stream, cold TTFT, paired difference (ms)",
        within_ms(10),
    ),
    (
        "single_stream",
        "cold_ttft_difference_ms",
        "one stream, cold TTFT, difference of medians (ms)",
        within_ms(10),
    ),
    ("concurrent_8", "tokens_per_s_ratio", "8 streams, throughput", at_least(1.0)),
    ("concurrent_8", "median_ttft_ratio", "8 streams, median TTFT", at_most(1.0)),
    (
        "short_requests",
        "requests_per_s_ratio",
        "short requests (one token each), requests a second",
        NO_TARGET,
    ),
    ("multi_turn_chat", "later_turns_ttft_ratio", "6-turn chat, TTFT of turns 2-6", at_most(1.2)),
    ("many_conversations", "later_turns_ttft_ratio", "16 chats on 8 slots, TTFT", NO_TARGET),
    # A conversation whose last turn ran past a sliding window, then the next question,
    # the answer regenerated, or the last message edited (bench/serving.py's long_chat).
    *(
        ("long_chat", f"{kind}_ttft_ratio", f"long chat, {label}: TTFT", NO_TARGET)
        for kind, label in (
            ("next_turn", "the next question"),
            ("regenerate", "the long answer regenerated"),
            ("edit_last_message", "the last message edited"),
            ("edit_earlier_message", "a message two turns back edited"),
            ("regenerate_pushed_out", "regenerated after 8 others took every slot"),
            ("edit_last_message_pushed_out", "edited after 8 others took every slot"),
        )
    ),
    # The routing parts at each pace: users pausing 0.2-1.5 s between turns (busy), and
    # 4-10 s (bench/serving.py's READING).
    *(
        row
        for part, pace in ((ROUTING, ""), (f"{ROUTING}_reading", " at reading pace"))
        for row in (
            (
                part,
                "distinct_ttft_ratio",
                f"{EACH}{pace}: prefix / least connections, TTFT",
                at_most(0.5),
            ),
            (part, "distinct_tokens_per_s_ratio", f"{EACH}{pace}: throughput", at_least(1.0)),
            (part, "shared_ttft_ratio", f"{SHARED}{pace}: TTFT", at_most(0.5)),
            (part, "shared_tokens_per_s_ratio", f"{SHARED}{pace}: throughput", at_least(1.0)),
            (
                part,
                "distinct_ttft_ratio_vs_llama_servers",
                f"{EACH}{pace}: prefix / two llama-servers behind nginx, TTFT",
                NO_TARGET,
            ),
            (
                part,
                "shared_ttft_ratio_vs_llama_servers",
                f"{SHARED}{pace}: prefix / the llama-server pair, TTFT",
                NO_TARGET,
            ),
        )
    ),
]


def summarize(history: list[dict], since: str = "", node_core: bool = False) -> list[dict]:
    """One row per figure that some run measured. Runs of another configuration are left
    out: the agent's or llama-server's flash attention changed, the sliding-window cache
    other than the default of its day, and the node on a core of its own unless node_core
    asks for those runs alone."""
    runs = [
        r
        for r in history
        if r["measured_at"] >= since
        and "agent_flash_attn" not in r
        and "server_flash_attn" not in r
        and "agent_swa_cache" not in r  # the window cache before it was the default
        and "swa_cache" not in r  # the full cache since
        and bool(r.get("node_core")) == node_core
    ]
    rows = []
    for part, figure, label, (target, test) in TARGETS:
        values = [
            (r["measured_at"], r[part][figure])
            for r in runs
            if isinstance(r.get(part, {}).get(figure), (int, float))
        ]
        if not values:
            continue
        numbers = [v for _, v in values]
        row = {
            "figure": label,
            "latest": values[-1][1],
            "latest_at": values[-1][0],
            "runs": len(values),
            "min": min(numbers),
            "median": statistics.median(numbers),
            "max": max(numbers),
            "target": target,
            "met": sum(map(test, numbers)) if test else None,
        }
        if figure in ("tokens_per_s_ratio", "requests_per_s_ratio"):
            rounds = [x for r in runs for x in r.get(part, {}).get("round_ratios") or []]
            row["rounds"] = len(rounds)
            row["rounds_median"] = statistics.median(rounds) if rounds else None
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| figure | latest run | runs | range (median) | runs meeting the target | target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        spread = f"{r['min']:.2f} to {r['max']:.2f} ({r['median']:.2f})"
        if "rounds" in r:
            spread += f"; its {r['rounds']} rounds: median {r['rounds_median']:.3f}"
        met = "" if r["met"] is None else f"{r['met']} of {r['runs']}"
        lines.append(
            f"| {r['figure']} | {r['latest']:.3f} ({r['latest_at'][:16]}) | {r['runs']} "
            f"| {spread} | {met} | {r['target']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("file", nargs="?", default="bench/results/serving.json")
    parser.add_argument("--since", default="", help="only runs measured at or after this")
    parser.add_argument(
        "--node-core", action="store_true", help="the runs of serving.py --node-core alone"
    )
    args = parser.parse_args()
    history = json.loads(Path(args.file).read_text()).get("history", [])
    print(markdown(summarize(history, args.since, args.node_core)))


if __name__ == "__main__":
    main()
