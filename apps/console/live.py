"""The dashboard pushed by changes: no console queries the database unless the fleet changed.

Writers need not know about the console. Every committed INSERT, UPDATE or DELETE on a table
the dashboard shows (nodes, deployments, catalog) pokes this process's announcer, whatever
made it (a service, a conditional claim, a heartbeat, a Celery task). The announcer coalesces
a burst of pokes and tells every web process once, through the Channels group `console`.
There, one Feed per process rebuilds the snapshot once, however many consoles are open, and
each console gets only the sections that changed.

An announcement can be lost (a group message dropped, a console that joined the group just
after it went out), and a console would then show the old state until the next change. So
every announcement also counts up a version in Redis, and a Feed with consoles open compares
it with its snapshot's every WATCH_SECONDS (one Redis GET per process; no database query
unless the version moved).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import re
import threading
import uuid
import weakref

from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction

log = logging.getLogger(__name__)

#: The Channels group every open dashboard joins (the charts' points use it too).
GROUP = "console"
#: Apps whose tables the dashboard shows.
WATCHED_APPS = ("nodes", "deployments", "catalog")
#: A burst of writes within this many seconds is announced once.
COALESCE_SECONDS = 0.2
#: How often a Feed with consoles open checks that it missed no announcement.
WATCH_SECONDS = 5.0
#: An announcement that takes longer is given up (the version has moved: Feeds catch up).
ANNOUNCE_TIMEOUT = 5.0


def _version_key() -> str:
    from controlplane.redis import key

    return key("console", "version")


_WRITE = re.compile(
    r'^\s*(?:(?P<truncate>TRUNCATE)|UPDATE|INSERT\s+INTO|DELETE\s+FROM)\s+"?(?P<table>\w+)"?', re.I
)
_TABLES = re.compile(r'"(\w+)"')
_watched: frozenset[str] = frozenset()


def watch() -> None:
    """Install the write hook on every database connection (AppConfig.ready)."""
    global _watched
    from django.apps import apps
    from django.db.backends.signals import connection_created

    _watched = frozenset(
        m._meta.db_table for label in WATCHED_APPS for m in apps.get_app_config(label).get_models()
    )
    connection_created.connect(_hook, dispatch_uid="console-live-hook")


def _hook(sender, connection, **kwargs) -> None:
    if _on_write not in connection.execute_wrappers:
        connection.execute_wrappers.append(_on_write)


def _on_write(execute, sql, params, many, context):
    result = execute(sql, params, many, context)
    m = _WRITE.match(sql)
    # TRUNCATE names every table it empties; the others write the one they name first.
    tables = (_TABLES.findall(sql) if m["truncate"] else [m["table"]]) if m else ()
    if not _watched.isdisjoint(tables):
        # After the commit (at once in autocommit): readers then see the change.
        transaction.on_commit(announcer.poke, using=context["connection"].alias)
    return result


class _Announcer:
    """A thread of its own per process, so that a write never waits for Redis."""

    def __init__(self):
        self._poked = threading.Event()
        self._quiet = threading.Event()
        self._quiet.set()
        self._pid = 0

    def quiet(self) -> bool:
        """Nothing waits to be announced (tests wait for this before they count)."""
        return self._quiet.is_set()

    def poke(self) -> None:
        if self._pid != os.getpid():  # first poke in this process (or after a fork)
            self._pid = os.getpid()
            self._poked = threading.Event()
            self._quiet = threading.Event()
            threading.Thread(target=self._run, name="console-announcer", daemon=True).start()
        self._quiet.clear()
        self._poked.set()

    def _run(self) -> None:
        from channels.layers import get_channel_layer

        from controlplane.redis import sync_client

        loop = asyncio.new_event_loop()
        layer = get_channel_layer()
        poked, quiet = self._poked, self._quiet
        while True:
            poked.wait()
            loop.run_until_complete(asyncio.sleep(COALESCE_SECONDS))
            poked.clear()
            try:
                sync_client().incr(_version_key())  # first: a Feed that misses the message sees it
                # Every console of a process gets the message; its id lets the Feed count it once.
                change = {"type": "fleet.changed", "id": uuid.uuid4().hex}
                send = layer.group_send(GROUP, change)
                loop.run_until_complete(asyncio.wait_for(send, ANNOUNCE_TIMEOUT))
            except Exception as exc:  # Redis away: the next change announces again
                log.warning("console: could not announce a change (%s)", exc)
            if not poked.is_set():
                quiet.set()


announcer = _Announcer()


class Feed:
    """The dashboard's snapshot in one process, rebuilt once per announced change and shared
    by every console the process serves; kept as JSON per section."""

    def __init__(self):
        self.sections: dict[str, str] = {}  # a new dict whenever something in it changed
        self.version = -1  # the announced version when the snapshot was built (-1: unknown)
        self._stale = True
        self._building: asyncio.Task | None = None
        self._open = 0
        self._seen: collections.deque[str] = collections.deque(maxlen=64)
        self._consoles: weakref.WeakSet = weakref.WeakSet()  # woken by the watch
        self._watching: asyncio.Task | None = None

    def changed(self, change_id: str) -> None:
        """An announced change, delivered once to each console here: the first marks the
        snapshot stale, the others (perhaps after it was rebuilt) change nothing."""
        if change_id in self._seen:
            return
        self._seen.append(change_id)
        self._stale = True

    def join(self, console=None) -> None:
        """A console opened; one that has `catch_up()` is woken when the watch finds a
        change that was not announced here."""
        self._open += 1
        if console is not None:
            self._consoles.add(console)
            if self._watching is None or self._watching.done():
                self._watching = asyncio.ensure_future(self._watch())

    def leave(self, console=None) -> None:
        """A console closed. With none left open, changes reach nobody here: the snapshot
        cannot be trusted any more, and the next console gets a fresh one."""
        self._consoles.discard(console)
        self._open -= 1
        if self._open <= 0:
            self._open = 0
            self._stale = True

    async def _watch(self) -> None:
        while self._consoles:
            await asyncio.sleep(WATCH_SECONDS)
            version = await _version()
            if version is None or version <= self.version:
                continue
            log.info("console: a change was not announced here; catching up")
            self._stale = True
            for console in list(self._consoles):
                try:
                    await console.catch_up()
                except Exception as exc:  # a socket closing now; the others still get it
                    log.info("console: could not catch a console up (%s)", exc)

    async def current(self) -> dict[str, str]:
        """The snapshot with every change heard so far. A rebuild under way is waited for
        even when nothing is stale: it began after a change another console heard of, and
        this console may be hearing of the same one (its id is then not marked again)."""
        while self._stale or self._building is not None:
            if self._building is None:
                self._building = asyncio.ensure_future(self._build())
            await asyncio.shield(self._building)
        return self.sections

    async def _build(self) -> None:
        from channels.db import database_sync_to_async

        from apps.console.services import snapshot

        self._stale = False  # a change during the build makes it stale again
        try:
            version = await _version()  # before the snapshot: later changes count above it
            snap = await database_sync_to_async(snapshot)()
            sections = {k: json.dumps(v, cls=DjangoJSONEncoder) for k, v in snap.items()}
            if sections != self.sections:
                self.sections = sections
            if version is not None:
                self.version = version
        except Exception:
            self._stale = True
            raise
        finally:
            self._building = None


async def _version() -> int | None:
    """The announced changes' count (None when Redis does not answer)."""
    from controlplane.redis import client

    try:
        return int(await client().get(_version_key()) or 0)
    except Exception:
        return None


_feeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def feed() -> Feed:
    """This event loop's Feed (one per web process)."""
    loop = asyncio.get_running_loop()
    f = _feeds.get(loop)
    if f is None:
        f = _feeds[loop] = Feed()
    return f


def message(sections: dict[str, str], key: str = "") -> str:
    """A socket message of JSON sections: the whole snapshot, or {"delta": {...}}."""
    body = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in sections.items()) + "}"
    return "{" + f"{json.dumps(key)}: {body}" + "}" if key else body
