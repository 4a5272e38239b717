"""bench/summary.py, which the README's tables of every bench run come from."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "bench_summary", Path(__file__).resolve().parent.parent / "bench" / "summary.py"
)
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)


def run(at: str, tps: float, rounds: list[float], **extra) -> dict:
    return {
        "measured_at": at,
        "concurrent_8": {"tokens_per_s_ratio": tps, "round_ratios": rounds},
        **extra,
    }


HISTORY = [
    run("2026-12-01T10:00:00Z", 0.90, [0.9, 0.9]),
    run("2026-12-04T10:00:00Z", 1.02, [1.1, 0.97]),
    run("2026-12-04T11:00:00Z", 0.98, [0.95, 1.01, 1.2]),
    # another configuration of the agent: not one of the runs the targets are about
    run("2026-12-04T12:00:00Z", 2.0, [2.0], agent_flash_attn="off"),
    run("2026-12-04T12:10:00Z", 2.0, [2.0], server_flash_attn="off"),  # llama-server's, too
    run("2026-12-04T12:20:00Z", 2.0, [2.0], agent_swa_cache="window"),
    run("2026-12-04T12:25:00Z", 2.0, [2.0], swa_cache="full"),  # not the deployment default
    run("2026-12-04T12:30:00Z", 0.5, [0.5], node_core=True),
    {
        "measured_at": "2026-12-04T13:00:00Z",
        "single_stream": {"decode_ratio": 0.94, "cold_ttft_paired_difference_ms": 10.0},
        "short_requests": {"requests_per_s_ratio": 1.05, "round_ratios": [1.0, 1.1, 1.05]},
    },
]


def test_counts_runs_meeting_each_target_since_a_date():
    rows = {r["figure"]: r for r in summary.summarize(HISTORY, since="2026-12-04")}
    tps = rows["8 streams, throughput"]
    assert (tps["runs"], tps["met"], tps["latest"]) == (2, 1, 0.98)
    assert (tps["min"], tps["median"], tps["max"]) == (0.98, 1.0, 1.02)
    assert (tps["rounds"], tps["rounds_median"]) == (5, 1.01)
    assert rows["one stream, decode"]["met"] == 0
    assert rows["one stream, cold TTFT, paired difference (ms)"]["met"] == 1  # 10 is within
    assert "8 streams, median TTFT" not in rows  # no run measured it


def test_all_runs_without_a_date_and_the_table():
    rows = summary.summarize(HISTORY)
    [tps] = [r for r in rows if r["figure"] == "8 streams, throughput"]
    assert (tps["runs"], tps["met"]) == (3, 1)
    table = summary.markdown(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert "| 8 streams, throughput | 0.980 (2026-12-04T11:00) | 3 |" in "\n".join(table)


def test_the_node_core_runs_alone():
    [tps] = [r for r in summary.summarize(HISTORY, node_core=True) if "throughput" in r["figure"]]
    assert (tps["runs"], tps["latest"], tps["met"]) == (1, 0.5, 0)


def test_a_figure_without_a_target_counts_its_rounds_and_meets_nothing():
    rows = {r["figure"]: r for r in summary.summarize(HISTORY)}
    short = rows["short requests (one token each), requests a second"]
    assert (short["runs"], short["latest"], short["met"]) == (1, 1.05, None)
    assert (short["rounds"], short["rounds_median"]) == (3, 1.05)
    [line] = [x for x in summary.markdown(list(rows.values())).splitlines() if "short" in x]
    assert line.endswith("| 1.05 to 1.05 (1.05); its 3 rounds: median 1.050 |  |  |")


def test_the_two_routing_paces_are_counted_apart():
    history = [
        {
            "measured_at": "2026-12-06T08:00:00Z",
            "prefix_routing": {"distinct_ttft_ratio": 0.6, "shared_ttft_ratio": 0.7},
            "prefix_routing_reading": {"distinct_ttft_ratio": 0.3, "shared_ttft_ratio": 0.55},
        },
        {
            "measured_at": "2026-12-06T09:00:00Z",
            "prefix_routing_reading": {"distinct_ttft_ratio": 0.4, "shared_ttft_ratio": 0.45},
        },
    ]
    rows = {r["figure"]: r for r in summary.summarize(history)}
    busy = rows["routing, a system prompt each: prefix / least connections, TTFT"]
    reading = rows[
        "routing, a system prompt each at reading pace: prefix / least connections, TTFT"
    ]
    assert (busy["runs"], busy["met"], busy["latest"]) == (1, 0, 0.6)
    assert (reading["runs"], reading["met"], reading["latest"]) == (2, 2, 0.4)
    shared = rows["routing, one shared system prompt at reading pace: TTFT"]
    assert (shared["runs"], shared["met"], shared["median"]) == (2, 1, 0.5)
