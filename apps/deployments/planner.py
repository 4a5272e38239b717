"""The shard planner: where a model runs, as a pure function of (model, request, cluster).

No database, no network: the deployments app turns rows into these dataclasses, calls
`plan()`, and stores what comes back, so the decision is testable on made-up clusters of
any size (bench/planner.py times 1,000 nodes).

Memory per node is what llama.cpp allocates (the formulas below were fitted to its own
reports and are checked against them in tests/apps/deployments/test_memory.py):
  weights of the node's layers (token embeddings on the head, the output on the device
  that computes the logits) + KV cache of those layers (cells x K/V x n_kv_heads x head_dim,
  f16) + the device's compute buffer + the process's overhead.

Policy, in order: replicas on single nodes when one node holds the model (a split buys
capacity, not speed: every token crosses the network); otherwise the fewest nodes that hold
it, largest free memory first, the head being the node with the best links to the others;
otherwise a refusal that says how far off the cluster is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

GiB = 2**30
MiB = 2**20

#: Tokens the engine decodes at once (workers.engine.core.N_BATCH): sizes compute buffers.
N_UBATCH = 512
#: llama.cpp rounds each sequence's KV stream up to a multiple of this many cells.
KV_PAD = 256
#: Resident memory of an engine process beyond llama.cpp's buffers (Python, runtime).
ENGINE_OVERHEAD_BYTES = 160 * MiB
#: Resident memory of an rpc server process beyond its buffers.
RPC_OVERHEAD_BYTES = 48 * MiB
#: Links slower than this (round trip, ms) or thinner than this (Mbit/s) get a warning.
SLOW_RTT_MS = 2.0
THIN_MBIT = 1000.0

SPLIT_MODES = ("auto", "none", "layer", "tensor")
#: Bounds of a deployment (the API, the services and the planner all read these).
MAX_REPLICAS = 64
MIN_CONTEXT = 16
MAX_CONTEXT = 1 << 20
MAX_PARALLEL = 256


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs to know about a model, from its GGUF metadata."""

    name: str
    n_layers: int
    bytes_per_layer: tuple[int, ...]
    bytes_embeddings: int
    bytes_output: int
    file_bytes: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_embd: int
    n_vocab: int
    n_ff: int
    sliding_window: int = 0
    #: A character a layer, "1" where it attends only to the window (gemma-3: 5 of every
    #: 6); "" where none does or which ones is unknown (the KV is then sized as full).
    sliding_pattern: str = ""

    @property
    def layer_bytes(self) -> int:
        return sum(self.bytes_per_layer)

    @property
    def sliding_layers(self) -> int:
        return self.sliding_pattern.count("1")

    @classmethod
    def from_metadata(cls, name: str, meta, file_bytes: int) -> ModelFacts:
        """From gguf_meta.read_metadata's dict (or anything with its keys)."""
        keys = [f for f in cls.__dataclass_fields__ if f not in ("name", "file_bytes")]
        facts = {k: meta[k] for k in keys}
        facts["bytes_per_layer"] = tuple(facts["bytes_per_layer"])
        return cls(name=name, file_bytes=file_bytes, **facts)


@dataclass(frozen=True)
class Request:
    """What the user asks for."""

    context_length: int
    parallel: int
    replicas: int = 1
    split_mode: str = "auto"  # auto: replicas if one node holds it, else a layer split
    pin_nodes: tuple[str, ...] = ()  # only these nodes; the first is the head of a split
    max_nodes: int = 16  # most nodes one split may span
    #: Sliding layers keep only the window (llama-server's default), in whole replicas and
    #: in a split's stages alike.
    swa_window: bool = False


@dataclass(frozen=True)
class NodeState:
    """One node as the control plane last saw it."""

    name: str
    free_bytes: int
    ready: bool = True
    draining: bool = False
    #: Accelerator memory per device, in bytes; the layers that fit there go there.
    accelerator_bytes: tuple[int, ...] = ()
    #: Replicas of the same deployment it already holds (new ones spread away from it).
    holds: int = 0
    #: Its agent honours Request.swa_window ("swa-window" among its features); an older one
    #: keeps the full cache whatever it is asked, and is planned so.
    window_cache: bool = True


@dataclass(frozen=True)
class Link:
    rtt_ms: float
    mbit_s: float


@dataclass
class Stage:
    """One node's part of a plan (a whole replica, the head of a split, or a stage)."""

    node: str
    role: str  # "replica", "head" or "stage"
    layer_start: int  # first layer held (inclusive)
    layer_end: int  # last layer held + 1
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    overhead_bytes: int
    n_gpu_layers: int = 0  # of this node's layers, how many its accelerators hold

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.overhead_bytes

    @property
    def layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass
class Plan:
    kind: str  # "replicas", "split" or "refused"
    split_mode: str = "none"  # "none", "layer" or "tensor"
    stages: list[Stage] = field(default_factory=list)
    #: The head's LoadModel: layers offloaded to the rpc devices (the output counts as
    #: one, as in llama.cpp) and each device's share.
    n_gpu_layers: int = 0
    tensor_split: list[float] = field(default_factory=list)
    needed_bytes: int = 0  # in all, on the nodes chosen (one copy for replicas)
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str = ""
    #: Why fewer replicas than asked for were placed now (also among the warnings).
    short: str = ""
    #: Further copies of a split (each its own head and stages, on nodes no other copy uses).
    copies: list[Plan] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        for s, stage in zip(d["stages"], self.stages, strict=True):
            s["total_bytes"] = stage.total_bytes
        d["copies"] = [c.as_dict() for c in self.copies]
        return d

    def each_copy(self) -> list[Plan]:
        return [self, *self.copies]


# ---- memory: what llama.cpp allocates --------------------------------------------------


def kv_cells(context_length: int) -> int:
    """KV cells per layer and sequence (each slot has its own padded stream)."""
    return -(-context_length // KV_PAD) * KV_PAD


def kv_bytes(m: ModelFacts, r: Request, layers: float) -> int:
    """The full cache of `layers` layers: every slot's whole context."""
    return int(layers * kv_cells(r.context_length) * r.parallel * _per_cell(m))


def _per_cell(m: ModelFacts) -> int:
    return 2 * m.n_kv_heads * m.head_dim * 2  # K and V, f16


def window_cells(m: ModelFacts, r: Request) -> int:
    """Cells per slot of a sliding layer in the window cache (llama_kv_cache_iswa: the
    window plus one ubatch, padded to 256, never more than the context)."""
    return min(kv_cells(r.context_length), -(-(m.sliding_window + N_UBATCH) // 256) * 256)


def windowed(m: ModelFacts, r: Request) -> bool:
    """Whether the model's sliding layers keep only the window's cells."""
    return bool(r.swa_window and m.sliding_window and m.sliding_layers)


def layers_kv_bytes(m: ModelFacts, r: Request, start: int, end: int) -> int:
    """The KV of layers [start, end): with the window cache a sliding layer holds the
    window only (llama.cpp puts each layer's cells on the device holding the layer)."""
    sliding = m.sliding_pattern[start:end].count("1") if windowed(m, r) else 0
    window = sliding * window_cells(m, r) * r.parallel * _per_cell(m)
    return kv_bytes(m, r, end - start - sliding) + window


def replica_kv_bytes(m: ModelFacts, r: Request) -> int:
    """A whole replica's KV."""
    return layers_kv_bytes(m, r, 0, m.n_layers)


def tensor_kv_bytes(m: ModelFacts, r: Request, share: float) -> int:
    """A tensor split's device: its share of each cache (a sliding-window model has one for
    its full layers and one for its sliding ones), in whole layers rounded up. llama.cpp
    hands out whole layers of a model whose KV heads do not divide among the devices
    (gemma-3-270m has one head: 2 of its 3 full layers and 8 of its 15 sliding ones on one
    of two devices); where they divide, this is at most a layer a cache over."""
    if share <= 0:
        return 0
    slot, full = r.parallel * _per_cell(m), kv_cells(r.context_length)
    caches = [(m.n_layers - m.sliding_layers, full * slot)]
    if m.sliding_layers:
        cells = window_cells(m, r) if windowed(m, r) else full
        caches.append((m.sliding_layers, cells * slot))
    return sum(math.ceil(n * share - 1e-9) * size for n, size in caches)


def compute_bytes(
    m: ModelFacts, r: Request, *, layers: bool, logits: bool, embed: bool, window: bool = False
) -> int:
    """A device's compute buffer: the largest set of intermediates live at once while one
    ubatch of N_UBATCH tokens goes through its part of the graph (flash attention off).

    Floats per token: attention scores over the context for every head plus the masks
    (sliding-window models have two), with the projections; or the feed-forward
    activations; or, where the output is, the logits of every token. Under the window
    cache the sliding layers' mask spans the window's cells, and a device whose layers all
    slide (`window`) attends over those cells only.
    """
    cells = kv_cells(r.context_length)
    masks = 2 if m.sliding_window else 1
    if windowed(m, r):
        slide = window_cells(m, r)
        cells, mask_cells = (slide, 2 * slide) if window else (cells, cells + slide)
    else:
        mask_cells = masks * cells
    floats = 0
    if layers:
        attention = cells * m.n_heads + mask_cells + 2 * m.n_heads * m.head_dim + m.n_ff
        floats = max(attention, 4 * m.n_ff + 2 * m.n_embd)
    if logits:
        floats = max(floats, m.n_vocab + 2 * m.n_embd)
    if embed:
        floats = floats + m.n_embd if layers or logits else cells * masks // 2 + 2 * m.n_embd
    return 4 * N_UBATCH * floats


def logits_buffer_bytes(m: ModelFacts, r: Request) -> int:
    """The host-side output buffer: one row of logits per slot."""
    return 4 * m.n_vocab * r.parallel


def replica_stage(m: ModelFacts, r: Request) -> Stage:
    """A whole copy on one node (the file is mapped whole)."""
    return Stage(
        node="",
        role="replica",
        layer_start=0,
        layer_end=m.n_layers,
        weights_bytes=m.file_bytes,
        kv_bytes=replica_kv_bytes(m, r),
        compute_bytes=compute_bytes(m, r, layers=True, logits=True, embed=False)
        + logits_buffer_bytes(m, r),
        overhead_bytes=ENGINE_OVERHEAD_BYTES,
    )


def split_stage(
    m: ModelFacts,
    r: Request,
    role: str,
    start: int,
    end: int,
    *,
    output: bool,
    share: float | None = None,
) -> Stage:
    """A head or stage of a split. Layer mode: layers [start, end); the last stage also
    holds the output. Tensor mode (share given): that share of every layer plus a copy of
    the output, on each stage; the head then holds the embeddings only."""
    head = role == "head"
    if share is not None:
        weights, kv, layers = (
            int(m.layer_bytes * share) + m.bytes_output,
            tensor_kv_bytes(m, r, share),
            True,
        )
    else:
        weights = sum(m.bytes_per_layer[start:end]) + (m.bytes_output if output else 0)
        kv, layers = layers_kv_bytes(m, r, start, end), end > start
    if head:
        weights += m.bytes_embeddings
    # A run of layers that all slide attends over the window's cells only.
    window = (
        share is None
        and layers
        and windowed(m, r)
        and m.sliding_pattern[start:end].count("1") == end - start
    )
    compute = compute_bytes(m, r, layers=layers, logits=output, embed=head, window=window)
    if head:
        compute += logits_buffer_bytes(m, r)
    return Stage(
        node="",
        role=role,
        layer_start=start,
        layer_end=end,
        weights_bytes=weights,
        kv_bytes=kv,
        compute_bytes=compute,
        overhead_bytes=ENGINE_OVERHEAD_BYTES if head else RPC_OVERHEAD_BYTES,
    )


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


# ---- planning --------------------------------------------------------------------------


def plan(
    m: ModelFacts,
    r: Request,
    nodes: list[NodeState],
    links: dict[tuple[str, str], Link] | None = None,
) -> Plan:
    """Decide where `m` runs. A cluster that cannot hold it gets a refusal, not an error."""
    links = links or {}
    if r.split_mode not in SPLIT_MODES:
        return Plan("refused", error=f"split_mode must be one of: {', '.join(SPLIT_MODES)}")
    if not 1 <= r.replicas <= MAX_REPLICAS:
        return Plan("refused", error=f"replicas must be between 1 and {MAX_REPLICAS}")
    usable = [n for n in nodes if n.ready and not n.draining]
    if r.pin_nodes:
        by_name = {n.name: n for n in nodes}
        unknown = [p for p in r.pin_nodes if p not in by_name]
        if unknown:
            return Plan("refused", error=f"unknown node(s): {', '.join(unknown)}")
        down = [p for p in r.pin_nodes if not by_name[p].ready or by_name[p].draining]
        if down:
            return Plan("refused", error=f"pinned node(s) not ready or draining: {', '.join(down)}")
        usable = [by_name[p] for p in dict.fromkeys(r.pin_nodes)]
    if not usable:
        return Plan("refused", error="no node is ready and open (none registered, or all draining)")
    whole = replica_stage(m, r).total_bytes
    need = {n.name: replica_stage(m, on_node(r, n)).total_bytes for n in usable}
    fits = [n for n in usable if room_of(n) >= need[n.name]]
    # A split is what the user forced, or what pinning several nodes of a split asks for.
    wants_split = r.split_mode in ("layer", "tensor") and (len(usable) > 1 or not fits)
    if r.split_mode in ("auto", "none") or not wants_split:
        if fits:
            return _replicas(m, r, fits, whole, need)
        if r.split_mode == "none" or len(usable) == 1:
            best = max(usable, key=room_of)
            one = need[best.name]
            return Plan(
                "refused",
                needed_bytes=one,
                error=f"needs {gib(one)} on one node; the node with the most free memory "
                f"({best.name}) has {gib(max(room_of(best), 0))}",
            )
    return _split(m, r, usable, links, "tensor" if r.split_mode == "tensor" else "layer", whole)


def on_node(r: Request, n: NodeState) -> Request:
    """The request as node `n` will carry it out: full cache where its agent has no window."""
    return r if n.window_cache or not r.swa_window else replace(r, swa_window=False)


def room_of(n: NodeState) -> int:
    """Memory a node has for new work: free host memory plus its accelerators'."""
    return n.free_bytes + sum(n.accelerator_bytes)


def _replicas(
    m: ModelFacts, r: Request, fits: list[NodeState], whole: int, need: dict[str, int]
) -> Plan:
    """Spread replicas over the nodes that hold a whole copy (`need`: bytes one takes on
    each node, `whole` as planned)."""
    free = {n.name: room_of(n) for n in fits}
    held = {n.name: n.holds for n in fits}
    stages: list[Stage] = []
    for _ in range(r.replicas):
        # Spread: the node holding fewest copies of this deployment, then the most free.
        room = [n for n in fits if free[n.name] >= need[n.name]]
        if not room:
            break
        node = min(room, key=lambda n: (held[n.name], -free[n.name]))
        free[node.name] -= need[node.name]
        held[node.name] += 1
        s = replica_stage(m, on_node(r, node))
        s.node = node.name
        s.n_gpu_layers = _gpu_layers(m, on_node(r, node), node, 0, m.n_layers)
        stages.append(s)
    p = Plan("replicas", stages=stages, needed_bytes=whole)
    old = sorted({s.node for s in stages if s.total_bytes > whole})
    if old:
        p.warnings.append(
            f'the agent on {", ".join(old)} predates the window cache (no "swa-window" '
            f"feature): its replicas keep the full cache, "
            f"{gib(replica_stage(m, replace(r, swa_window=False)).total_bytes - whole)} more "
            f"each; upgrade it to plan and load them smaller"
        )
    s0 = replica_stage(m, r)  # as planned; an older agent's larger copy is in the warnings
    window = (
        f" with {m.sliding_layers} of {m.n_layers} layers keeping only their "
        f"{m.sliding_window}-token window"
        if s0.kv_bytes < kv_bytes(m, r, m.n_layers)
        else ""
    )
    p.reasons.append(
        f"{m.name} needs {gib(whole)} per replica (weights {gib(s0.weights_bytes)}, KV "
        f"{gib(s0.kv_bytes)}{window}, compute {gib(s0.compute_bytes)}, process "
        f"{gib(s0.overhead_bytes)}); {len(fits)} node(s) hold a whole copy, so no split "
        f"(a split buys capacity, not speed)"
    )
    if len(stages) < r.replicas:
        best = max(fits, key=lambda n: free[n.name])
        p.short = (
            f"only {len(stages)} of {r.replicas} replica(s) fit now: each needs {gib(whole)}, "
            f"the node with the most room left ({best.name}) has {gib(max(free[best.name], 0))}"
        )
        p.warnings.append(p.short)
    _note_accelerators(p)
    return p


def _gpu_layers(m: ModelFacts, r: Request, node: NodeState, start: int, end: int) -> int:
    """How many of the node's layers (weights and their KV) its accelerators hold."""
    room = sum(node.accelerator_bytes)
    n = 0
    for i in range(start, end):
        need = m.bytes_per_layer[i] + layers_kv_bytes(m, r, i, i + 1)
        if room < need:
            break
        room -= need
        n += 1
    return n


def _note_accelerators(p: Plan) -> None:
    if any(s.n_gpu_layers for s in p.stages):
        p.reasons.append(
            "on nodes with accelerators the layers that fit in their memory go there "
            "(n_gpu_layers per node), the rest stay in host memory"
        )


def _split(m, r, usable, links, mode, whole) -> Plan:
    """The fewest nodes that hold the model, and each one's part; with several replicas,
    copy after copy, each on nodes the others do not use (a node's loss takes one copy)."""
    if r.replicas > 1:
        if r.pin_nodes and len(usable) % r.replicas:
            return Plan(
                "refused",
                split_mode=mode,
                needed_bytes=whole,
                error=f"{len(usable)} pinned nodes do not divide into {r.replicas} copies "
                "(pinned nodes go in order, the same number to each copy, head first)",
            )
        size = len(usable) // r.replicas
        one, left, copies = replace(r, replicas=1), list(usable), []
        for i in range(r.replicas):
            if r.pin_nodes:  # the next group of pinned nodes, in the order given
                group = usable[i * size : (i + 1) * size]
                one, left = replace(r, replicas=1, pin_nodes=tuple(n.name for n in group)), group
            p = _split(m, one, left, links, mode, whole)
            if p.kind == "refused":
                p.error = (
                    f"copy {i + 1} of {r.replicas}: {p.error} "
                    f"(copies of a split run on nodes that do not overlap)"
                )
                return p
            used = {s.node for s in p.stages}
            left = [n for n in left if n.name not in used]
            copies.append(p)
        first = copies[0]
        first.copies = copies[1:]
        first.reasons.append(f"{r.replicas} copies, on nodes that do not overlap")
        return first
    # Tensor parallel slices layers over the stages: it takes two of them besides the head.
    least = 3 if mode == "tensor" else 2
    if len(usable) < least:
        return Plan(
            "refused",
            split_mode=mode,
            needed_bytes=whole,
            error=f"a {mode} split needs at least {least} ready nodes (a head and "
            f"{least - 1} stage{'s' if least > 2 else ''}); {len(usable)} available",
        )
    if r.pin_nodes:
        sizes, candidates = [len(usable)], usable
    else:
        candidates = sorted(usable, key=lambda n: -room_of(n))[: max(r.max_nodes, least)]
        sizes = range(least, len(candidates) + 1)
    for k in sizes:
        for chosen in [candidates] if r.pin_nodes else _sets(candidates, k, links):
            head, rest = chosen[0], chosen[1:]
            # The head's engine keeps the cache (its agent may predate the window); the last
            # stage computes the logits and holds the output: the most room (pinned nodes
            # keep the order they were given).
            rh = on_node(r, head)
            stages = _assign(
                m, rh, [head, *(rest if r.pin_nodes else sorted(rest, key=room_of))], mode
            )
            if stages is not None:
                return _split_plan(m, rh, stages, links, mode, whole)
    chosen = candidates
    have = sum(max(room_of(n), 0) for n in chosen)
    need = _split_total(m, r, len(chosen), mode) if len(chosen) > 1 else whole
    return Plan(
        "refused",
        split_mode=mode,
        needed_bytes=need,
        error=f"needs {gib(need)} split over {len(chosen)} node(s) ({gib(whole)} on one); "
        f"the largest feasible set of healthy nodes has {gib(have)}",
    )


def _sets(candidates: list[NodeState], k: int, links) -> list[list[NodeState]]:
    """Sets of k nodes to try, head first: with measured links, a head and the k-1 nodes
    best linked to it (no slow link), among the roomiest; then the k roomiest nodes,
    headed by the one whose slowest link is fastest."""
    out = []
    if links:
        top = candidates[:64]
        for h in top:
            others = sorted(
                (n for n in top if n is not h), key=lambda n: (_slowness(links, h, n), -room_of(n))
            )
            others = others[: k - 1]
            if len(others) == k - 1 and all(_slowness(links, h, o) < 2 for o in others):
                out.append([h, *others])
    roomiest = candidates[:k]

    def worst(n: NodeState) -> float:
        found = (_link(links, n.name, o.name) for o in roomiest if o is not n)
        return max((lk.rtt_ms for lk in found if lk), default=0.0)

    head = min(roomiest, key=lambda n: (worst(n), -room_of(n)))
    out.append([head, *(n for n in roomiest if n is not head)])
    return out


def _slowness(links, a: NodeState, b: NodeState) -> int:
    """0: a fast measured link, 1: not measured, 2: slow."""
    lk = _link(links, a.name, b.name)
    if lk is None:
        return 1
    return 2 if is_slow(lk) else 0


def is_slow(lk: Link) -> bool:
    """A link a split should avoid (warned about, drawn marked in the console)."""
    return lk.rtt_ms > SLOW_RTT_MS or lk.mbit_s < THIN_MBIT


def _link(links, a: str, b: str) -> Link | None:
    return links.get((a, b)) or links.get((b, a))


def _fixed(m: ModelFacts, r: Request, k: int, mode: str) -> list[int]:
    """What each position (head, stages..., last stage) costs before its share of layers."""
    out = []
    for i in range(k):
        role, last = ("head" if i == 0 else "stage"), i == k - 1
        if mode == "tensor":
            s = (
                split_stage(m, r, role, 0, 0, output=False)
                if i == 0
                else split_stage(m, r, role, 0, 0, output=True, share=0.0)
            )
        else:
            s = split_stage(m, r, role, 0, 1, output=last and i > 0)
            s.weights_bytes -= m.bytes_per_layer[0]
            s.kv_bytes = 0
        out.append(s.total_bytes)
    return out


def _split_total(m: ModelFacts, r: Request, k: int, mode: str) -> int:
    return sum(_fixed(m, r, k, mode)) + m.layer_bytes + replica_kv_bytes(m, r)


def _assign(m, r, ordered: list[NodeState], mode: str) -> list[Stage] | None:
    """Each node's part, in proportion to its room after fixed costs; None if it does not
    fit. Layer mode: contiguous ranges, head first (it may hold none), every stage >= 1."""
    k = len(ordered)
    room = [room_of(n) - f for n, f in zip(ordered, _fixed(m, r, k, mode), strict=True)]
    if min(room[1:]) <= 0 or room[0] < 0:
        return None
    per_layer = [b + layers_kv_bytes(m, r, i, i + 1) for i, b in enumerate(m.bytes_per_layer)]
    if sum(room) < sum(per_layer):
        return None
    if mode == "tensor":
        total = sum(room[1:])
        stages = [split_stage(m, r, "head", 0, 0, output=False)]
        for x in room[1:]:
            stages.append(split_stage(m, r, "stage", 0, m.n_layers, output=True, share=x / total))
        if sum(per_layer) > total:
            return None
    else:
        counts = _layer_counts(per_layer, room)
        if counts is None:
            return None
        stages, start = [], 0
        for i, c in enumerate(counts):
            role = "head" if i == 0 else "stage"
            stages.append(split_stage(m, r, role, start, start + c, output=i == k - 1))
            start += c
    for s, n in zip(stages, ordered, strict=True):
        s.node = n.name
        if mode == "layer":
            s.n_gpu_layers = _gpu_layers(m, r, n, s.layer_start, s.layer_end)
        if s.total_bytes > room_of(n):
            return None
    return stages


def _layer_counts(cost: list[int], room: list[int]) -> list[int] | None:
    """Contiguous layer counts filling each node in proportion to its room."""
    n, k = len(cost), len(room)
    if n < k - 1:
        return None
    target = [x / sum(room) * sum(cost) for x in room]
    counts, i = [], 0
    for j in range(k):
        used, c = 0, 0
        must_leave = k - 1 - j  # later stages need a layer each
        while i < n - must_leave:
            over_target = j < k - 1 and used + cost[i] / 2 > target[j]
            if over_target and (j == 0 or c > 0):
                break
            if used + cost[i] > room[j]:
                break
            used, c, i = used + cost[i], c + 1, i + 1
        if j > 0 and c == 0:
            return None
        counts.append(c)
    return counts if i == n else None


def _split_plan(m, r, stages: list[Stage], links, mode: str, whole: int) -> Plan:
    p = Plan("split", split_mode=mode, stages=stages)
    p.needed_bytes = sum(s.total_bytes for s in stages)
    head, rest = stages[0], stages[1:]
    if mode == "layer":
        # llama.cpp offloads the last n_gpu_layers "layers", the output counting as one,
        # and gives each device a run of them in proportion to tensor_split.
        p.n_gpu_layers = m.n_layers + 1 - head.layers
        p.tensor_split = [float(s.layers) for s in rest]
        p.tensor_split[-1] += 1
    else:
        p.n_gpu_layers = -1
        # Each stage's share of every layer (its KV is rounded up to whole layers).
        shares = [s.weights_bytes - m.bytes_output for s in rest]
        p.tensor_split = [round(x / (sum(shares) or 1), 4) for x in shares]
    if r.split_mode in ("layer", "tensor") or r.pin_nodes:
        asked = f"split_mode {r.split_mode}" if r.split_mode != "auto" else "pinned nodes"
        p.reasons.append(
            f"a split over {len(stages)} nodes, as asked ({asked}); {m.name} needs "
            f"{gib(whole)} on one node, {gib(p.needed_bytes)} split"
        )
    else:
        p.reasons.append(
            f"{m.name} needs {gib(whole)} on one node and no ready node has that much free: "
            f"split over {len(stages)} nodes, the fewest that hold it ({gib(p.needed_bytes)} "
            f"in all)"
        )
    if windowed(m, r) and m.sliding_window < kv_cells(r.context_length):
        p.reasons.append(
            f"KV {gib(sum(s.kv_bytes for s in stages))} in all, {m.sliding_layers} of "
            f"{m.n_layers} layers keeping only their {m.sliding_window}-token window"
        )
    held = f" and layers {head.layer_start}-{head.layer_end - 1}" if head.layers else ""
    p.reasons.append(
        f"head {head.node} runs the engine and holds the token embeddings{held} "
        f"({gib(head.total_bytes)})"
    )
    for s in rest:
        if mode == "layer":
            what = f"layers {s.layer_start}-{s.layer_end - 1}"
            what += " and the output" if s is rest[-1] else ""
        else:
            what = f"{p.tensor_split[rest.index(s)]:.0%} of every layer and a copy of the output"
        p.reasons.append(f"stage {s.node} serves {what} over RPC ({gib(s.total_bytes)})")
    if mode == "tensor":
        p.reasons.append("tensor parallel: flash attention is on (llama.cpp needs it)")
        p.warnings.append(
            "tensor parallel over RPC synchronises every layer through the head: measured "
            "here at 0.08x of one node's tokens/s on a plain link and 0.01x with 1 ms more "
            "round trip (bench/split.py); a layer split keeps 0.6-0.8x"
        )
    for s in rest:
        lk = _link(links, head.node, s.node)
        if lk is None:
            p.warnings.append(f"link {head.node} <-> {s.node} not measured yet")
        elif is_slow(lk):
            p.warnings.append(
                f"slow link {head.node} <-> {s.node}: {lk.rtt_ms:.2f} ms round trip, "
                f"{lk.mbit_s:.0f} Mbit/s, and every token crosses it"
            )
    _note_accelerators(p)
    return p
