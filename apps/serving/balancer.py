"""Replica choice shared by every control-plane process, through Redis.

In-flight generations of a replica are a sorted set of request ids scored by start time, so a
process that dies mid-request does not inflate a count for ever: entries older than the
request timeout no longer count. Round-robin is one shared counter per model.

The prefix policy sends a request where its prompt's KV cache already is. A prompt is a
chain of blocks (each chat message, or 256-character pieces of a raw prompt) and each block
prefix has a hash; Redis remembers which replica last served each prefix hash. The replica
holding the longest known prefix wins; a prompt nobody has seen goes to the least loaded
replica (ties by rendezvous hashing of its first hash, the same in every process): no
replica holds its cache, and conversations spread evenly stay within each replica's slots
(a replica holding more conversations than slots evicts one prefix for another at every
turn). Leading system messages have no hash of their own (they are folded into
the first message after them): a conversation, not its system prompt, is what keeps to one
replica. Every replica's engine copies a system prompt it holds into any slot, so sending
all conversations that share one to one replica would save one evaluation of it and crowd
that replica's slots. Load is bounded by slots: a replica with every slot busy is passed
over for the least loaded one while another has a slot free (a queued request waits for a
whole generation, which costs more than evaluating a prefix again). Nothing short of that
moves a request: on CPUs a decoding step costs what its tokens cost, so one more stream in a
replica's batch costs that stream's own tokens, while a turn sent to another replica
evaluates its whole history again (hundreds of tokens) and delays the prompts queued behind
it there. A bound at 1.25 times the mean in-flight count moved up to 13 of 144 turns a run
in the routing bench and set its slowest quartile; see the README.

Each policy costs one Redis round trip before the first token; nothing on the token path
waits for Redis. A count is written in the background, so this process adds its own counts
still on their way to Redis: a burst of requests arriving together is spread, not sent to
the replica that looked least loaded to all of them. When Redis is unreachable, routing
falls back to this process's own counter rather than refusing to serve.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import logging
import time
import weakref

from django.conf import settings
from redis.exceptions import RedisError

from apps.serving import metrics
from controlplane.redis import client as _redis
from controlplane.redis import key as redis_key

log = logging.getLogger(__name__)

ROUND_ROBIN = "round_robin"
LEAST_CONNECTIONS = "least_connections"
PREFIX = "prefix"

#: Characters per block of a raw prompt.
PROMPT_BLOCK = 256
#: How long a replica is remembered as holding a prefix (its slots' caches turn over).
PREFIX_TTL = 3600
#: Longest chain of blocks looked up (a longer conversation matches on its first ones).
MAX_BLOCKS = 64

_local_counter = itertools.count()
_background: set[asyncio.Task] = set()
#: Request ids this process counted against each replica whose write may not have landed.
_unwritten: collections.defaultdict[str, set[str]] = collections.defaultdict(set)


def _key(replica_id: str) -> str:
    return redis_key("inflight", replica_id)


def prefix_hashes(messages: list[dict], prompt: str) -> list[str]:
    """Hashes of the prompt's block prefixes, shortest first (a chain: each covers all before).

    Chat messages are blocks of their own, so a conversation that resends its history
    shares every earlier hash; leading system messages are folded into the first hash
    after them (see the module's docstring). A raw prompt is cut into
    PROMPT_BLOCK-character blocks.
    """
    if messages:
        blocks = [f"{m.get('role', '')}\x00{m.get('content', '')}" for m in messages]
        lead = next((i for i, m in enumerate(messages) if m.get("role") != "system"), None)
        skip = len(blocks) - 1 if lead is None else lead
    else:
        blocks = [prompt[i : i + PROMPT_BLOCK] for i in range(0, len(prompt), PROMPT_BLOCK)]
        skip = 0
    out, h = [], hashlib.blake2b(digest_size=12)
    for i, block in enumerate(blocks[: MAX_BLOCKS + skip]):
        h.update(block.encode("utf-8", "surrogatepass"))
        h.update(b"\x1e")
        if i >= skip:
            out.append(h.hexdigest())
    return out


def _prefix_key(deployment: str, digest: str) -> str:
    return redis_key("prefix", deployment, digest)


def _by_rendezvous(targets: list, digest: str) -> list:
    """Targets in the order a hash ranks them, stable as replicas come and go (highest
    random weight first)."""
    return sorted(
        targets,
        key=lambda t: hashlib.blake2b(f"{digest}:{t.replica_id}".encode()).digest(),
        reverse=True,
    )


async def order(targets: list, policy: str, model: str, hashes: list[str] = ()) -> list:
    """Targets in the order to try them under the policy."""
    if len(targets) < 2:
        return list(targets)
    deployment = targets[0].deployment
    counted = policy in (LEAST_CONNECTIONS, PREFIX)
    keys = [redis_key("rr", model)]
    if counted:
        keys += [_key(t.replica_id) for t in targets]
    if policy == PREFIX and hashes:
        keys += [_prefix_key(deployment, h) for h in hashes]
    floor = time.time() - settings.REQUEST_TIMEOUT_SECONDS
    try:
        # One command, however many replicas: a pipeline of one ZCOUNT per replica costs
        # more in Python than the round trip itself.
        # This process's counts that may not be written yet: the script counts those not
        # in Redis when it runs; ones made while it ran are added to its answer below.
        sent = {t.replica_id: set(_unwritten.get(t.replica_id, ())) for t in targets}
        args = [floor, len(targets) if counted else 0]
        for t in targets if counted else ():
            args += [len(sent[t.replica_id]), *sent[t.replica_id]]
        reply = await _order_script()(keys=keys, args=args)
        n = len(targets) if counted else 0
        turn, counts, held = reply[0], reply[1 : 1 + n], reply[1 + n :]
    except (RedisError, OSError) as exc:
        log.warning("routing without Redis (%s): round-robin in this process only", exc)
        metrics.ROUTING_FALLBACKS.inc()
        turn, counts, held = next(_local_counter), [], []
    k = turn % len(targets)
    rotated = targets[k:] + targets[:k]
    if not counts:
        return rotated
    load = {
        t.replica_id: c + len(_unwritten.get(t.replica_id, set()) - sent[t.replica_id])
        for t, c in zip(targets, counts, strict=True)
    }
    rotated.sort(key=lambda t: load[t.replica_id])  # stable: ties keep round-robin order
    if policy != PREFIX or not hashes:
        return rotated
    by_id = {t.replica_id: t for t in targets}
    # The replica that served the longest prefix, else the least loaded (ties by hash).
    known = [h.decode() for h in held if h]
    preferred = next((by_id[r] for r in reversed(known) if r in by_id), None)
    hit = preferred is not None
    if preferred is None:
        preferred = min(_by_rendezvous(targets, hashes[0]), key=lambda t: load[t.replica_id])
    # Bounded by slots (see the module's docstring); a replica of unknown slots has no bound.
    if load[preferred.replica_id] >= (preferred.slots or 1 << 30) and any(
        load[t.replica_id] < (t.slots or 1 << 30) for t in targets if t is not preferred
    ):
        metrics.PREFIX_ROUTING.labels("overloaded").inc()
        return rotated
    metrics.PREFIX_ROUTING.labels("hit" if hit else "hashed").inc()
    return [preferred] + [t for t in rotated if t is not preferred]


#: KEYS: the round-robin counter, then N in-flight sets, then prefix keys; ARGV: the floor of
#: live entries, N, then per set the number of this process's ids that may not have been
#: written yet and those ids (each counts unless the set already has it). Returns the
#: counter, N counts, then the prefix holders (nil if unknown).
_ORDER_SCRIPT = """
local n = tonumber(ARGV[2])
local out = {redis.call('INCR', KEYS[1])}
local a = 3
for i = 2, n + 1 do
  local c = redis.call('ZCOUNT', KEYS[i], ARGV[1], '+inf')
  local k = tonumber(ARGV[a])
  for j = a + 1, a + k do
    if not redis.call('ZSCORE', KEYS[i], ARGV[j]) then c = c + 1 end
  end
  a = a + k + 1
  out[#out + 1] = c
end
for i = n + 2, #KEYS do out[#out + 1] = redis.call('GET', KEYS[i]) end
return out
"""


_scripts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _order_script():
    """The script registered with the running loop's client (EVALSHA, loaded on first use)."""
    client = _redis()
    script = _scripts.get(client)
    if script is None:
        script = _scripts[client] = client.register_script(_ORDER_SCRIPT)
    return script


def remember(deployment: str, hashes: list[str], replica_id: str) -> None:
    """Note that a replica now holds these prefixes (in the background, off the hot path)."""
    if not hashes:
        return

    async def _remember():
        try:
            pipe = _redis().pipeline(transaction=False)
            for h in hashes:
                pipe.set(_prefix_key(deployment, h), replica_id, ex=PREFIX_TTL)
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("could not record prefixes in Redis: %s", exc)

    _spawn(_remember())


def _spawn(coro) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def in_flight(replica_ids: list[str]) -> dict[str, int]:
    """Shared in-flight counts (for the API and tests)."""
    floor = time.time() - settings.REQUEST_TIMEOUT_SECONDS
    pipe = _redis().pipeline(transaction=False)
    for rid in replica_ids:
        pipe.zcount(_key(rid), floor, "+inf")
    return dict(zip(replica_ids, await pipe.execute(), strict=True))


#: Counts being written, so that a release never runs before its acquire.
_acquiring: dict[tuple[str, str], asyncio.Task] = {}


def acquire(replica_id: str, request_id: str) -> None:
    """Count a generation against a replica, in the background: a slow Redis must not
    delay the first token (the count is a routing hint, not a lock)."""

    async def _acquire():
        try:
            pipe = _redis().pipeline(transaction=False)
            pipe.zadd(_key(replica_id), {request_id: time.time()})
            pipe.expire(_key(replica_id), int(settings.REQUEST_TIMEOUT_SECONDS) + 60)
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("could not count a request in Redis: %s", exc)
        finally:
            pending = _unwritten[replica_id]
            pending.discard(request_id)
            if not pending:
                del _unwritten[replica_id]

    _unwritten[replica_id].add(request_id)

    key = (replica_id, request_id)
    task = _spawn(_acquire())
    _acquiring[key] = task
    task.add_done_callback(lambda _t: _acquiring.pop(key, None))


def release(replica_id: str, request_id: str) -> None:
    """Stop counting it; runs in the background so that a cancelled stream still releases."""
    pending = _acquiring.get((replica_id, request_id))

    async def _release():
        if pending is not None:
            await asyncio.wait([pending])  # counted before it is uncounted
        try:
            await _redis().zrem(_key(replica_id), request_id)
        except (RedisError, OSError) as exc:
            log.warning("could not release a request in Redis: %s", exc)

    _spawn(_release())
