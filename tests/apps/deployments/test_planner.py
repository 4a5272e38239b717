"""The planner as a pure function on made-up clusters (no database, no agents)."""

from __future__ import annotations

import dataclasses

import pytest

from apps.deployments import planner as P

GiB = P.GiB

# A 30-layer model of 10 GiB of layers plus 1 GiB of embeddings and 1 GiB of output.
BIG = P.ModelFacts(
    name="big",
    n_layers=30,
    bytes_per_layer=tuple([10 * GiB // 30] * 30),
    bytes_embeddings=GiB,
    bytes_output=GiB,
    file_bytes=12 * GiB,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    n_embd=4096,
    n_vocab=32000,
    n_ff=14336,
)
REQ = P.Request(context_length=4096, parallel=2)


def nodes(*free_gib, **kw):
    return [P.NodeState(f"n{i}", int(g * GiB), **kw) for i, g in enumerate(free_gib)]


def test_a_model_that_fits_runs_as_replicas_spread_over_nodes():
    p = P.plan(BIG, P.Request(4096, 2, replicas=3), nodes(40, 30, 20, 5))
    assert p.kind == "replicas" and not p.error
    assert [s.node for s in p.stages] == ["n0", "n1", "n2"]  # spread, most free first
    assert p.needed_bytes == P.replica_stage(BIG, REQ).total_bytes
    assert "no split" in p.reasons[0]


def test_more_replicas_than_nodes_double_up_only_where_two_fit():
    p = P.plan(BIG, P.Request(4096, 2, replicas=3), nodes(40, 15))
    assert [s.node for s in p.stages] == ["n0", "n1", "n0"]
    p = P.plan(BIG, P.Request(4096, 2, replicas=3), nodes(20, 15))
    assert [s.node for s in p.stages] == ["n0", "n1"]
    assert p.warnings[0].startswith("only 2 of 3 replica(s) fit now: each needs ")


def test_a_model_too_big_for_any_node_is_split_over_the_fewest_nodes():
    p = P.plan(BIG, REQ, nodes(8, 8, 8, 8, 2))
    assert p.kind == "split" and p.split_mode == "layer"
    assert len(p.stages) == 2
    head, stage = p.stages
    assert head.role == "head" and stage.role == "stage"
    # Contiguous ranges covering every layer once; the head keeps the first ones.
    assert head.layer_start == 0 and head.layer_end == stage.layer_start
    assert stage.layer_end == BIG.n_layers
    assert all(s.total_bytes <= 8 * GiB for s in p.stages)
    # llama.cpp's view: the output counts as a layer and goes with the last device.
    assert p.n_gpu_layers == BIG.n_layers + 1 - head.layers
    assert p.tensor_split == [stage.layers + 1]
    assert "fewest" in p.reasons[0]


def test_copies_of_a_split_run_on_nodes_that_do_not_overlap():
    p = P.plan(BIG, P.Request(4096, 2, replicas=2), nodes(8, 8, 8, 8, 8, 2))
    assert p.kind == "split" and len(p.copies) == 1
    sets = [{s.node for s in c.stages} for c in p.each_copy()]
    assert all(len(x) == 2 for x in sets) and not sets[0] & sets[1]
    assert all(c.stages[0].role == "head" for c in p.each_copy())
    assert "2 copies" in p.reasons[-1]
    assert len(p.as_dict()["copies"]) == 1
    # Not enough nodes for a third copy: refused, saying which copy and why.
    p = P.plan(BIG, P.Request(4096, 2, replicas=3), nodes(8, 8, 8, 8, 8, 2))
    assert p.kind == "refused" and p.error.startswith("copy 3 of 3:")
    # Pinned: in the order given, the same number per copy, head first.
    p = P.plan(
        BIG,
        P.Request(4096, 2, replicas=2, split_mode="layer", pin_nodes=("n3", "n0", "n1", "n2")),
        nodes(8, 8, 8, 8),
    )
    assert [[s.node for s in c.stages] for c in p.each_copy()] == [["n3", "n0"], ["n1", "n2"]]


def test_three_nodes_when_two_do_not_hold_it():
    p = P.plan(BIG, REQ, nodes(6, 6, 6, 6))
    assert p.kind == "split" and len(p.stages) == 3
    ranges = [(s.layer_start, s.layer_end) for s in p.stages]
    assert ranges[0][0] == 0 and ranges[-1][1] == 30
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert all(s.layers >= 1 for s in p.stages[1:])
    assert all(s.total_bytes <= 6 * GiB for s in p.stages)
    assert sum(p.tensor_split) == p.n_gpu_layers


def test_refusal_says_how_much_is_needed_and_how_much_there_is():
    p = P.plan(BIG, REQ, nodes(3, 3, 2, 1))
    assert p.kind == "refused"
    assert (
        "needs " in p.error and "the largest feasible set of healthy nodes has 9.00 GiB" in p.error
    )
    assert p.needed_bytes > 9 * GiB


def test_draining_and_unready_nodes_are_not_used():
    cluster = nodes(40, ready=False) + [P.NodeState("d", 40 * GiB, draining=True)]
    p = P.plan(BIG, REQ, cluster)
    assert p.kind == "refused" and "no node is ready" in p.error
    p = P.plan(BIG, REQ, cluster + [P.NodeState("ok", 40 * GiB)])
    assert [s.node for s in p.stages] == ["ok"]


def test_pinned_nodes_and_a_forced_split_mode():
    cluster = nodes(40, 40, 40)
    p = P.plan(BIG, P.Request(4096, 2, split_mode="layer", pin_nodes=("n2", "n0")), cluster)
    assert p.kind == "split" and [s.node for s in p.stages] == ["n2", "n0"]
    # Stages keep the pinned order even when another order would give the last more room.
    uneven = [P.NodeState("a", 40 * GiB), P.NodeState("b", 30 * GiB), P.NodeState("c", 20 * GiB)]
    p = P.plan(BIG, P.Request(4096, 2, split_mode="layer", pin_nodes=("a", "b", "c")), uneven)
    assert [s.node for s in p.stages] == ["a", "b", "c"]
    p = P.plan(BIG, P.Request(4096, 2, split_mode="tensor", pin_nodes=("n1", "n2", "n0")), cluster)
    assert p.split_mode == "tensor" and p.n_gpu_layers == -1
    assert [s.role for s in p.stages] == ["head", "stage", "stage"]
    assert sum(p.tensor_split) == pytest.approx(1, abs=1e-3)
    assert any("flash attention" in r for r in p.reasons)
    p = P.plan(BIG, P.Request(4096, 2, split_mode="tensor", pin_nodes=("n1", "n2")), cluster)
    assert p.kind == "refused" and "at least 3 ready nodes" in p.error
    p = P.plan(BIG, P.Request(4096, 2, pin_nodes=("n1",)), cluster)
    assert p.kind == "replicas" and [s.node for s in p.stages] == ["n1"]
    assert (
        "unknown node(s): nope"
        in P.plan(BIG, P.Request(4096, 2, pin_nodes=("nope",)), cluster).error
    )
    p = P.plan(BIG, P.Request(4096, 2, split_mode="none"), nodes(8, 8))
    assert p.kind == "refused" and "on one node" in p.error
    assert P.plan(BIG, P.Request(4096, 2, split_mode="diagonal"), cluster).kind == "refused"


def test_a_split_prefers_a_head_with_fast_links_and_warns_about_slow_ones():
    cluster = nodes(8, 8, 8)
    links = {
        ("n0", "n1"): P.Link(rtt_ms=5.0, mbit_s=100),
        ("n0", "n2"): P.Link(rtt_ms=5.0, mbit_s=100),
        ("n1", "n2"): P.Link(rtt_ms=0.1, mbit_s=10000),
    }
    p = P.plan(BIG, REQ, cluster, links)
    assert {s.node for s in p.stages} == {"n1", "n2"} and not p.warnings
    # Forced over the slow links, the plan says so.
    p = P.plan(BIG, P.Request(4096, 2, pin_nodes=("n0", "n1")), cluster, links)
    assert any("slow link n0 <-> n1: 5.00 ms" in w for w in p.warnings)
    p = P.plan(BIG, REQ, cluster)
    assert any("not measured" in w for w in p.warnings)


def test_accelerator_memory_takes_layers_first():
    """A node with (reported) accelerator memory gets n_gpu_layers for what fits there."""
    cluster = [P.NodeState("gpu", 4 * GiB, accelerator_bytes=(10 * GiB,))]
    p = P.plan(BIG, REQ, cluster)
    assert p.kind == "replicas"
    [s] = p.stages
    per_layer = BIG.bytes_per_layer[0] + P.kv_bytes(BIG, REQ, 1)
    assert s.n_gpu_layers == min(30, 10 * GiB // per_layer)
    assert any("n_gpu_layers" in r for r in p.reasons)


def test_kv_and_compute_grow_with_context_and_slots():
    small = P.replica_stage(BIG, P.Request(1024, 1))
    big = P.replica_stage(BIG, P.Request(8192, 4))
    assert big.kv_bytes == small.kv_bytes * 32
    assert big.compute_bytes > small.compute_bytes
    assert P.kv_cells(1000) == 1024  # padded to 256


def test_a_thousand_nodes_plan_quickly_enough_to_run_per_request():
    """Correctness at scale (timing is in bench/planner.py): 1,000 nodes of 2 GiB."""
    cluster = nodes(*([2] * 1000))
    p = P.plan(BIG, REQ, cluster)
    assert p.kind == "split" and 7 <= len(p.stages) <= 16
    assert sum(s.layers for s in p.stages) == 30


# gemma-3-like: 18 layers, 15 of them with a 512-token window.
SWA = dataclasses.replace(
    BIG,
    name="swa",
    n_layers=18,
    bytes_per_layer=(GiB // 18,) * 18,
    sliding_window=512,
    sliding_pattern="111110" * 3,
)


def test_the_window_cache_sizes_sliding_layers_by_the_window_and_lets_more_fit():
    """Whole replicas with swa_window keep the window plus one ubatch (padded to 256) in
    each sliding layer, the full context in the others; a model with no window keeps the
    full cache. The smaller estimate is what places a replica."""
    full, window = P.Request(32768, 4), P.Request(32768, 4, swa_window=True)
    per_cell = 2 * SWA.n_kv_heads * SWA.head_dim * 2
    expected = (3 * 32768 + 15 * 1024) * 4 * per_cell
    assert P.replica_stage(SWA, window).kv_bytes == expected
    assert P.replica_stage(SWA, full).kv_bytes == 18 * 32768 * 4 * per_cell
    short = P.Request(512, 4, swa_window=True)  # the window is no smaller than the context
    assert P.replica_stage(SWA, short).kv_bytes == P.replica_stage(SWA, P.Request(512, 4)).kv_bytes
    assert P.replica_stage(BIG, P.Request(32768, 4, swa_window=True)).kv_bytes == (
        P.replica_stage(BIG, P.Request(32768, 4)).kv_bytes
    )
    head = P.split_stage(SWA, full, "head", 0, 9, output=False)
    assert head.kv_bytes == P.kv_bytes(SWA, full, 9)

    whole = P.replica_stage(SWA, window).total_bytes
    room = nodes(whole / GiB + 0.01)
    p = P.plan(SWA, window, room)
    assert (
        p.kind == "replicas"
        and "15 of 18 layers keeping only their 512-token window" in (p.reasons[0])
    )
    assert P.plan(SWA, full, room).kind == "refused"  # one node: the full cache does not fit


def test_a_split_sizes_each_stages_sliding_layers_by_the_window():
    """Each stage holds its own layers' cells: a layer split's stage counts the sliding
    layers in its range (gemma-3's full layer is the last of each six), a tensor split's
    its share of the whole cache. With the window a model needing a split takes fewer
    nodes; an older agent at the head keeps the full cache and is planned so."""
    full, window = P.Request(32768, 4), P.Request(32768, 4, swa_window=True)
    per_slot = 4 * 2 * SWA.n_kv_heads * SWA.head_dim * 2
    # Layers 0-6 hold one full layer (5), 7-17 two (11 and 17).
    head = P.split_stage(SWA, window, "head", 0, 7, output=False)
    assert head.kv_bytes == (1 * 32768 + 6 * 1024) * per_slot
    last = P.split_stage(SWA, window, "stage", 7, 18, output=True)
    assert last.kv_bytes == (2 * 32768 + 9 * 1024) * per_slot
    assert head.kv_bytes + last.kv_bytes == P.replica_stage(SWA, window).kv_bytes
    # A tensor stage's half of each cache, in whole layers rounded up (llama.cpp hands out
    # whole layers where the KV heads do not divide): 2 of 3 full layers, 8 of 15 sliding.
    half = P.split_stage(SWA, window, "stage", 0, 18, output=True, share=0.5)
    assert half.kv_bytes == (2 * 32768 + 8 * 1024) * per_slot

    room = nodes(6, 6, 6, 6)  # no node holds a whole copy (16 GiB with the window)
    p = P.plan(SWA, window, room)
    assert p.kind == "split" and len(p.stages) == 2
    assert sum(s.kv_bytes for s in p.stages) == P.replica_stage(SWA, window).kv_bytes
    assert any("15 of 18 layers keeping only their 512-token window" in x for x in p.reasons)
    assert all(s.total_bytes <= 6 * GiB for s in p.stages)
    p_full = P.plan(SWA, full, room)
    assert p_full.kind == "split" and len(p_full.stages) > 2
    # The head's agent predates the window: the whole split is planned with the full cache.
    pinned = dataclasses.replace(window, pin_nodes=("n0", "n1"))
    for head_has_window, kv in ((True, window), (False, full)):
        two = nodes(10, 10, window_cache=True)
        two[0] = dataclasses.replace(two[0], window_cache=head_has_window)
        p = P.plan(SWA, pinned, two)
        assert p.kind == "split", p.error
        assert sum(s.kv_bytes for s in p.stages) == P.replica_stage(SWA, kv).kv_bytes
