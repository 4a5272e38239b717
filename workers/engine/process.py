"""The engine child process and the agent-side handle that supervises it.

llama.cpp aborts the whole process on some failures (a dead RPC peer, a bad tensor), with
no Python exception to catch. So each replica's model lives in its own process; the agent
talks to it over a pipe and learns of its death from the pipe closing.

What crosses the pipe is defined in workers.engine.events.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from workers.engine import errors
from workers.engine.errors import EngineError
from workers.engine.events import (
    Batch,
    CacheSize,
    Cancel,
    Done,
    Embed,
    Embeddings,
    Error,
    Generate,
    LoadError,
    Ready,
    Shutdown,
    Threads,
    Token,
    Tokenize,
    Tokens,
)

log = logging.getLogger(__name__)

_ids = itertools.count(1)


#: Host RAM per replica for prompt prefixes pushed out of its slots (llama-server keeps
#: 8 GiB per server): the agent's --prompt-cache-mib default, here because the agent side
#: must not import the engine core (it loads llama.cpp).
PROMPT_CACHE_MIB = 512
#: The agent's --flash-attn choices (core.FLASH_ATTN_MODES, for the same reason).
FLASH_ATTN_MODES = ("auto", "on", "off")


@dataclass
class EngineConfig:
    """What an engine process needs to load a model."""

    model_path: str
    context_length: int
    parallel: int
    threads: int
    max_queue: int = 64
    chat_template: str = ""  # used when the file has none
    stream_interval: float = 0.0  # seconds; see Outbox
    rpc_servers: list[str] = field(default_factory=list)  # host:port of the stages, in order
    n_gpu_layers: int = -1
    split_mode: int = 1  # LLAMA_SPLIT_MODE_LAYER; 3 is tensor parallel
    tensor_split: list[float] = field(default_factory=list)
    batch_invariant: bool = False  # see BatchEngine
    host_cache_bytes: int = PROMPT_CACHE_MIB << 20  # for prefixes pushed out of slots
    flash_attn: str = "auto"  # for whole replicas in the throughput mode; see BatchEngine
    swa_full: bool = True  # a sliding-window model's KV kept whole (not in the invariant
    # mode; see BatchEngine)


# ---- child side ----------------------------------------------------------------------

#: Idle seconds before the engine copies finished conversations to host RAM (save_ahead):
#: a request sent right after another's end (the next step of a tool-calling loop, a
#: benchmark's next turn) mostly continues in its slot and must not wait for a copy.
SAVE_AHEAD_AFTER = 0.1


def _quiet_llama_logs() -> None:
    """Keep llama.cpp's warnings and errors on stderr, drop its chatter."""
    import llama_cpp as L

    @L.llama_log_callback
    def _log(level, text, _user_data):
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
            os.write(2, text)

    L.llama_log_set(_log, None)
    _quiet_llama_logs.callback = _log  # keep a reference for the process's lifetime


def _build_prompt(engine, formatter, payload: dict) -> list[int]:
    """Tokenize a request the way llama-cpp-python's Llama does, so outputs match it."""
    if payload.get("messages"):
        if formatter is None:
            raise EngineError(
                errors.INVALID_ARGUMENT, "this model has no chat template; send a prompt"
            )
        messages, tools = payload["messages"], payload.get("tools")
        if tools and "tools" not in (formatter.template or ""):
            messages, tools = describe_tools(messages, tools), None
        try:
            rendered = formatter(messages=messages, tools=tools).prompt
        except Exception as exc:  # a template may raise_exception() on bad roles
            raise EngineError(errors.INVALID_ARGUMENT, f"chat template: {exc}") from exc
        return engine.tokenize(rendered, add_bos=False, special=True)
    return engine.tokenize(payload.get("prompt", ""), add_bos=True, special=True)


def describe_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For a template that knows no tools: the functions described in a system message, past
    calls as the JSON the model would write, results as user turns (templates that know no
    tools often accept only system, user and assistant)."""
    import json

    lines = [
        "You can call these functions. To call one, answer with only a JSON object "
        '{"name": <function name>, "arguments": <object of its parameters>}.'
    ]
    for t in tools:
        f = t.get("function", {})
        lines.append(
            f"- {f.get('name')}: {f.get('description', '')} "
            f"Parameters (JSON schema): {json.dumps(f.get('parameters', {}))}"
        )
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in m["tool_calls"]
            ]
            text = json.dumps(calls[0] if len(calls) == 1 else calls)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"Function result: {m['content']}"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + "\n".join(lines)}
    else:
        out.insert(0, {"role": "system", "content": "\n".join(lines)})
    return out


#: The longest a stream's pieces are held (see Outbox), unless the agent asks for longer.
MAX_HOLD = 0.1
#: The agent's --stream-interval-ms default (see Outbox). Every message costs the agent, the
#: web process and the client about a millisecond of CPU on the cores the decode threads
#: use: one stream decoded 4-6% faster at 50 ms than at 20 (91.2 against 86.3 and 88.3
#: against 84.8 tokens/s, alternating in one run each, 2026-12-05). 50 ms is 20 messages a
#: second, still a smooth stream to read; with many streams Outbox holds up to MAX_HOLD.
STREAM_INTERVAL_MS = 50.0


class Outbox:
    """Sends engine events to the agent, merging text a request produces in quick succession.

    A request's first piece goes at once (time to first token). Later pieces wait until
    `interval` seconds have passed since its last send, so fast decoding costs one message
    per few tokens all along the chain (pipe, gRPC, SSE) instead of one per token; a slow
    one is not delayed at all. Done and error events flush what is held first.

    The wait grows with the streams in flight (interval x streams, at most MAX_HOLD): the
    engine then sends about as many messages a second whatever its load, and the agent, the
    web process and the client, which share the cores with the decode threads, do not
    spend more on messages when those cores are busiest. Measured with 8 streams on 2
    cores: 0.47 CPU-seconds in the agent and web process per 1,024 tokens at a fixed
    20 ms, 0.27 at 100 ms.

    Events go out together once per decode step (`tick`): with many streams the agent then
    wakes once a step, not once a stream, and every wake-up on a machine whose cores the
    decode threads fill stalls the step that it preempts.
    """

    def __init__(self, conn, interval: float, clock=time.monotonic):
        self.conn = conn
        self.interval = interval
        self.clock = clock
        self.held: dict[str, Token] = {}  # id -> its pieces not sent yet, as one
        self.last: dict[str, float] = {}  # id -> time of its last piece
        self.index: dict[str, int] = {}  # id -> index of its next piece
        self.pending: list = []  # events of this step, sent by tick()

    def send(self, event: Token | Done | Error) -> None:
        rid = event.id
        if isinstance(event, Token):
            held = self.held.get(rid)
            if held is None:  # the engine hands each piece over: kept as it is, no copy
                self.held[rid] = event
            else:
                held.text += event.text
                held.token_ids.extend(event.token_ids)
                held.logprobs.extend(event.logprobs)
            now = self.clock()
            if now - self.last.get(rid, float("-inf")) >= self.hold():
                self._flush(rid, now)
            return
        self._flush(rid, 0.0)
        self.last.pop(rid, None)
        self.index.pop(rid, None)
        self.pending.append(event)

    def tick(self) -> None:
        """Send this step's events, with held pieces that waited long enough (called after
        every decode step and after reading the agent's messages)."""
        now, hold = self.clock(), self.hold()
        for rid in [r for r in self.held if now - self.last.get(r, 0.0) >= hold]:
            self._flush(rid, now)
        if len(self.pending) == 1:
            self.conn.send(self.pending[0])
        elif self.pending:
            self.conn.send(Batch(self.pending))
        self.pending = []

    def hold(self) -> float:
        """How long a stream's pieces wait now: the interval once per stream in flight."""
        return min(self.interval * max(1, len(self.last)), max(self.interval, MAX_HOLD))

    def _flush(self, rid: str, now: float) -> None:
        held = self.held.pop(rid, None)
        if held is None:
            return
        held.index = self.index.get(rid, 0)
        self.index[rid] = held.index + 1
        self.last[rid] = now
        self.pending.append(held)


def _request(engine, formatter, rid: str, payload: dict):
    """The engine's Request for a Generate payload; raises EngineError for a bad one."""
    from workers.engine.core import Request, Sampling
    from workers.engine.grammar import grammar_for_schema

    tokens = _build_prompt(engine, formatter, payload)
    s = dict(payload.get("sampling") or {})
    if payload.get("json_schema"):
        s["grammar"] = grammar_for_schema(payload["json_schema"])
    return Request(
        request_id=rid,
        prompt_tokens=tokens,
        max_tokens=int(payload.get("max_tokens") or 0),
        sampling=Sampling(**s),
        stop=list(payload.get("stop") or []),
        received_at=float(payload.get("sent_at") or time.monotonic()),
        resume_tokens=list(payload.get("resume_tokens") or []),
        delivered_bytes=int(payload.get("delivered_bytes") or 0),
        cache_prompt=bool(payload.get("cache_prompt", True)),
        logprobs=int(payload.get("logprobs", -1)),
        n=int(payload.get("n") or 1),
    )


def child_main(conn, config: EngineConfig) -> None:
    """Entry point of the engine process: load, then serve the pipe until told to stop."""
    # The agent decides when we stop: a signal to the whole process group (Ctrl-C, `make
    # stop`, systemd) must not end streams the agent is draining. A dead agent closes the
    # pipe, and that ends us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _quiet_llama_logs()
    loaded = _load(conn, config)
    if loaded is None:
        return
    engine, formatter = loaded
    out = Outbox(conn, config.stream_interval)
    running = True
    while running:
        # Block while idle; between decode steps only look at what is already there.
        timeout = None if engine.idle() else 0
        if timeout is None and not conn.poll(SAVE_AHEAD_AFTER):
            # Idle a while: copy slots to host RAM ahead of need, one at a time while
            # nothing arrives (a follow-up sent at once never waits for such a copy).
            held = engine.host.bytes
            while not conn.poll(0) and engine.save_ahead():
                pass
            if engine.host.bytes != held:  # the agent reports it as memory taken
                conn.send(CacheSize(engine.host.bytes))
        while conn.poll(timeout):
            running = _handle(conn.recv(), engine, formatter, conn, out)
            if not running:
                break
            timeout = 0
        out.tick()  # errors and cancellations of the messages just read
        if running and not engine.idle():
            for event in engine.step():
                out.send(event)
            out.tick()
    engine.close()


def _load(conn, config: EngineConfig):
    """The engine and its chat formatter, after telling the agent Ready; None (after a
    LoadError) when the model does not load."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from workers.engine.core import BatchEngine

    started = time.monotonic()
    try:
        engine = BatchEngine(
            config.model_path,
            config.context_length,
            config.parallel,
            config.threads,
            config.max_queue,
            rpc_servers=config.rpc_servers,
            n_gpu_layers=config.n_gpu_layers,
            split_mode=config.split_mode,
            tensor_split=config.tensor_split,
            batch_invariant=config.batch_invariant,
            host_cache_bytes=config.host_cache_bytes,
            flash_attn=config.flash_attn,
            swa_full=config.swa_full,
        )
    except EngineError as exc:
        conn.send(LoadError(exc.code, exc.message))
        return None
    except Exception as exc:
        conn.send(LoadError(errors.ENGINE_FAILED, f"{type(exc).__name__}: {exc}"))
        return None
    template = engine.meta("tokenizer.chat_template") or config.chat_template
    formatter = None
    if template:
        formatter = Jinja2ChatFormatter(
            template=template, eos_token=engine.eos_text(), bos_token=engine.bos_text()
        )
    conn.send(
        Ready(
            {
                "context_length": engine.context_length,
                "parallel": engine.parallel,
                "load_seconds": time.monotonic() - started,
                "chat_template": bool(template),
                "flash_attn": engine.flash_attn,
                "swa_full": engine.swa_full,
            }
        )
    )
    return engine, formatter


def _handle(msg, engine, formatter, conn, out: Outbox) -> bool:
    """One message from the agent; False once told to shut down."""
    match msg:
        case Generate(id=rid, payload=payload):
            try:
                engine.submit(_request(engine, formatter, rid, payload))
            except EngineError as exc:
                out.send(Error(rid, exc.code, exc.message))
        case Cancel(id=rid):
            for event in engine.cancel(rid):
                out.send(event)
        case Tokenize(id=cid, payload=payload):
            try:
                if payload.get("messages"):
                    tokens = _build_prompt(engine, formatter, payload)
                else:
                    tokens = engine.tokenize(payload.get("text", ""), True, True)
                conn.send(Tokens(cid, tokens, engine.context_length))
            except EngineError as exc:
                conn.send(Error(cid, exc.code, exc.message))
        case Embed(id=cid, texts=texts):
            try:
                vectors, n_tokens = engine.embed(texts)
                conn.send(Embeddings(cid, vectors, n_tokens))
            except EngineError as exc:
                conn.send(Error(cid, exc.code, exc.message))
        case Threads(n=n):
            engine.set_threads(n)
        case Shutdown():
            return False
    return True


# ---- agent side ----------------------------------------------------------------------


def describe_exit(exitcode: int | None) -> str:
    """Say in words how a process ended."""
    if exitcode is None:
        return "the engine process stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (llama.cpp aborted)" if -exitcode == signal.SIGABRT else ""
        return f"the engine process was killed by {name}{hint}"
    return f"the engine process exited with code {exitcode}"


class EngineProcess:
    """Agent-side handle of one engine process: start, stream, cancel, notice death."""

    def __init__(
        self,
        config: EngineConfig,
        on_state_change: Callable[[EngineProcess], None] | None = None,
        on_busy_change: Callable[[EngineProcess], None] | None = None,
    ):
        """on_busy_change is called when the engine starts generating after being idle and
        when its last generation ends, before the first one is sent (see set_threads)."""
        self.config = config
        self.state = "loading"
        self.error = ""
        self.info: dict = {}
        #: Threads the engine decodes with: the config's until set_threads changes it.
        self.threads = config.threads
        self.generating = 0  # generations in flight (not tokenize or embed calls)
        #: Host RAM the engine's prompt cache holds, as of its last Done or CacheSize.
        self.host_cache_bytes = 0
        self._on_state_change = on_state_change
        self._on_busy_change = on_busy_change
        self._streams: dict[str, asyncio.Queue] = {}
        self._ready: asyncio.Future | None = None
        self._proc = None
        self._conn = None
        self._stopping = False

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else 0

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def memory_bytes(self) -> int:
        """Resident memory of the engine process (0 when it is not running)."""
        pid = self.pid
        if not pid or self.state not in ("loading", "ready"):
            return 0
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    async def start(self, timeout: float = 300.0) -> dict:
        """Spawn the process and wait until the model is loaded; raises EngineError."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._ready = loop.create_future()
        # spawn, not fork: the agent runs gRPC threads that must not be forked.
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._conn = parent
        self._proc = ctx.Process(
            target=child_main, args=(child, self.config), name="llamafleet-engine", daemon=True
        )
        self._proc.start()
        child.close()
        # Read the pipe on the loop itself: no thread hop per message.
        loop.add_reader(parent.fileno(), self._on_readable)
        try:
            self.info = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            self._kill()
            self._set_failed(f"the model did not load within {timeout:.0f} s")
            raise EngineError(errors.ENGINE_FAILED, self.error) from None
        self.state = "ready"
        self._notify()
        return self.info

    def _on_readable(self) -> None:
        conn = self._conn
        try:
            while conn.poll(0):
                self._dispatch(conn.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(conn.fileno())
            self._reaper = self._loop.create_task(self._reap())

    async def _reap(self) -> None:
        """The pipe closed: wait for the process to end and say how it did."""
        await asyncio.to_thread(self._proc.join, 5)
        self._on_gone(self._proc.exitcode)

    def _dispatch(self, msg) -> None:
        match msg:
            case Batch(events=events):
                for event in events:
                    self._dispatch(event)
            case CacheSize(bytes=n):
                self.host_cache_bytes = n
            case Ready(info=info):
                if not self._ready.done():
                    self._ready.set_result(info)
            case LoadError(code=code, message=message):
                self._set_failed(message)
                if not self._ready.done():
                    self._ready.set_exception(EngineError(code, message))
            case _:
                if isinstance(msg, Done):
                    self.host_cache_bytes = msg.usage.get("host_cache_bytes", 0)
                queue = self._streams.get(msg.id.partition("#")[0])  # "<id>#<k>": choice k
                if queue is not None:
                    queue.put_nowait(msg)

    def _on_gone(self, exitcode: int | None) -> None:
        if self._stopping:
            self.state = "stopped"
            message = "the replica was freed"
        else:
            if self.state != "failed":
                self._set_failed(describe_exit(exitcode))
            message = self.error
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineError(errors.ENGINE_FAILED, message))
        for rid, queue in list(self._streams.items()):
            queue.put_nowait(Error(rid, errors.ENGINE_FAILED, message))

    def _set_failed(self, error: str) -> None:
        self.state = "failed"
        self.error = error
        log.warning("engine for %s failed: %s", self.config.model_path, error)
        self._notify()

    def _notify(self) -> None:
        if self._on_state_change is not None:
            self._on_state_change(self)

    def _send(self, msg) -> None:
        """Raises EngineError (ENGINE_FAILED) when the process is gone. Its pipe closes the
        moment it dies, before the loop reads the end and _on_gone fails its streams: a
        request sent in between is the dead replica's failure (the caller tries another
        replica), not an unexpected error the caller would pass on to its client."""
        # Only coroutines on the agent's loop send, so sends never interleave.
        try:
            self._conn.send(msg)
        except OSError as exc:
            raise EngineError(errors.ENGINE_FAILED, f"the engine process is gone ({exc})") from None

    def set_threads(self, n: int) -> None:
        """Decode with n threads from the engine's next step on."""
        if n != self.threads and self.state == "ready":
            self.threads = n
            with contextlib.suppress(EngineError):  # the process is gone; _on_gone says so
                self._send(Threads(n))

    def _busy(self, delta: int) -> None:
        self.generating += delta
        if self._on_busy_change is not None and self.generating == (1 if delta > 0 else 0):
            self._on_busy_change(self)

    def _require_ready(self) -> None:
        if self.state != "ready":
            raise EngineError(
                errors.ENGINE_FAILED, self.error or f"the replica is {self.state}, not ready"
            )

    async def generate(self, payload: dict) -> AsyncIterator[Token | Done]:
        """Yield Token events, then one Done event per choice; choice k > 0 of a request
        with n choices has events whose id ends in "#k". Raises EngineError."""
        self._require_ready()
        rid = f"g{next(_ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        finished = False
        remaining = int(payload.get("n") or 1)
        self._busy(+1)  # a thread count set now reaches the engine before this request
        try:
            # Its clock starts here, not when the engine reads it: a request that arrives
            # during a step waits in the pipe until the step ends, and that wait belongs to
            # its time to first token (CLOCK_MONOTONIC is the machine's, shared by both).
            self._send(Generate(rid, {**payload, "sent_at": time.monotonic()}))
            while True:
                msg = await queue.get()
                if isinstance(msg, Error):
                    finished = True
                    raise EngineError(msg.code, msg.message)
                if isinstance(msg, Done):
                    remaining -= 1
                    finished = remaining == 0
                    yield msg
                    if finished:
                        return
                    continue
                yield msg
        finally:
            del self._streams[rid]
            if not finished and self.state == "ready":
                # The caller went away: free the slot now, not at the end of the text.
                with contextlib.suppress(EngineError):
                    self._send(Cancel(rid))
            self._busy(-1)

    async def tokenize(self, payload: dict) -> tuple[list[int], int]:
        msg = await self._ask(Tokenize(f"q{next(_ids)}", payload))
        return msg.tokens, msg.context_length

    async def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        msg = await self._ask(Embed(f"q{next(_ids)}", texts))
        return msg.vectors, msg.n_tokens

    async def _ask(self, question: Tokenize | Embed) -> Tokens | Embeddings:
        """One request, one answer (or an error) from the engine process."""
        self._require_ready()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[question.id] = queue
        try:
            self._send(question)
            msg = await queue.get()
        finally:
            del self._streams[question.id]
        if isinstance(msg, Error):
            raise EngineError(msg.code, msg.message)
        return msg

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the process to exit, then kill it if it does not."""
        self._stopping = True
        self.state = "stopping"
        if self._proc is None:
            return
        if self._proc.is_alive():
            with contextlib.suppress(EngineError):
                self._send(Shutdown())
            # join() blocks: wait in a thread so the agent keeps serving other replicas.
            await asyncio.to_thread(self._proc.join, timeout)
            self._kill()
        self.state = "stopped"

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
