"""Continuous batching on llama.cpp's batch API, with a prompt cache per slot.

One llama context holds `parallel` sequences (slots). New requests join between steps;
finished or cancelled ones leave without stalling the rest. Each slot has a KV stream of its
own (as llama-server has them: attention then reads only the sequence's own cells; one cache
shared by all slots was slower at 8 streams here). Two modes:

- throughput (the default, what llama-server does): each step is one llama_decode carrying
  the next token of every decoding sequence plus prompt chunks of new ones, up to N_BATCH
  tokens. A slot keeps its sequence's KV after the request ends; a new request reuses the
  longest token prefix a free slot holds and evaluates only the rest (llama-server's
  cache_prompt). A slot's prefix that a new request would throw away is first copied to a
  bounded host-RAM cache (HostCache, llama-server's --cache-ram) and restored into a slot
  when a later prompt shares more with it than with any slot.
- invariant: prompt chunks decoded apart from decode tokens, flash attention off and no
  prompt cache, so each sequence's numbers are those of a solo run and greedy text does not
  depend on load. It costs throughput (see the README's measurements).

This module runs inside the engine child process only: a crash in llama.cpp must never
reach the agent.
"""

from __future__ import annotations

import codecs
import ctypes
import dataclasses
import enum
import itertools
import math
import random
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import llama_cpp as L

from workers.engine import errors
from workers.engine.errors import EngineError
from workers.engine.events import Done, Error, Token
from workers.engine.process import FLASH_ATTN_MODES, PROMPT_CACHE_MIB

#: Same default as llama-cpp-python's Llama(n_batch=512): prompts decode in chunks of this.
N_BATCH = 512
#: Prompt tokens one step takes beside running streams (see _step_throughput): a running
#: stream waits at most one such chunk for a new prompt. On 2 cores, 64 against 128
#: gave 8 streams a median first token of 0.82x against 1.04x llama-server's, at the same
#: throughput (README, "Numbers measured here").
PROMPT_BUDGET = 64
#: Decode rows per llama_decode in the invariant mode. The CPU backend multiplies some
#: weight types with kernels that depend on how many rows a micro-batch has, and their sums
#: differ in the last bits, which can change a greedy choice: on gemma-3-270m (Q4_K, Q5_0,
#: Q6_K, Q8_0 weights) 1 to 7 rows gave the same logits as one row alone and 8 or more did
#: not (2 of 16 stories run 8 at a time then differed from the same stories run alone).
INVARIANT_ROWS = 4
#: llama-cpp-python's default window for the repeat penalty.
PENALTY_LAST_N = 64
HOST_CACHE_BYTES = PROMPT_CACHE_MIB << 20  # the agent's --prompt-cache-mib sets it
#: Fewest tokens a prefix must have to be worth a copy in host RAM.
HOST_CACHE_MIN_TOKENS = 32
#: Largest copy made ahead of need (save_ahead): a request arriving during one waits for
#: it, and 64 MiB took about 40 ms here. A larger sequence is copied when a request takes
#: its slot, as before.
SAVE_AHEAD_BYTES = 64 << 20
#: Window checkpoints a slot (or a host-RAM entry) keeps (_WindowCheckpoint), the oldest
#: dropped first: two a prompt, where its new tokens started and where it ended, so 32 (as
#: llama-server's --ctx-checkpoints) reach an edit 16 messages back. Each holds the
#: sliding-window layers' cells of one sequence (gemma-3-270m: up to 16 MiB) and counts
#: against the host-RAM cache's limit.
SLOT_CHECKPOINTS = 32
#: Of a slot's or an entry's checkpoints, the newest that may take room from host-RAM
#: entries (the last two prompts': a regenerate, an edit of the last message). The older
#: ones serve an edit further back, which is rarer than a conversation's next turn: they
#: only fill room nothing else asks for, and go first, oldest first, when room runs out.
FIRM_CHECKPOINTS = 4
#: The part of a sequence's state a window checkpoint copies: the sliding-window layers'.
STATE_PARTIAL = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
#: Flash attention settings (the agent's --flash-attn), as llama-server's -fa takes them.
FLASH_ATTN_AUTO, FLASH_ATTN_ON, FLASH_ATTN_OFF = FLASH_ATTN_MODES


@dataclass
class Sampling:
    """Sampling settings of one request (temperature 0 means greedy)."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: str = ""  # GBNF the output must match (structured outputs); "" for none

    @property
    def argmax(self) -> bool:
        """Greedy with nothing that reads history: the likeliest token, taken straight from
        the logits (see BatchEngine._greedy)."""
        return self.temperature <= 0.0 and not self.penalized and not self.grammar

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the tokens generated so far."""
        return (
            self.repeat_penalty not in (0.0, 1.0)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass
class Request:
    """A generation as the engine receives it."""

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    stop: list[str] = field(default_factory=list)
    received_at: float = field(default_factory=time.monotonic)
    #: Tokens another replica already generated (migration); decoded after the prompt.
    resume_tokens: list[int] = field(default_factory=list)
    #: UTF-8 bytes of the resumed tokens' text that the client already has.
    delivered_bytes: int = 0
    #: Reuse a slot's cached prefix of the prompt (throughput mode only).
    cache_prompt: bool = True
    #: -1: no log-probabilities; k >= 0: each sampled token's, with the k likeliest.
    logprobs: int = -1
    #: Choices to sample from one prompt: the prompt is evaluated once, in the first choice's
    #: slot, and its KV copied to the others' (their events carry "<request_id>#<k>").
    n: int = 1


@dataclass
class _WindowCheckpoint:
    """A slot's sliding-window cells when its sequence held its first `n` tokens (the first
    `size` bytes of `data`): restored over the slot's own, with the cells of the other
    layers cut back to n, the slot holds those n tokens again (llama-server's context
    checkpoints)."""

    n: int
    data: ctypes.Array
    size: int
    #: The lowest position those cells hold: the checkpoint serves any prefix up to n whose
    #: window starts there or later.
    low: int = 0
    #: When it was made, in a count of checkpoints: the oldest go first (HostCache._droppable).
    made: int = field(default_factory=itertools.count().__next__)

    def reach(self, n: int, n_swa: int) -> int:
        """How many of a prompt's first n tokens (those its sequence holds in the other
        layers) this checkpoint gives back: up to its own n, if its cells hold the window
        before that point; 0 otherwise."""
        r = min(self.n, n)
        return r if self.low <= window_start(r, n_swa) else 0


def window_start(n: int, n_swa: int) -> int:
    """The lowest position the sliding-window layers read to decode position n: a token sees
    the n_swa - 1 positions before it (llama.cpp's standard window mask, is_masked_swa:
    p1 - p0 >= n_swa is masked)."""
    return max(0, n - n_swa + 1)


@dataclass
class _Slot:
    """One of the context's sequence ids, and the tokens its KV cache holds between requests."""

    seq_id: int
    cached: list[int] = field(default_factory=list)
    last_used: float = 0.0
    busy: bool = False
    saved: bool = False  # save_ahead has taken `cached` in hand (copied, or not worth it)
    readied: bool = False  # save_ahead has made spares for its next checkpoints, if any
    prompt_len: int = 0  # of `cached`, the last request's prompt; the rest its answer
    checkpoints: list[_WindowCheckpoint] = field(default_factory=list)  # oldest first
    #: Buffers for its next window checkpoints, made while idle (BatchEngine._spare_buffers)
    #: and counted by the host cache already.
    spares: list[ctypes.Array] = field(default_factory=list)


@dataclass
class _Saved:
    """A sequence's KV state as llama.cpp serializes it (the first `size` bytes of `data`),
    and the tokens it holds."""

    tokens: list[int]
    data: ctypes.Array
    size: int
    #: A checkpoint of a prefix that prompts share (BatchEngine._shared_prefix): restoring
    #: it leaves it in the cache for the next prompt.
    kept: bool = False
    #: The window checkpoints its slot had made of it (oldest first): under the window
    #: cache the entry keeps only its last window, and these give back the prefixes a
    #: regenerated answer or an edited message go back to (llama-server's cache-ram
    #: entries carry their checkpoints too).
    checkpoints: list[_WindowCheckpoint] = field(default_factory=list)

    @property
    def held(self) -> int:
        """Bytes it holds, with its checkpoints."""
        return len(self.data) + sum(len(c.data) for c in self.checkpoints)


class Room(enum.Enum):
    """What may go to make room in the host cache for a new holding (HostCache.reserve):
    each level also lets go what the one before it does."""

    FREE = 0  # nothing: only room nothing holds (a buffer readied while idle)
    ENTRIES = 1  # spares and whole entries (a copy made ahead of need, of data a slot holds)
    ALL = 2  # window checkpoints too, the older first (what is needed now)


class HostCache:
    """Prompt prefixes pushed out of slots, in host RAM: the same idea as llama-server's
    --cache-ram. Entries are whole sequences (llama_state_seq_get_data), oldest dropped first
    when over the limit (a checkpoint that serves a prompt counts as new again); one that a
    newer entry contains is dropped as redundant, except a checkpoint (in a sliding-window
    model a longer entry keeps only its last window, so it cannot serve the checkpoint's
    prompts); an entry restored into a slot leaves the cache (the slot has it now), a
    checkpoint stays. What makes room, and in which order, is _droppable's one list.

    The buffer of the entry restored last is kept as a spare for the next save: a fresh
    buffer costs more than the copy itself (the kernel zeroes its pages, ctypes zeroes them
    again), and a save usually comes right before a restore. `bytes` counts the spare too,
    and the slots' window checkpoints and spare buffers (reserve).
    """

    def __init__(self, limit_bytes: int):
        self.limit = max(0, int(limit_bytes))
        self.entries: list[_Saved] = []  # oldest first
        self.bytes = 0
        self.spare: ctypes.Array | None = None
        #: The engine's slots, whose window checkpoints and spares reserve counts: some
        #: of them make room (_droppable).
        self.slots: list[_Slot] = []

    def holds(self, tokens: list[int]) -> bool:
        """True when an entry already has all of `tokens`."""
        return any(common_prefix(e.tokens, tokens) == len(tokens) for e in self.entries)

    def buffer(self, size: int) -> ctypes.Array:
        """A buffer for a state of `size` bytes: the spare when it fits without wasting
        more than half of itself, else a new one (the spare is let go either way)."""
        spare, self.spare = self.spare, None
        if spare is not None:
            self.bytes -= len(spare)
            if fits(spare, size):
                return spare
        return (ctypes.c_uint8 * size)()

    def add(
        self,
        tokens: list[int],
        data: ctypes.Array,
        size: int | None = None,
        kept: bool = False,
        room: Room = Room.ALL,
    ) -> None:
        """Keep the first `size` bytes of `data` (all of it by default) for `tokens`; `kept`
        for a checkpoint. `room` says what may go for it: a copy made ahead of need (of a
        slot that still holds it) lets no window checkpoint go, since those are the only
        copy of what they hold."""
        held = len(data)
        if not self._fits(held, room):
            return  # window checkpoints hold the rest (reserve)
        carried: list[_WindowCheckpoint] = []
        for e in [
            e
            for e in self.entries
            if common_prefix(e.tokens, tokens) == len(e.tokens)
            and not (e.kept and len(e.tokens) < len(tokens))
        ]:
            carried += e.checkpoints  # prefixes of the new one too: they go with it
            e.checkpoints = []
            self._drop(e)  # contained in the new one
        self._make_room(held, room)
        self.entries.append(_Saved(list(tokens), data, held if size is None else size, kept))
        self.bytes += held
        if not self.attach(tokens, carried):  # a checkpoint of a shared prefix takes none
            self.bytes -= sum(len(c.data) for c in carried)

    def attach(self, tokens: list[int], checkpoints: list[_WindowCheckpoint]) -> bool:
        """Hand window checkpoints made of `tokens` (counted already: reserve) to the entry
        that holds those tokens, up to SLOT_CHECKPOINTS of them, the newest kept; False,
        handing nothing, when no entry holds them."""
        entry = next(
            (e for e in reversed(self.entries) if not e.kept and e.tokens[: len(tokens)] == tokens),
            None,
        )
        if entry is None:
            return False
        for c in checkpoints:
            if any(old.n == c.n for old in entry.checkpoints):
                self.bytes -= len(c.data)
            else:
                entry.checkpoints.append(c)
        while len(entry.checkpoints) > SLOT_CHECKPOINTS:
            self.bytes -= len(entry.checkpoints.pop(0).data)
        return True

    def reserve(self, size: int, room: Room = Room.ALL) -> bool:
        """Count `size` bytes held beside the entries (a slot's window checkpoint or spare
        buffer), letting go what `room` allows to make room; False, letting nothing go,
        when that would not make enough."""
        if not self._fits(size, room):
            return False
        self._make_room(size, room)
        self.bytes += size
        return True

    def release(self, size: int) -> None:
        """Stop counting bytes that reserve counted."""
        self.bytes -= size

    def _droppable(self, room: Room) -> list[tuple[int, Callable[[], None]]]:
        """What `room` lets go, in the order it goes, each with the bytes it frees: the
        cache's spare, the spares of slots but the one used last (kept as its newest
        checkpoints are: its conversation's next turn is the likeliest to come), then under
        Room.ALL the window checkpoints of slots and entries beyond their newest
        FIRM_CHECKPOINTS, oldest first, then the entries' others, then the entries, oldest
        first (with any checkpoints they still have, which serve only over them)."""
        if room is Room.FREE:
            return []
        out: list[tuple[int, Callable[[], None]]] = []
        if self.spare is not None:
            out.append((len(self.spare), self._drop_spare))
        last = self._last_used()
        out += [
            (len(b), partial(self._let_go, s.spares, b, len(b)))
            for s in self.slots
            if s is not last
            for b in reversed(s.spares)
        ]
        if room is Room.ALL:
            holders = (*self.slots, *self.entries)
            extras = [(h, c) for h in holders for c in h.checkpoints[:-FIRM_CHECKPOINTS]]
            firm = [(e, c) for e in self.entries for c in e.checkpoints[-FIRM_CHECKPOINTS:]]
            out += [
                (len(c.data), partial(self._let_go, h.checkpoints, c, len(c.data)))
                for h, c in sorted(extras, key=lambda hc: hc[1].made) + firm
            ]
        # Under Room.ALL an entry's checkpoints are listed already, and gone before it goes.
        out += [
            (len(e.data) if room is Room.ALL else e.held, partial(self._drop, e))
            for e in self.entries
        ]
        return out

    def _fits(self, size: int, room: Room) -> bool:
        """Whether `size` more bytes fit once all that `room` lets go is gone."""
        return self.bytes - sum(n for n, _ in self._droppable(room)) + size <= self.limit

    def _make_room(self, size: int, room: Room) -> None:
        """Let go what `room` allows, in _droppable's order, until `size` more bytes fit."""
        for _, drop in self._droppable(room):
            if self.bytes + size <= self.limit:
                break
            drop()

    def _let_go(self, holder: list, item: object, n: int) -> None:
        """Let a slot's or an entry's spare buffer or window checkpoint go: `n` bytes."""
        holder.remove(item)
        self.bytes -= n

    def _last_used(self) -> _Slot | None:
        """The slot used last: its spares, readied for its conversation's next turn (the
        likeliest to come), are kept as its newest checkpoints are."""
        return max(self.slots, key=lambda s: s.last_used, default=None)

    def best(
        self, tokens: list[int], than: int, n_swa: int
    ) -> tuple[_Saved | None, int, _WindowCheckpoint | None]:
        """The entry sharing the longest prefix with `tokens`, if longer than `than`, that
        length, and the window checkpoint of the entry to restore over it (None: its own
        cells serve). Like llama-server, an entry must keep a quarter of itself. In a
        sliding-window model only the window's last cells were saved, so an entry serves
        only prompts that reach its end (or stay within its first window), or the prefix
        one of its window checkpoints gives back."""
        best, n_best, via = None, than, None
        for e in self.entries:
            n = common_prefix(e.tokens, tokens)
            if n <= n_best or n * 4 < len(e.tokens):
                continue
            checkpoint = None
            if n_swa > 0 and max(0, len(e.tokens) - n_swa) > max(0, n - n_swa):
                checkpoint = max(e.checkpoints, key=lambda c: c.reach(n, n_swa), default=None)
                n = checkpoint.reach(n, n_swa) if checkpoint is not None else 0
                if n <= n_best:
                    continue
            best, n_best, via = e, n, checkpoint
        return best, n_best, via

    def take(self, entry: _Saved) -> list[_WindowCheckpoint]:
        """Hand an entry to a slot (after its state was read): it leaves the cache, and
        its buffer becomes the spare; a checkpoint stays, as the newest entry. Returns its
        window checkpoints, which go to the slot still counted (release what it drops)."""
        if entry.kept:
            self.entries.remove(entry)
            self.entries.append(entry)
            return []
        checkpoints, entry.checkpoints = entry.checkpoints, []
        self._drop(entry)
        if self.spare is not None:
            self._drop_spare()
        self.spare = entry.data
        self.bytes += len(entry.data)
        return checkpoints

    def _drop(self, entry: _Saved) -> None:
        """Let an entry go, with the window checkpoints it still has (they serve only
        restored over it)."""
        self.entries.remove(entry)
        self.bytes -= entry.held

    def _drop_spare(self) -> None:
        """Let the cache's spare buffer go."""
        self.bytes -= len(self.spare)
        self.spare = None


def fits(buffer: ctypes.Array, size: int) -> bool:
    """Whether a used buffer serves a state of `size` bytes without wasting more than half
    of itself (reusing one spares the zeroing of fresh pages)."""
    return size <= len(buffer) <= 2 * size


def _least_valuable(slot: _Slot) -> tuple[bool, float]:
    """Sort key of free slots, the one whose cache is worth least first: empty, else used
    least recently."""
    return len(slot.cached) > 0, slot.last_used


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (slices compared in C, halving the
    range: the host cache compares every new prompt with each of its entries)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class _Sequence:
    """A request that holds one of the context's sequence slots."""

    req: Request
    seq_id: int
    sampler: ctypes.c_void_p
    limit: int  # most tokens this sequence may generate
    prefill: list[int] = field(default_factory=list)  # prompt, then any resumed tokens
    prefill_pos: int = 0  # prefill tokens already decoded
    n_past: int = 0  # tokens in the KV cache for this sequence
    last_token: int = -1
    generated: int = 0
    batch_index: int = -1  # index in the current batch whose logits to sample
    cached_tokens: int = 0  # prompt tokens whose KV the slot's cache already held
    host_cached_tokens: int = 0  # of those, restored from host RAM (HostCache)
    pending_text: str = ""  # decoded text held back while it may start a stop string
    new_tokens: list[int] = field(default_factory=list)  # sampled, not yet sent with text
    new_logprobs: list[tuple] = field(default_factory=list)  # theirs, when asked (logprob())
    grammar: ctypes.c_void_p | None = None  # structured output's grammar sampler, if any
    follows: _Sequence | None = None  # an extra choice waiting for this one's prompt KV
    checkpoint: int = 0  # prefill position whose state goes to host RAM (_shared_prefix)
    mark_end: bool = False  # checkpoint the window once the prefill is read (_mark_window_ends)
    sampled: list[int] = field(default_factory=list)  # every token sampled here
    emitted: int = 0  # pieces emitted
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    def to_read(self) -> int:
        """Prompt tokens to read before the sequence's next stop: its checkpoint (the
        prompt goes on in the next step), else the prompt's end."""
        end = self.checkpoint if self.checkpoint > self.prefill_pos else len(self.prefill)
        return end - self.prefill_pos


class BatchEngine:
    """A model plus one multi-sequence context, stepped by the engine process loop."""

    def __init__(
        self,
        model_path: str,
        context_length: int,
        parallel: int,
        threads: int,
        max_queue: int = 64,
        flash_attn: str = FLASH_ATTN_AUTO,
        rpc_servers: list[str] | None = None,
        n_gpu_layers: int = -1,
        split_mode: int = L.LLAMA_SPLIT_MODE_LAYER,
        tensor_split: list[float] | None = None,
        batch_invariant: bool = False,
        host_cache_bytes: int = HOST_CACHE_BYTES,
        swa_full: bool = True,
    ):
        """rpc_servers split the model: the last n_gpu_layers layers (-1: all) go to those
        servers, in proportion to tensor_split; the rest stay here. Without rpc_servers,
        n_gpu_layers >= 0 bounds what goes to local accelerators (none on a CPU build).
        flash_attn (one of FLASH_ATTN_MODES) is for whole replicas in the throughput mode:
        splits and the invariant mode have their own. swa_full False keeps only a
        sliding-window model's window in those layers' KV (llama-server's default): far
        less memory at long contexts, but a slot offers a prefix only while it holds the
        window before its end (_window_holds); True (the C API's default) keeps them whole,
        as the invariant mode always does. A split has no host cache, so no window
        checkpoints either: under the window cache its slots reuse a conversation's next
        turn, and read an edit or a regenerated answer past the window whole."""
        if flash_attn not in FLASH_ATTN_MODES:
            raise EngineError(
                errors.INVALID_ARGUMENT,
                f"flash_attn must be one of {', '.join(FLASH_ATTN_MODES)}, not {flash_attn!r}",
            )
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        if rpc_servers:
            from workers.engine import rpc

            self._devices = rpc.devices(rpc_servers)  # kept alive with the model
            mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
            mparams.n_gpu_layers = n_gpu_layers
            mparams.split_mode = split_mode
            # Read the head's own tensors into memory instead of mapping the whole file: the
            # offloaded layers then take no room here, and llama.cpp reports what is held.
            mparams.load_mode = L.LLAMA_LOAD_MODE_NONE
            if tensor_split:
                self._split = (ctypes.c_float * len(tensor_split))(*tensor_split)
                mparams.tensor_split = self._split
            # Tensor parallel over RPC needs flash attention (llama.cpp refuses it otherwise);
            # a layer split keeps it off: its memory estimate (compute buffers of heads and
            # stages) and its measured speed were made so.
            tensor = split_mode == L.LLAMA_SPLIT_MODE_TENSOR
            flash_attn = FLASH_ATTN_ON if tensor else FLASH_ATTN_OFF
        elif n_gpu_layers >= 0:
            mparams.n_gpu_layers = n_gpu_layers
        if batch_invariant:
            # No repacked weights: for them the CPU backend has one kernel for a single row
            # and another for groups of four, whose sums differ in the last bits.
            mparams.use_extra_bufts = False
        self.model = L.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise EngineError(
                errors.BAD_MODEL_FILE,
                f"llama.cpp could not load {model_path} (corrupt or unsupported)",
            )
        self.vocab = L.llama_model_get_vocab(self.model)
        self.context_length = int(context_length)
        self.parallel = int(parallel)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = self.context_length * self.parallel
        cparams.n_batch = N_BATCH
        cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = self.parallel
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.threads = threads
        self.invariant = bool(batch_invariant)
        # One KV stream per slot: a sequence sits at the same cells as it would alone (what
        # the invariant mode needs), and attention reads only its own cells.
        cparams.kv_unified = False
        if self.invariant and not rpc_servers:
            flash_attn = FLASH_ATTN_OFF  # as llama-cpp-python's Llama has it: its numerics
        # For whole replicas llama.cpp's auto turns it on where the backend supports it
        # (llama-server's default). On this CPU it pays for short histories and costs for
        # long ones (8 streams of one token: 54 ms a step on, 66 off with nothing cached;
        # 95 against 79 with 500 tokens each; see the README's Numbers).
        cparams.flash_attn_type = {
            FLASH_ATTN_AUTO: L.LLAMA_FLASH_ATTN_TYPE_AUTO,
            FLASH_ATTN_ON: L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            FLASH_ATTN_OFF: L.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash_attn]
        self.flash_attn = flash_attn
        # The invariant mode keeps the full cache: its numerics (which cells a token takes)
        # were made with it. A split's stages hold their layers' cells, window or full.
        cparams.swa_full = bool(swa_full) or self.invariant
        self.swa_full = cparams.swa_full
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise EngineError(errors.ENGINE_FAILED, "llama.cpp could not create a context")
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(N_BATCH, 0, 1)
        self.max_queue = max_queue
        self.slots = [_Slot(i) for i in range(self.parallel)]
        # Not for splits: a saved state would be read from the stages' KV over the network.
        self.host = HostCache(0 if self.invariant or rpc_servers else host_cache_bytes)
        self.host.slots = self.slots
        self.n_swa = L.llama_model_n_swa(self.model)
        # Slots keep window checkpoints (_checkpoint_window) under the window cache only.
        self.window_checkpoints = self.n_swa > 0 and not self.swa_full and self.host.limit > 0
        self.waiting: deque[Request] = deque()
        self.active: dict[str, _Sequence] = {}
        #: Short prompts beside running streams get a step of their own (_step_throughput);
        #: off only to measure what that is worth (bench/engine_turns.py --prompt-first).
        self.prompt_first = True
        self._prompt_alone = False  # the last step was such a step
        #: Slots a copy between KV streams reads from or writes to: llama.cpp copies the
        #: data at the next decode, so until then a slot's data must not be overwritten
        #: while a copy is to read it, nor read while a copy is to write it (_take_slot).
        self._copy_from: set[int] = set()
        self._copy_to: set[int] = set()
        #: Slots whose prompt was just read, and its length: their window is checkpointed
        #: there before anything more is decoded (_mark_window_ends).
        self._window_marks: list[tuple[_Slot, int]] = []
        self._cand = None  # candidate array for grammar sampling, made on first use
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self._embed_ctx = None  # made at the first embedding request
        self._embed_batch = None

    # ---- embeddings -------------------------------------------------------------------

    def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        """Mean-pooled, L2-normalised embeddings and the number of tokens read.

        A context of its own (embeddings on, mean pooling, one sequence) so that generation
        state is untouched; each input is decoded whole, in one batch.
        """
        if self._embed_ctx is None:
            cparams = L.llama_context_default_params()
            cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = self.context_length
            cparams.n_seq_max = 1
            cparams.n_threads = cparams.n_threads_batch = self.threads
            cparams.embeddings = True
            cparams.pooling_type = L.LLAMA_POOLING_TYPE_MEAN
            cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
            self._embed_ctx = L.llama_init_from_model(self.model, cparams)
            if not self._embed_ctx:
                raise EngineError(
                    errors.ENGINE_FAILED, "llama.cpp could not create an embedding context"
                )
            self._embed_batch = L.llama_batch_init(self.context_length, 0, 1)
        n_embd = L.llama_model_n_embd(self.model)
        memory = L.llama_get_memory(self._embed_ctx)
        out, total = [], 0
        for i, text in enumerate(texts):
            tokens = self.tokenize(text, add_bos=True, special=False)
            if not tokens or len(tokens) > self.context_length:
                raise EngineError(
                    errors.CONTEXT_LENGTH_EXCEEDED if tokens else errors.INVALID_ARGUMENT,
                    f"input {i} has {len(tokens)} tokens; it must have 1 to "
                    f"{self.context_length} (the context window)",
                )
            total += len(tokens)
            b = self._embed_batch
            for pos, token in enumerate(tokens):
                b.token[pos], b.pos[pos], b.n_seq_id[pos] = token, pos, 1
                b.seq_id[pos][0], b.logits[pos] = 0, True
            b.n_tokens = len(tokens)
            L.llama_memory_clear(memory, True)
            if L.llama_decode(self._embed_ctx, b) != 0:
                raise EngineError(errors.ENGINE_FAILED, "llama_decode failed while embedding")
            vec = L.llama_get_embeddings_seq(self._embed_ctx, 0)[:n_embd]
            norm = math.sqrt(sum(x * x for x in vec)) or 1.0
            out.append([x / norm for x in vec])
        return out, total

    # ---- vocabulary -------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool, special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        return list(buf[:n])

    def _candidates(self, index: int):
        """Every token with its logit at batch position `index`, as llama.cpp's samplers
        take them (filled with numpy: a Python loop over the vocabulary would cost more than
        the sampling)."""
        import numpy as np

        if self._cand is None:
            self._cand_data = (L.llama_token_data * self.n_vocab)()
            view = np.ctypeslib.as_array(self._cand_data)
            self._cand_view = view.view(np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]))
            self._cand = L.llama_token_data_array(self._cand_data, self.n_vocab, -1, False)
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, index), (self.n_vocab,))
        self._cand_view["id"] = np.arange(self.n_vocab, dtype=np.int32)
        self._cand_view["logit"] = logits
        self._cand_view["p"] = 0.0
        self._cand.size, self._cand.selected, self._cand.sorted = self.n_vocab, -1, False
        return self._cand, logits

    def _greedy(self, index: int) -> int:
        """The likeliest token at batch position `index`, the first of equals, as llama.cpp's
        greedy sampler picks it. llama_sampler_sample would first copy the whole vocabulary
        into a candidate array: 160 us a sequence per step for SmolLM2's 49k tokens (2.5% of
        an 8-sequence step), five times that for gemma's 262k; numpy's argmax reads the
        logits in place."""
        import numpy as np

        return int(
            np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, index), (self.n_vocab,)).argmax()
        )

    def _sample_constrained(self, seq: _Sequence) -> int:
        """Sample under a grammar as llama.cpp's common sampler does: sample freely, check the
        one token against the grammar, and only when it is refused apply the grammar to the
        whole vocabulary and sample again. The grammar then costs a token check on most
        steps, not a pass over every token (which slowed the whole batch)."""
        cand, logits = self._candidates(seq.batch_index)
        L.llama_sampler_apply(seq.sampler, ctypes.byref(cand))
        token = cand.data[cand.selected].id
        one = (L.llama_token_data * 1)(L.llama_token_data(token, float(logits[token]), 0.0))
        single = L.llama_token_data_array(one, 1, -1, False)
        L.llama_sampler_apply(seq.grammar, ctypes.byref(single))
        if one[0].logit == float("-inf"):
            cand, _ = self._candidates(seq.batch_index)
            L.llama_sampler_apply(seq.grammar, ctypes.byref(cand))
            L.llama_sampler_apply(seq.sampler, ctypes.byref(cand))
            token = cand.data[cand.selected].id
        L.llama_sampler_accept(seq.grammar, token)
        L.llama_sampler_accept(seq.sampler, token)
        return token

    def logprob(self, index: int, token: int, top: int) -> tuple:
        """(token, its bytes, log-probability, [(bytes, logprob) of the `top` likeliest]) under
        the model's own distribution at batch position `index` (the raw logits, before
        temperature and truncation), as OpenAI reports them."""
        import numpy as np

        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, index), (self.n_vocab,))
        peak = float(logits.max())
        lse = peak + float(np.log(np.exp(logits - peak).sum()))
        alts = []
        if top:
            best = np.argpartition(-logits, top)[:top]
            best = best[np.argsort(-logits[best])]
            alts = [(self.token_bytes(int(t)), float(logits[t]) - lse) for t in best]
        return (token, self.token_bytes(token), float(logits[token]) - lse, alts)

    def token_bytes(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
        return buf.raw[:n]

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return L.llama_vocab_get_text(self.vocab, token).decode("utf-8", errors="replace")

    def bos_text(self) -> str:
        return self.token_text(L.llama_vocab_bos(self.vocab))

    def eos_text(self) -> str:
        return self.token_text(L.llama_vocab_eos(self.vocab))

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    # ---- requests ---------------------------------------------------------------------

    def idle(self) -> bool:
        return not self.active and not self.waiting and not self._window_marks

    def set_threads(self, n: int) -> None:
        """Decode with n threads from the next llama_decode on (llama.cpp takes the count at
        each graph computation, so nothing is reloaded)."""
        n = max(1, int(n))
        L.llama_set_n_threads(self.ctx, n, n)

    def decode_threads(self) -> int:
        return L.llama_n_threads(self.ctx)

    def in_flight(self) -> int:
        return len(self.active) + len(self.waiting)

    def submit(self, req: Request) -> None:
        """Queue a request; raises EngineError when it cannot ever be served."""
        n_prompt = len(req.prompt_tokens)
        if n_prompt == 0:
            raise EngineError(errors.INVALID_ARGUMENT, "the prompt is empty")
        if n_prompt >= self.context_length:
            raise EngineError(
                errors.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {n_prompt} tokens but the context window is "
                f"{self.context_length} tokens (at least one must be left to generate)",
            )
        if len(self.waiting) >= self.max_queue:
            raise EngineError(
                errors.OVERLOADED, f"the queue of this replica is full ({self.max_queue})"
            )
        if req.n > len(self.slots) or (req.n > 1 and (req.resume_tokens or self.invariant)):
            raise EngineError(
                errors.INVALID_ARGUMENT,
                f"n={req.n} needs as many free slots (this replica has {len(self.slots)}), "
                "a throughput-mode replica and no resumed tokens",
            )
        if req.sampling.grammar:
            L.llama_sampler_free(self._grammar_sampler(req.sampling.grammar))  # parses, or 400
        self.waiting.append(req)

    def cancel(self, request_id: str) -> list[Token | Done | Error]:
        """Drop a request wherever it is; returns the events to send."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                return [self._done_event_for_waiting(req, "cancelled")]
        seqs = [
            s
            for rid, s in list(self.active.items())
            if rid == request_id or rid.startswith(f"{request_id}#")  # its extra choices
        ]
        return [self._finish(s, "cancelled") for s in seqs]

    def _done_event_for_waiting(self, req: Request, reason: str) -> Done:
        now = time.monotonic()
        return Done(
            req.request_id,
            reason,
            {"prompt_tokens": len(req.prompt_tokens), "completion_tokens": 0, "cached_tokens": 0},
            {
                "time_to_first_token": 0.0,
                "decode_seconds": 0.0,
                "queue_seconds": now - req.received_at,
            },
        )

    def _grammar_sampler(self, grammar: str):
        sampler = L.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if not sampler:
            raise EngineError(errors.INVALID_SCHEMA, "llama.cpp could not parse the output grammar")
        return sampler

    def _new_sampler(self, s: Sampling):
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        # Mirrors llama-cpp-python's Llama._init_sampler so that results match it.
        if s.penalized:
            L.llama_sampler_chain_add(
                chain,
                L.llama_sampler_init_penalties(
                    self.n_vocab,
                    PENALTY_LAST_N,
                    s.repeat_penalty or 1.0,
                    s.frequency_penalty,
                    s.presence_penalty,
                ),
            )
        if s.temperature <= 0.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        else:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(s.top_k or 0))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_typical(1.0, 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(s.top_p or 1.0, 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(s.min_p, 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(s.temperature))
            seed = s.seed if s.seed is not None else random.getrandbits(32)
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def _admit(self, events: list[Token | Done | Error]) -> None:
        while self.waiting:
            free = [slot for slot in self.slots if not slot.busy]
            if len(free) < self.waiting[0].n:
                return
            req = self.waiting.popleft()
            samplers = self._samplers(req, events)
            if samplers is None:
                continue
            room = self.context_length - len(req.prompt_tokens)
            limit = min(req.max_tokens, room) if req.max_tokens > 0 else room
            prefill = req.prompt_tokens + req.resume_tokens
            shared = self._shared_prefix(prefill) if req.cache_prompt else 0
            grows_to = len(prefill) + limit - len(req.resume_tokens)
            slot, reused, from_host = self._take_slot(free, prefill, req.cache_prompt, grows_to)
            mark_end = (
                self.window_checkpoints
                and req.cache_prompt
                and not req.resume_tokens
                and len(prefill) >= HOST_CACHE_MIN_TOKENS
                and grows_to > self.n_swa
            )
            seq = _Sequence(
                req=req,
                seq_id=slot.seq_id,
                sampler=samplers[0],
                grammar=samplers[1],
                limit=limit,
                prefill=prefill,
                prefill_pos=reused,
                n_past=reused,
                cached_tokens=min(reused, len(req.prompt_tokens)),
                host_cached_tokens=min(reused, len(req.prompt_tokens)) if from_host else 0,
                admitted_at=time.monotonic(),
                checkpoint=shared if shared - reused >= HOST_CACHE_MIN_TOKENS else 0,
                mark_end=mark_end,
            )
            self.active[req.request_id] = seq
            if req.resume_tokens:
                self._resume(seq, events)
            for k in range(1, req.n):
                self._add_choice(seq, k)

    def _samplers(self, req: Request, events: list[Token | Done | Error]) -> tuple | None:
        """The request's sampler chain and grammar sampler; None, with an Error event for
        it, when they cannot be made. One request's settings must never end the engine
        process and every stream in it (an exception here would), whatever the cause."""
        sampler = None
        try:
            sampler = self._new_sampler(req.sampling)
            grammar = self._grammar_sampler(req.sampling.grammar) if req.sampling.grammar else None
            return sampler, grammar
        except Exception as exc:
            if sampler is not None:
                L.llama_sampler_free(sampler)
            traceback.print_exc()  # the agent's log: this is the engine's fault, not the caller's
            code = exc.code if isinstance(exc, EngineError) else errors.UNSPECIFIED
            events.append(Error(req.request_id, code, f"the sampler could not be set up: {exc}"))
            return None

    def _add_choice(self, first: _Sequence, k: int) -> None:
        """Choice k of a request: its own slot and sampler (seed + k), waiting for the first
        choice's prompt KV instead of evaluating the prompt again."""
        req = first.req
        seed = None if req.sampling.seed is None else req.sampling.seed + k
        sub = dataclasses.replace(
            req,
            request_id=f"{req.request_id}#{k}",
            n=1,
            sampling=dataclasses.replace(req.sampling, seed=seed),
        )
        free = [slot for slot in self.slots if not slot.busy]
        slot, _, _ = self._claim(min(free, key=_least_valuable), None, 0)
        self.active[sub.request_id] = _Sequence(
            req=sub,
            seq_id=slot.seq_id,
            sampler=self._new_sampler(sub.sampling),
            grammar=self._grammar_sampler(sub.sampling.grammar) if sub.sampling.grammar else None,
            limit=first.limit,
            prefill=first.prefill,
            prefill_pos=len(first.prefill),
            admitted_at=time.monotonic(),
            follows=first,
        )

    def _fork(self, first: _Sequence) -> None:
        """The first choice's prompt is in its KV and its logits are out: copy both to the
        choices that wait for it (llama.cpp copies the KV stream at the next decode)."""
        for seq in self.active.values():
            if seq.follows is first:
                self._copy_stream(first.seq_id, seq.seq_id)
                seq.n_past, seq.follows = first.n_past, None
                seq.batch_index = first.batch_index

    def _take_slot(
        self, free: list[_Slot], tokens: list[int], reuse: bool, grows_to: int = 0
    ) -> tuple[_Slot, int, bool]:
        """The free slot to use for a prompt, how many of its tokens that slot's KV holds,
        and whether they came from host RAM (grows_to: the most tokens the sequence may
        come to hold, for _claim).

        The free slot sharing the longest prefix with the prompt is the source. The prompt
        either continues in that slot, cutting the cache's tail that differs, or goes to the
        slot whose cache is worth least (empty, else used least recently) with the source's
        stream copied in; whichever throws fewer cached tokens away. So a common system
        prompt is reused without evicting another conversation, and the next turn of a
        conversation stays where its history is. A host-RAM entry that shares more than
        every free slot is restored into that least valuable slot instead. At least the last
        token is evaluated again: its logits give the first new token. In a sliding-window
        model a slot offers only a prefix whose window it still holds (_window_holds), or
        the longest one a window checkpoint of its own gives back (an edited last question
        from the checkpoint where its prompt's new tokens began, a regenerated answer from
        the one where its prompt ended); the prompt then continues in that slot.

        A restore writes the slot's data at once, while a copy between KV streams moves
        data at the next decode: a restore into the source of a copy made for another
        request in the same step gave that request the restored conversation's KV under
        its own prompt (its answer went on with the other user's conversation). A restore
        goes only into a slot no pending copy touches, else the prompt is read instead.
        """
        dst = min(free, key=_least_valuable)
        if self.invariant or not reuse:
            return self._claim(dst, None, 0)
        copying = self._copy_from | self._copy_to
        shared = {id(s): min(common_prefix(s.cached, tokens), len(tokens) - 1) for s in free}
        back: dict[int, _WindowCheckpoint] = {}  # slots that reuse through a checkpoint
        for s in free:
            n = shared[id(s)]
            if self._window_holds(s.seq_id, n):
                continue
            best = max(s.checkpoints, key=lambda c: c.reach(n, self.n_swa), default=None)
            r = best.reach(n, self.n_swa) if best is not None else 0
            if s.seq_id in copying:  # a restore writes at once (above)
                r = 0
            if r:
                back[id(s)] = best
            shared[id(s)] = r
        src = max(free, key=lambda s: (shared[id(s)], -s.last_used))
        n = shared[id(src)]
        entry, n_host, via = self.host.best(tokens[:-1], n, self.n_swa)
        if entry is not None:
            spare = [s for s in free if s.seq_id not in copying]
            if spare:
                slot = min(spare, key=_least_valuable)
                return self._claim(slot, None, n_host, entry, via, grows_to, tokens)
        if not n:
            return self._claim(dst, None, 0)
        if dst is src or id(src) in back or len(src.cached) - n <= len(dst.cached):
            checkpoint = back.get(id(src))
            return self._claim(src, None, n, None, checkpoint, grows_to, tokens)
        return self._claim(dst, src, n, None, None, grows_to, tokens)

    def _claim(
        self,
        slot: _Slot,
        src: _Slot | None,
        reused: int,
        entry: _Saved | None = None,
        checkpoint: _WindowCheckpoint | None = None,
        grows_to: int = 0,
        tokens: list[int] | None = None,
    ) -> tuple[_Slot, int, bool]:
        """Make `slot` hold the first `reused` of a prompt's `tokens`: its own (back to a
        window checkpoint of its own, given one), copied from slot src, or restored from a
        host-RAM entry (back to a window checkpoint of the entry's, given one). What of its
        own cache this throws away is copied to host RAM first, and its window checkpoints
        past what the prompt shares with it go with that copy (or go, without one); those
        of a restored entry come to the slot. Where its sequence may come to hold more
        than a window (grows_to), the window that holds the reused tokens is checkpointed
        first (_checkpoint_window), unless only the prompt's last token follows them (the
        same prompt again): the checkpoint of its end (_mark_window_ends) serves."""
        slot.busy = True
        mem, seq = self.memory, slot.seq_id
        in_place = src is None and entry is None
        keep = common_prefix(slot.cached, tokens) if in_place and reused and tokens else 0
        self._save(slot, reused if in_place else 0)
        gone = [c for c in slot.checkpoints if c.n > keep]
        if gone and self.host.attach(slot.cached, gone):
            slot.checkpoints = [c for c in slot.checkpoints if c.n <= keep]
        carried: list[_WindowCheckpoint] = []
        if src is not None:
            # Across KV streams llama.cpp copies whole streams only (at the next decode);
            # the tail beyond the shared prefix is cut after.
            L.llama_memory_seq_rm(mem, seq, -1, -1)
            self._copy_stream(src.seq_id, seq)
        elif entry is not None:
            L.llama_memory_seq_rm(mem, seq, -1, -1)
            size = entry.size
            if L.llama_state_seq_set_data(self.ctx, entry.data, size, seq) != size:
                reused = 0  # llama.cpp found no room or a mismatch: evaluate it all
            carried = self.host.take(entry)
        if checkpoint is not None:
            data, size = checkpoint.data, checkpoint.size
            if L.llama_state_seq_set_data_ext(self.ctx, data, size, seq, STATE_PARTIAL) != size:
                reused = 0
        if reused and not L.llama_memory_seq_rm(mem, seq, reused, -1):
            reused = 0
        if reused and not self._window_holds(seq, reused):
            reused = 0  # what was copied or restored lacks the window (_window_holds)
        if not reused:
            L.llama_memory_seq_rm(mem, seq, -1, -1)
        slot.cached, slot.saved, slot.readied = [], False, False
        dropped = self._drop_checkpoints(slot, keep if reused else 0)
        if carried:  # the restored entry's, those within what the prompt shares with it
            slot.checkpoints = carried
            dropped += self._drop_checkpoints(slot, reused and common_prefix(entry.tokens, tokens))
        ends_at = len(tokens) if tokens else 0
        if reused and grows_to > self.n_swa and ends_at - reused > 1:
            self._checkpoint_window(slot, reused, slot if src is None else src, dropped)
        return slot, reused, entry is not None and reused > 0

    def _drop_checkpoints(self, slot: _Slot, keep: int) -> list[ctypes.Array]:
        """Let a slot's window checkpoints past its first `keep` tokens go (and their bytes
        from the host cache's count): its cache no longer holds what they stand for.
        Returns their buffers, for the slot's next checkpoint."""
        gone = [c.data for c in slot.checkpoints if c.n > keep]
        for data in gone:
            self.host.release(len(data))
        slot.checkpoints = [c for c in slot.checkpoints if c.n <= keep]
        return gone

    def _checkpoint_window(
        self, slot: _Slot, n: int, source: _Slot, spares: list[ctypes.Array]
    ) -> None:
        """Keep the sliding-window cells that hold a slot's first n tokens before it reads
        more: read from `source` (the slot itself, or the one whose stream is copied into
        it at the next decode; cells past n go when restored), unless a checkpoint of n is
        there. From the first token past n llama.cpp may reuse those cells (it did within
        a 640-token answer here), and a prompt that goes back to n (the answer regenerated,
        the last message edited) would read the whole history again. llama-server
        checkpoints a slot at the start of each prompt's last user message; a
        conversation's next prompt starts its new tokens about there.

        A fresh buffer took 4-9 ms for 4-8 MiB here (the kernel's and ctypes' zeroing;
        15 ms for 16 MiB on a later machine), the copy into a used one 1-2.5 ms: a spare
        of the slot's made while idle (_spare_buffers) is used first, and the slot keeps
        its checkpoints (up to SLOT_CHECKPOINTS); without one, once it holds
        FIRM_CHECKPOINTS, its oldest makes way and lends its buffer where it fits, as does
        one let go (spares)."""
        if (
            not self.window_checkpoints
            or n < HOST_CACHE_MIN_TOKENS
            or source.seq_id in self._copy_to  # its data comes at the next decode
            or any(c.n == n for c in slot.checkpoints)
        ):
            return
        seq = source.seq_id
        # llama.cpp saves only the cells the source's last position still sees: a source
        # that holds far more than n tokens (a slot copied from) may lack n's window.
        low = max(
            L.llama_memory_seq_pos_min(self.memory, seq),
            L.llama_memory_seq_pos_max(self.memory, seq) - self.n_swa + 1,
        )
        if low > window_start(n, self.n_swa):
            return
        size = L.llama_state_seq_get_size_ext(self.ctx, seq, STATE_PARTIAL)
        if not size:
            return
        data = next((b for b in slot.spares if fits(b, size)), None)
        if data is not None:  # counted already
            slot.spares.remove(data)
        if len(slot.checkpoints) >= (FIRM_CHECKPOINTS if data is None else SLOT_CHECKPOINTS):
            old = slot.checkpoints.pop(0)
            self.host.release(len(old.data))
            spares = [*spares, old.data]
        held = len(data) if data is not None else 0
        if data is None:
            data = next((b for b in spares if fits(b, size)), None)
            held = len(data) if data is not None else size
            if not self.host.reserve(held):
                return
            data = data if data is not None else (ctypes.c_uint8 * size)()
        if L.llama_state_seq_get_data_ext(self.ctx, data, size, seq, STATE_PARTIAL) == size:
            slot.checkpoints.append(_WindowCheckpoint(n, data, size, low))
        else:
            self.host.release(held)

    def _mark_window_ends(self) -> None:
        """Checkpoint the window of each slot whose prompt the last step finished reading,
        before its first new token is decoded: an answer that runs past the window takes
        the prompt's end out of it, and the same prompt sent again (the answer regenerated)
        then reads one token instead of the last user message, or the whole history
        without a checkpoint. llama-server checkpoints 4 tokens before a prompt's end, and
        reads those 4 in a decode of their own to do so; here the copy is made after the
        step whose events went out, so no step is added and the first token waits for no
        copy."""
        marks, self._window_marks = self._window_marks, []
        for slot, n in marks:
            if L.llama_memory_seq_pos_max(self.memory, slot.seq_id) == n - 1:
                self._checkpoint_window(slot, n, slot, [])

    def _shared_prefix(self, tokens: list[int]) -> int:
        """Where a new prompt's state should be checkpointed to host RAM: the longest
        prefix it shares with a slot, a running prompt or a host-RAM entry (a system
        prompt, say), in a sliding-window model with the window cache; 0 otherwise.

        There a slot keeps only about a window of cells in the sliding-window layers, so
        once its conversation runs past that, a prompt sharing only its start (the next
        conversation under the same system prompt) cannot reuse it and is read whole: the
        window cache's cost beside the full one. The prompt that finds itself sharing such
        a prefix copies its state at the prefix's end to host RAM as a checkpoint, which
        serves the prompts after it from any slot (llama-server checkpoints the window
        per slot, at the start of user messages). Measured in the step that admits it,
        before its slot is claimed (which may clear what the slot shared)."""
        if self.n_swa <= 0 or self.swa_full or not self.host.limit:
            return 0
        others = [s.cached for s in self.slots if not s.busy]
        others += [q.prefill for q in self.active.values()]
        others += [e.tokens for e in self.host.entries]
        n = max((common_prefix(o, tokens) for o in others), default=0)
        return min(n, len(tokens) - 1)

    def _checkpoint(self, seq: _Sequence) -> None:
        """Copy a sequence's state, which holds just its first `seq.checkpoint` tokens, to
        host RAM as a checkpoint (_shared_prefix)."""
        n, seq.checkpoint = seq.checkpoint, 0
        self._to_host(seq.seq_id, seq.prefill[:n], kept=True)

    def _window_holds(self, seq_id: int, n: int) -> bool:
        """Whether a slot's sliding-window cells still hold the window before position n,
        so that its first n tokens can be reused (always true without a sliding window;
        llama-server asks for a position or two more). A conversation restored from host
        RAM keeps only its last window there, and cut to its first few tokens it keeps no
        cell at all (-1): those layers would read a new prompt without its start (gemma
        then answered a story with an end of generation, an empty message). Made before a
        slot is chosen, and after a copy or restore in case what arrived lacks the
        window."""
        if self.n_swa <= 0 or n <= 0:
            return True
        low = L.llama_memory_seq_pos_min(self.memory, seq_id)
        return 0 <= low <= window_start(n, self.n_swa)

    def _copy_stream(self, src: int, dst: int) -> None:
        """Copy slot src's KV into slot dst (llama.cpp does it at the next decode), noting
        both until then: every copy between slots goes through here."""
        L.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
        self._copy_from.add(src)
        self._copy_to.add(dst)

    def save_ahead(self) -> bool:
        """While nothing runs, copy one free slot's sequence to host RAM before a request
        takes the slot: a request that then throws it away finds the copy made and gets its
        first token without waiting for it (llama-server copies when the request comes; a
        4 MB sequence took 2-3 ms here, mostly fresh pages). The slot a new prompt would
        take first goes first. True when it took a slot in hand (call again while still
        idle), copied unless too short, held already or over SAVE_AHEAD_BYTES; False once
        every slot has been taken in hand since it last changed. A slot whose conversation
        continues in place leaves its copy behind until a longer copy of it replaces it
        (HostCache.add), so at most one such copy per slot is held.

        Before that, the buffers for each slot's next window checkpoints (_spare_buffers),
        the slot used last first: its conversation is the likeliest to go on, and a user
        reading its answer may leave half a second of idle time."""
        if not self.host.limit or not self.idle():
            return False
        by_use = sorted(self.slots, key=lambda s: s.last_used, reverse=True)
        for slot in by_use:
            if not slot.readied:
                slot.readied = True
                if self._spare_buffers(slot, last=slot is by_use[0]):
                    return True
        for slot in sorted(self.slots, key=_least_valuable):
            if not slot.saved:
                slot.saved = True
                self._save(slot, 0, SAVE_AHEAD_BYTES)  # unless short, held, or mid-copy
                return True
        return False

    def _spare_buffers(self, slot: _Slot, last: bool) -> bool:
        """While idle, make buffers for a slot's next two window checkpoints (a prompt
        makes two): a fresh buffer on the way to a first token cost up to 15 ms
        (_checkpoint_window), and with one at hand the slot keeps its older checkpoints
        instead of letting one go for its buffer. For the slot used last (`last`), whose
        conversation likely goes on, the oldest host-RAM entries may make room, as for
        a copy made ahead of need, but window checkpoints not; for the others, only room
        nothing else holds. Sized a quarter over the slot's sliding-window cells
        now: a conversation's grow until they hold a window. True when it made one."""
        if not self.window_checkpoints or len(slot.cached) < HOST_CACHE_MIN_TOKENS:
            return False
        size = L.llama_state_seq_get_size_ext(self.ctx, slot.seq_id, STATE_PARTIAL)
        want = size * 5 // 4
        for b in [b for b in slot.spares if len(b) < size]:  # outgrown
            slot.spares.remove(b)
            self.host.release(len(b))
        made = False

        room = Room.ENTRIES if last else Room.FREE
        while size and len(slot.spares) < 2 and self.host.reserve(want, room):
            slot.spares.append((ctypes.c_uint8 * want)())
            made = True
        return made

    def _save(self, slot: _Slot, keep: int, most: int = 0) -> None:
        """Copy the slot's cached sequence to host RAM when a new request keeps only `keep`
        of its tokens and would lose at least HOST_CACHE_MIN_TOKENS (and, given `most`, the
        copy is at most that many bytes), unless it loses only the slot's last answer (the
        answer regenerated): as llama-server, which copies a slot to RAM only when a prompt
        keeps less than half of it. The copy (29 MB for a 1,290-token SmolLM2 conversation)
        made such a prompt wait 21 ms more than llama-server's 25."""
        tokens = slot.cached
        if (
            not self.host.limit
            or (keep and keep >= slot.prompt_len - 1)
            or slot.seq_id in self._copy_to  # its data comes at the next decode
            or len(tokens) - keep < HOST_CACHE_MIN_TOKENS
            or self.host.holds(tokens)
        ):
            return
        self._to_host(slot.seq_id, tokens, most)

    def _to_host(self, seq_id: int, tokens: list[int], most: int = 0, kept: bool = False) -> None:
        """Copy sequence seq_id's state, which holds `tokens`, to host RAM, unless it is over
        `most` bytes (given) or the cache's limit: every copy to host RAM goes through here."""
        size = L.llama_state_seq_get_size(self.ctx, seq_id)
        if not size or size > min(self.host.limit, most or self.host.limit):
            return
        data = self.host.buffer(size)
        if L.llama_state_seq_get_data(self.ctx, data, size, seq_id) == size:
            self.host.add(tokens, data, size, kept, Room.ENTRIES if most else Room.ALL)

    def _resume(self, seq: _Sequence, events: list[Token | Done | Error]) -> None:
        """Take over a generation: its tokens count as generated, unsent text is sent."""
        req = seq.req
        for token in req.resume_tokens:
            L.llama_sampler_accept(seq.sampler, token)  # the repeat penalty's history
            if seq.grammar is not None:
                L.llama_sampler_accept(seq.grammar, token)  # a migrated structured output
        seq.generated = len(req.resume_tokens)
        seq.first_token_at = time.monotonic()
        raw = b"".join(self.token_bytes(t) for t in req.resume_tokens)
        seq.decoder.decode(raw[: req.delivered_bytes])  # already with the client
        if self._push_text(seq, seq.decoder.decode(raw[req.delivered_bytes :]), events):
            events.append(self._finish(seq, "stop"))
        elif seq.generated >= seq.limit:
            events.extend(self._flush(seq, final=True))
            events.append(self._finish(seq, "length"))

    # ---- the step ---------------------------------------------------------------------

    def _add(self, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        b = self.batch
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq_id
        b.logits[i] = logits

    def step(self) -> list[Token | Done | Error]:
        """Decode one step; returns its Token, Done and Error events."""
        events: list[Token | Done | Error] = []
        self._mark_window_ends()
        self._admit(events)
        if not self.active:
            return events
        if self.invariant:
            self._step_invariant(events)
        else:
            self._step_throughput(events)
        return events

    def _step_throughput(self, events: list[Token | Done | Error]) -> None:
        """One llama_decode: every decoding sequence's next token, then prompt chunks of
        the sequences still reading theirs (whole short ones first) up to the step's
        budget, so that new requests reach their first token within a step or two of
        arriving and running streams are not stalled behind long prompts; or, every other
        step at most, short prompts alone (see `alone` below).

        The batch is laid out in slot order. With a KV stream per slot, llama.cpp cuts a
        batch into micro-batches of consecutive sequence ids taken in batch order, and each
        micro-batch is a pass over all the weights: 8 streams listed in arrival order took
        2-3 passes a step (48-51 ms a step here, against 38-40 in slot order).
        """
        decoding, reading = [], []
        for seq in self.active.values():
            seq.batch_index = -1
            if seq.follows is not None:
                continue  # an extra choice: its prompt KV comes from the first choice
            (reading if seq.prefill_pos < len(seq.prefill) else decoding).append(seq)
        # A prompt that ends within the budget while streams run is read in a step of its
        # own, and its first token goes out before their next ones: llama.cpp decodes a
        # mixed step as a micro-batch of the streams' tokens and one of the prompt's anyway
        # (a KV stream per slot takes equal tokens from each sequence), so the running
        # streams wait no longer, and the new one does not wait for theirs. Never twice
        # in a row: the streams advance at least every other step.
        alone = bool(
            self.prompt_first
            and decoding
            and not self._prompt_alone
            and any(len(q.prefill) - q.prefill_pos <= PROMPT_BUDGET for q in reading)
        )
        self._prompt_alone = alone
        if alone:
            decoding = []
        take: dict[int, tuple[_Sequence | None, int]] = {s.seq_id: (s, 1) for s in decoding}
        n = len(decoding)
        # Beside running streams prompts take the budget: a stream waits at most that chunk.
        # With none running no stream waits, so prompts fill the batch, as llama-server
        # fills its own: short requests that end at their first token (a classifier's) were
        # read two or three a step within the budget, and are now read all at once (1.09x
        # the requests a second, 2026-12-05). A prompt alone takes the whole batch; others
        # leave room for the fillers of idle slots (one token each, see _fill_holes).
        if alone:
            cap = PROMPT_BUDGET
        elif n == 0:
            cap = N_BATCH if len(reading) == 1 else N_BATCH - self.parallel
        else:
            cap = min(N_BATCH - self.parallel, n + PROMPT_BUDGET)

        # Whole prompts that fit go first, the shortest first: a follow-up turn whose
        # history is cached reads a few tokens and has its first token after this step
        # rather than behind a new conversation's long prompt (shortest remaining work
        # first gives the lowest mean wait). When none fits, the longest waiting prompt
        # takes the budget (a part of a prompt gives no first token, so only one is cut),
        # and long prompts are read in arrival order.
        for seq in sorted(reading, key=lambda q: len(q.prefill) - q.prefill_pos):
            left = seq.to_read()
            if left > cap - n:
                break
            take[seq.seq_id] = (seq, left)
            n += left
        if reading and n == len(decoding) and cap > n:  # none fits whole
            take[reading[0].seq_id] = (reading[0], min(cap - n, reading[0].to_read()))
        fillers = self._fill_holes(take)
        n = 0
        for seq_id in sorted(take):
            seq, k = take[seq_id]
            if seq is None:  # a filler: no logits, removed after the decode
                self._add(n, 0, k, seq_id, False)
                n += 1
                continue
            if seq.prefill_pos >= len(seq.prefill):
                self._add(n, seq.last_token, seq.n_past, seq_id, True)
                seq.batch_index = n
                seq.n_past += 1
                n += 1
                continue
            for pos in range(seq.prefill_pos, seq.prefill_pos + k):
                last = pos == len(seq.prefill) - 1
                self._add(n, seq.prefill[pos], seq.n_past, seq_id, last)
                if last:
                    seq.batch_index = n
                seq.n_past += 1
                n += 1
            seq.prefill_pos += k
        ok = self._decode(n, events)
        for seq_id, pos in fillers:
            L.llama_memory_seq_rm(self.memory, seq_id, pos, -1)
        if ok:
            for seq, _ in take.values():
                if seq is not None and seq.checkpoint and seq.prefill_pos == seq.checkpoint:
                    self._checkpoint(seq)
                if seq is not None and seq.mark_end and seq.prefill_pos == len(seq.prefill):
                    seq.mark_end = False
                    self._window_marks.append((self.slots[seq.seq_id], seq.prefill_pos))
            self._sample(events)

    def _fill_holes(self, take: dict) -> list[tuple[int, int]]:
        """Give one token to every slot between the step's lowest and highest sequence
        that has none, so that llama.cpp decodes the step as one micro-batch (a slot left
        out splits it, and each part is a pass over all the weights, about the cost of a
        whole one-sequence step): a sequence still reading its prompt gets its next token,
        an idle slot (or an extra choice waiting for its prompt) a filler token after what
        its KV holds. Returns the fillers as (slot, position), for removal after the decode.

        In a sliding-window model a new token may take the cell of one that left the
        window, which would eat into a cached prefix: there only slots with nothing cached
        get fillers."""
        fillers = []
        if len(take) < 2:
            return fillers
        by_slot = {seq.seq_id: seq for seq in self.active.values()}
        for seq_id in range(min(take), max(take)):
            if seq_id in take:
                continue
            seq = by_slot.get(seq_id)
            if seq is not None and seq.follows is None:
                take[seq_id] = (seq, 1)  # reading, beyond this step's budget
                continue
            slot = self.slots[seq_id]
            pos = seq.n_past if seq is not None else len(slot.cached)
            if pos and self.n_swa > 0:
                continue
            if pos >= self.context_length:  # a full stream: give up its last cached token
                pos -= 1
                slot.cached = slot.cached[:pos]
                L.llama_memory_seq_rm(self.memory, seq_id, pos, -1)
            take[seq_id] = (None, pos)
            fillers.append((seq_id, pos))
        return fillers

    def _step_invariant(self, events: list[Token | Done | Error]) -> None:
        """The next token of every decoding sequence, in llama_decode calls of at most
        INVARIANT_ROWS, then the next prompt chunk of a single waiting sequence in one of its
        own. Keeping prompts apart makes each sequence's numbers those of a solo run
        (llama.cpp splits a mixed batch into other chunks, and a prompt chunked differently
        can change a greedy choice), so greedy text does not depend on what else is running.
        """
        rows = []
        for seq in sorted(self.active.values(), key=lambda q: q.seq_id):  # slot order
            seq.batch_index = -1
            if seq.prefill_pos < len(seq.req.prompt_tokens):
                continue
            if seq.prefill_pos < len(seq.prefill):
                # A resumed token: decoded alone per step, as it was first produced.
                last = seq.prefill_pos == len(seq.prefill) - 1
                rows.append((seq, seq.prefill[seq.prefill_pos], last))
                seq.prefill_pos += 1
            else:
                rows.append((seq, seq.last_token, True))
        for i in range(0, len(rows), INVARIANT_ROWS):
            for n, (seq, token, logits) in enumerate(rows[i : i + INVARIANT_ROWS]):
                self._add(n, token, seq.n_past, seq.seq_id, logits)
                if logits:
                    seq.batch_index = n
                seq.n_past += 1
            if not self._decode(n + 1, events):
                return
            self._sample(events)
        prompt = next(
            (q for q in self.active.values() if q.prefill_pos < len(q.req.prompt_tokens)), None
        )
        if prompt is not None:
            n = 0
            tokens = prompt.req.prompt_tokens
            end = min(len(tokens), prompt.prefill_pos + N_BATCH)
            for pos in range(prompt.prefill_pos, end):
                # The prompt's last token gives logits, unless resumed tokens follow it.
                last = pos == len(prompt.prefill) - 1
                self._add(n, tokens[pos], prompt.n_past, prompt.seq_id, last)
                if last:
                    prompt.batch_index = n
                prompt.n_past += 1
                n += 1
            prompt.prefill_pos = end
            if self._decode(n, events):
                self._sample(events)

    def _decode(self, n: int, events: list[Token | Done | Error]) -> bool:
        self.batch.n_tokens = n
        # Each slot's stream holds at most its own context (a reused slot's tail is cut
        # first), so a prompt cache never takes room a running sequence needs.
        rc = L.llama_decode(self.ctx, self.batch)
        self._copy_from.clear()  # the decode made the pending copies first
        self._copy_to.clear()
        if rc != 0:
            # Fail what is running rather than the whole engine.
            events.extend(
                self._fail(seq, errors.ENGINE_FAILED, f"llama_decode failed with code {rc}")
                for seq in list(self.active.values())
            )
            return False
        return True

    def _sample(self, events: list[Token | Done | Error]) -> None:
        """Sample every sequence whose logits the last decode produced."""
        for seq in list(self.active.values()):
            if seq.batch_index < 0:
                continue
            if seq.generated == 0 and seq.req.n > 1:
                self._fork(seq)
            if seq.req.sampling.argmax:
                token = self._greedy(seq.batch_index)
            elif seq.grammar is None:
                token = L.llama_sampler_sample(seq.sampler, self.ctx, seq.batch_index)
            else:
                token = self._sample_constrained(seq)
            if seq.req.logprobs >= 0 and not L.llama_vocab_is_eog(self.vocab, token):
                seq.new_logprobs.append(self.logprob(seq.batch_index, token, seq.req.logprobs))
            seq.batch_index = -1
            if not seq.first_token_at:
                seq.first_token_at = time.monotonic()
            if L.llama_vocab_is_eog(self.vocab, token):  # not counted, as OpenAI does
                events.extend(self._flush(seq, final=True))
                events.append(self._finish(seq, "stop"))
                continue
            seq.generated += 1
            seq.last_token = token
            seq.new_tokens.append(token)
            seq.sampled.append(token)
            text = seq.decoder.decode(self.token_bytes(token))
            stopped = self._push_text(seq, text, events)
            if stopped:
                events.append(self._finish(seq, "stop"))
            elif seq.generated >= seq.limit:
                events.extend(self._flush(seq, final=True))
                events.append(self._finish(seq, "length"))

    def _push_text(self, seq: _Sequence, text: str, events: list[Token | Done | Error]) -> bool:
        """Emit text, holding back what may begin a stop string; True when one matched."""
        seq.pending_text += text
        stops = seq.req.stop
        if stops:
            hits = [i for i in (seq.pending_text.find(s) for s in stops if s) if i >= 0]
            if hits:
                seq.pending_text = seq.pending_text[: min(hits)]
                events.extend(self._flush(seq, final=True))
                return True
            hold = 0
            for s in stops:
                for k in range(min(len(s) - 1, len(seq.pending_text)), hold, -1):
                    if seq.pending_text.endswith(s[:k]):
                        hold = k
                        break
            out = seq.pending_text[: len(seq.pending_text) - hold]
            seq.pending_text = seq.pending_text[len(out) :]
        else:
            out, seq.pending_text = seq.pending_text, ""
        if out:
            events.append(self._piece(seq, out))
        return False

    def _piece(self, seq: _Sequence, text: str) -> Token:
        event = Token(
            seq.req.request_id,
            text,
            seq.emitted,
            seq.new_tokens,
            len(seq.req.prompt_tokens),
            seq.new_logprobs,
        )
        seq.emitted += 1
        seq.new_tokens, seq.new_logprobs = [], []
        return event

    def _flush(self, seq: _Sequence, final: bool) -> list[Token | Done | Error]:
        text = seq.pending_text + (seq.decoder.decode(b"", final=True) if final else "")
        seq.pending_text = ""
        if not text:
            return []
        return [self._piece(seq, text)]

    def _release(self, seq: _Sequence, keep_cache: bool) -> None:
        """Give the slot back; in throughput mode its KV stays as a prompt cache."""
        del self.active[seq.req.request_id]
        slot = self.slots[seq.seq_id]
        slot.busy = False
        slot.last_used = time.monotonic()
        slot.saved = slot.readied = False
        if keep_cache and not self.invariant:
            slot.cached = (seq.prefill + seq.sampled)[: seq.n_past]
            slot.prompt_len = min(len(seq.prefill), len(slot.cached))
        else:
            slot.cached = []
            self._drop_checkpoints(slot, 0)
            L.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
        L.llama_sampler_free(seq.sampler)
        if seq.grammar is not None:
            L.llama_sampler_free(seq.grammar)

    def _finish(self, seq: _Sequence, reason: str) -> Done:
        self._release(seq, keep_cache=True)
        now = time.monotonic()
        first = seq.first_token_at or now
        return Done(
            seq.req.request_id,
            reason,
            {
                "prompt_tokens": len(seq.req.prompt_tokens),
                "completion_tokens": seq.generated,
                "cached_tokens": seq.cached_tokens,
                "host_cached_tokens": seq.host_cached_tokens,
                "host_cache_bytes": self.host.bytes,
            },
            {
                "time_to_first_token": first - seq.req.received_at,
                "decode_seconds": now - first,
                "queue_seconds": seq.admitted_at - seq.req.received_at,
            },
        )

    def _fail(self, seq: _Sequence, code: int, message: str) -> Error:
        self._release(seq, keep_cache=False)
        return Error(seq.req.request_id, code, message)

    def close(self) -> None:
        if self._embed_ctx is not None:
            L.llama_batch_free(self._embed_batch)
            L.llama_free(self._embed_ctx)
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)
