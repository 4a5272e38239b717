"""Database helpers shared by the apps."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import wraps

from asgiref.sync import sync_to_async
from django.db import connection, connections

#: After the database failed to answer, what can be served from this process's last reads
#: (API keys, routing tables) is, for this long, without asking again: each ask would wait
#: out the connection pool's timeout (10 s) while the database is away.
UNREACHABLE_BACKOFF_SECONDS = 10.0
_unreachable_until = 0.0


def database_unreachable() -> bool:
    """Whether the database failed to answer within the last UNREACHABLE_BACKOFF_SECONDS."""
    return time.monotonic() < _unreachable_until


def mark_unreachable() -> None:
    global _unreachable_until
    _unreachable_until = time.monotonic() + UNREACHABLE_BACKOFF_SECONDS


def in_pool_thread(fn: Callable) -> Callable:
    """fn as a coroutine function run in the event loop's pool threads, for database work on
    an async path (API keys on the serving path, usage records).

    Not asgiref's thread-sensitive hop: under ASGI that is a new thread per request, and so
    a new connection. A pool thread keeps its SQLite connection (a file of this machine:
    opening one and registering Django's functions on it costs more than a query; an API
    key's check took 3.0 ms through the request's thread against 1.5 ms here, 2026-12-05);
    with PostgreSQL the connection goes back to the pool after each call. After a failure
    the connection is closed either way, so a retry starts on a new one."""

    def run(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            connections.close_all()
            raise
        if connection.vendor != "sqlite":
            connections.close_all()
        return result

    return wraps(fn)(sync_to_async(run, thread_sensitive=False))


def relaxed_commit() -> None:
    """Inside a transaction: its COMMIT does not wait for the WAL to reach the disk
    (PostgreSQL's synchronous_commit off, for this transaction only). For writes that are
    sent again within seconds anyway, such as heartbeats: a crash can lose the last few
    hundred milliseconds of them, never consistency, and each commit stops costing a flush."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit TO OFF")


def bulk_update(model, objs: list, fields: list[str] | tuple[str, ...]) -> None:
    """Write `fields` of many rows in one statement. On PostgreSQL an UPDATE ... FROM
    (VALUES ...): Django's bulk_update builds one CASE per field with a branch per row, which
    grows with the square of the rows (a second and more for a thousand nodes)."""
    if not objs:
        return
    if connection.vendor != "postgresql":
        model.objects.bulk_update(objs, fields, batch_size=500)
        return
    meta = model._meta
    cols = [meta.get_field(f) for f in fields]
    qn = connection.ops.quote_name
    pk = meta.pk
    values, params = [], []
    for obj in objs:
        values.append("(" + ", ".join(["%s"] * (len(cols) + 1)) + ")")
        params.append(pk.get_db_prep_save(obj.pk, connection))
        params.extend(f.get_db_prep_save(getattr(obj, f.attname), connection) for f in cols)
    names = ", ".join(qn(c) for c in ["pk", *(f.column for f in cols)])
    sets = ", ".join(f"{qn(f.column)} = v.{qn(f.column)}::{f.db_type(connection)}" for f in cols)
    sql = (
        f"UPDATE {qn(meta.db_table)} AS t SET {sets} FROM (VALUES {', '.join(values)}) "
        f"AS v({names}) WHERE t.{qn(pk.column)} = v.{qn('pk')}::{pk.db_type(connection)}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
