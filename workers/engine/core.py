"""Continuous batching on llama.cpp's batch API.

One llama context holds `parallel` sequences, each in its own KV stream. Every step builds one
llama_batch with the next token of each decoding sequence plus a chunk of a waiting
prompt, decodes it once, and samples each sequence with its own sampler chain. New
requests join between steps; finished or cancelled ones leave without stalling the rest.

This module runs inside the engine child process only: a crash in llama.cpp must never
reach the agent.
"""

from __future__ import annotations

import codecs
import ctypes
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import llama_cpp as L

from workers.engine.errors import EngineError

#: Same default as llama-cpp-python's Llama(n_batch=512): prompts decode in chunks of this.
N_BATCH = 512
#: llama-cpp-python's default window for the repeat penalty.
PENALTY_LAST_N = 64


@dataclass
class Sampling:
    """Sampling settings of one request (temperature 0 means greedy)."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0


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
    pending_text: str = ""  # decoded text held back while it may start a stop string
    new_tokens: list[int] = field(default_factory=list)  # sampled, not yet sent with text
    emitted: int = 0  # pieces emitted
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )


class BatchEngine:
    """A model plus one multi-sequence context, stepped by the engine process loop."""

    def __init__(
        self,
        model_path: str,
        context_length: int,
        parallel: int,
        threads: int,
        max_queue: int = 64,
        flash_attn: bool = False,
        rpc_servers: list[str] | None = None,
        n_gpu_layers: int = -1,
        split_mode: int = L.LLAMA_SPLIT_MODE_LAYER,
        tensor_split: list[float] | None = None,
        shared_kv: bool = False,
    ):
        """rpc_servers split the model: the last n_gpu_layers layers (-1: all) go to those
        servers, in proportion to tensor_split; the rest stay here. Without rpc_servers,
        n_gpu_layers >= 0 bounds what goes to local accelerators (none on a CPU build)."""
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
            # Tensor parallel over RPC needs flash attention (llama.cpp refuses it otherwise).
            flash_attn = flash_attn or split_mode == L.LLAMA_SPLIT_MODE_TENSOR
        elif n_gpu_layers >= 0:
            mparams.n_gpu_layers = n_gpu_layers
        self.model = L.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise EngineError(
                "BAD_MODEL_FILE", f"llama.cpp could not load {model_path} (corrupt or unsupported)"
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
        # By default one KV stream per slot, not a unified cache: a sequence then sits at the
        # same cells as it would alone, so attention sums in the same order and greedy text
        # is the same whatever else is batched with it (a unified cache diverges). The shared
        # cache is faster with many sequences (8 streams: 1.6x one stream against 1.2x).
        cparams.kv_unified = shared_kv
        # Off, as llama-cpp-python's Llama has it, for identical numerics; tensor-parallel
        # splits need it on.
        cparams.flash_attn_type = (
            L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise EngineError("ENGINE_FAILED", "llama.cpp could not create a context")
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(N_BATCH, 0, 1)
        self.max_queue = max_queue
        self.free_seq_ids = deque(range(self.parallel))
        self.waiting: deque[Request] = deque()
        self.active: dict[str, _Sequence] = {}
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
                    "ENGINE_FAILED", "llama.cpp could not create an embedding context"
                )
            self._embed_batch = L.llama_batch_init(self.context_length, 0, 1)
        n_embd = L.llama_model_n_embd(self.model)
        memory = L.llama_get_memory(self._embed_ctx)
        out, total = [], 0
        for i, text in enumerate(texts):
            tokens = self.tokenize(text, add_bos=True, special=False)
            if not tokens or len(tokens) > self.context_length:
                raise EngineError(
                    "CONTEXT_LENGTH_EXCEEDED" if tokens else "INVALID_ARGUMENT",
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
                raise EngineError("ENGINE_FAILED", "llama_decode failed while embedding")
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
        return not self.active and not self.waiting

    def in_flight(self) -> int:
        return len(self.active) + len(self.waiting)

    def submit(self, req: Request) -> None:
        """Queue a request; raises EngineError when it cannot ever be served."""
        n_prompt = len(req.prompt_tokens)
        if n_prompt == 0:
            raise EngineError("INVALID_ARGUMENT", "the prompt is empty")
        if n_prompt >= self.context_length:
            raise EngineError(
                "CONTEXT_LENGTH_EXCEEDED",
                f"the prompt has {n_prompt} tokens but the context window is "
                f"{self.context_length} tokens (at least one must be left to generate)",
            )
        if len(self.waiting) >= self.max_queue:
            raise EngineError("OVERLOADED", f"the queue of this replica is full ({self.max_queue})")
        self.waiting.append(req)

    def cancel(self, request_id: str) -> list[tuple]:
        """Drop a request wherever it is; returns the events to send."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                return [self._done_event_for_waiting(req, "cancelled")]
        seq = self.active.get(request_id)
        if seq is None:
            return []
        return [self._finish(seq, "cancelled")]

    def _done_event_for_waiting(self, req: Request, reason: str) -> tuple:
        now = time.monotonic()
        return (
            "done",
            req.request_id,
            reason,
            {"prompt_tokens": len(req.prompt_tokens), "completion_tokens": 0},
            {
                "time_to_first_token": 0.0,
                "decode_seconds": 0.0,
                "queue_seconds": now - req.received_at,
            },
        )

    def _new_sampler(self, s: Sampling):
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        # Mirrors llama-cpp-python's Llama._init_sampler so that results match it.
        if s.repeat_penalty and s.repeat_penalty != 1.0:
            L.llama_sampler_chain_add(
                chain, L.llama_sampler_init_penalties(PENALTY_LAST_N, s.repeat_penalty, 0.0, 0.0)
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

    def _admit(self, events: list[tuple]) -> None:
        while self.waiting and self.free_seq_ids:
            req = self.waiting.popleft()
            seq_id = self.free_seq_ids.popleft()
            room = self.context_length - len(req.prompt_tokens)
            limit = min(req.max_tokens, room) if req.max_tokens > 0 else room
            seq = _Sequence(
                req=req,
                seq_id=seq_id,
                sampler=self._new_sampler(req.sampling),
                limit=limit,
                prefill=req.prompt_tokens + req.resume_tokens,
                admitted_at=time.monotonic(),
            )
            self.active[req.request_id] = seq
            if req.resume_tokens:
                self._resume(seq, events)

    def _resume(self, seq: _Sequence, events: list[tuple]) -> None:
        """Take over a generation: its tokens count as generated, unsent text is sent."""
        req = seq.req
        for token in req.resume_tokens:
            L.llama_sampler_accept(seq.sampler, token)  # the repeat penalty's history
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

    def step(self) -> list[tuple]:
        """Decode one step; returns events ("token", ...) and ("done", ...).

        A step is one llama_decode with the next token of every decoding sequence, then one
        with the next prompt chunk of a single waiting sequence. Keeping them apart makes
        each sequence's numbers those of a solo run (llama.cpp splits a mixed batch into
        other chunks, and a prompt chunked differently can change a greedy choice), so
        greedy text does not depend on what else is running.
        """
        events: list[tuple] = []
        self._admit(events)
        if not self.active:
            return events
        n = 0
        for seq in self.active.values():
            seq.batch_index = -1
            if seq.prefill_pos < len(seq.req.prompt_tokens):
                continue
            if seq.prefill_pos < len(seq.prefill):
                # A resumed token: decoded alone per step, as it was first produced.
                last = seq.prefill_pos == len(seq.prefill) - 1
                self._add(n, seq.prefill[seq.prefill_pos], seq.n_past, seq.seq_id, last)
                seq.prefill_pos += 1
                if not last:
                    seq.n_past += 1
                    n += 1
                    continue
            else:
                self._add(n, seq.last_token, seq.n_past, seq.seq_id, True)
            seq.batch_index = n
            seq.n_past += 1
            n += 1
        if n and not self._decode(n, events):
            return events
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
            if not self._decode(n, events):
                return events
            self._sample(events)
        return events

    def _decode(self, n: int, events: list[tuple]) -> bool:
        self.batch.n_tokens = n
        rc = L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            # Fail what is running rather than the whole engine.
            events.extend(
                self._fail(seq, "ENGINE_FAILED", f"llama_decode failed with code {rc}")
                for seq in list(self.active.values())
            )
            return False
        return True

    def _sample(self, events: list[tuple]) -> None:
        """Sample every sequence whose logits the last decode produced."""
        for seq in list(self.active.values()):
            if seq.batch_index < 0:
                continue
            token = L.llama_sampler_sample(seq.sampler, self.ctx, seq.batch_index)
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
            text = seq.decoder.decode(self.token_bytes(token))
            stopped = self._push_text(seq, text, events)
            if stopped:
                events.append(self._finish(seq, "stop"))
            elif seq.generated >= seq.limit:
                events.extend(self._flush(seq, final=True))
                events.append(self._finish(seq, "length"))

    def _push_text(self, seq: _Sequence, text: str, events: list[tuple]) -> bool:
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

    def _piece(self, seq: _Sequence, text: str) -> tuple:
        event = (
            "token",
            seq.req.request_id,
            text,
            seq.emitted,
            seq.new_tokens,
            len(seq.req.prompt_tokens),
        )
        seq.emitted += 1
        seq.new_tokens = []
        return event

    def _flush(self, seq: _Sequence, final: bool) -> list[tuple]:
        text = seq.pending_text + (seq.decoder.decode(b"", final=True) if final else "")
        seq.pending_text = ""
        if not text:
            return []
        return [self._piece(seq, text)]

    def _release(self, seq: _Sequence) -> None:
        del self.active[seq.req.request_id]
        L.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
        L.llama_sampler_free(seq.sampler)
        self.free_seq_ids.append(seq.seq_id)

    def _finish(self, seq: _Sequence, reason: str) -> tuple:
        self._release(seq)
        now = time.monotonic()
        first = seq.first_token_at or now
        return (
            "done",
            seq.req.request_id,
            reason,
            {"prompt_tokens": len(seq.req.prompt_tokens), "completion_tokens": seq.generated},
            {
                "time_to_first_token": first - seq.req.received_at,
                "decode_seconds": now - first,
                "queue_seconds": seq.admitted_at - seq.req.received_at,
            },
        )

    def _fail(self, seq: _Sequence, code: str, message: str) -> tuple:
        self._release(seq)
        return ("error", seq.req.request_id, code, message)

    def close(self) -> None:
        if self._embed_ctx is not None:
            L.llama_batch_free(self._embed_batch)
            L.llama_free(self._embed_ctx)
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)
