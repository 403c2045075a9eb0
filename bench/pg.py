"""(p) The noop lane on PostgreSQL against a raw ``SKIP LOCKED`` claim-and-mark loop on
PostgreSQL, in the same run: the same two loops as part (a) on MySQL (:func:`bench.noop.raw_drain`
and the dispatcher), on a fresh PostgreSQL database loaded the same way."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import psycopg

from bench.db import NOOP_TYPE
from bench.noop import dispatcher_drain, raw_drain
from room_outbox.store.backends.postgres import PostgresStore


@dataclass
class PgNoopResult:
    batch_size: int
    events: int
    dispatcher: float  # events/s
    raw: float


def _admin(server: str, sql: str) -> None:
    with psycopg.connect(f"{server}/postgres", autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql)  # type: ignore[arg-type]


@asynccontextmanager
async def pg_bench_database(server: str, pool_size: int = 4) -> AsyncIterator[PostgresStore]:
    """A migrated, empty database ``ro_bench_<hex>`` and a store on it; dropped at exit."""
    name = f"ro_bench_{uuid.uuid4().hex[:10]}"
    _admin(server, f'CREATE DATABASE "{name}"')
    try:
        store = await PostgresStore.connect(f"{server}/{name}", pool_size=pool_size)
        try:
            await store.migrate()
            yield store
        finally:
            await store.aclose()
    finally:
        _admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def pg_load(store: PostgresStore, count: int, prefix: str, rooms: int = 100, pad: int = 120) -> None:
    """``count`` pending noop rows in one set-based INSERT (generate_series), envelopes valid
    and about the size of a real room event, as :func:`bench.db.load` writes them on MySQL."""
    created = int(time.time() * 1000)
    async with store.transaction() as cur:
        await cur.execute("TRUNCATE room_outbox")
        await cur.execute(
            "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
            " SELECT 'default', %s || g, %s, 'r_' || (g %% %s),"
            ' \'{"event_id":"\' || %s || g || \'","event_type":"\' || %s || \'","app_code":"default",'
            '"room_id":"r_\' || (g %% %s) || \'","room_version":1,"occurred_at_ms":\' || %s || \',\''
            ' || \'"payload":{"user_id":"u1","note":"\' || repeat(\'x\', %s) || \'"}}\', %s, %s'
            " FROM generate_series(1, %s) AS g",
            (prefix, NOOP_TYPE, rooms, prefix, NOOP_TYPE, rooms, created, pad, created, created, count),
        )
    async with store.transaction() as cur:
        await cur.execute("ANALYZE room_outbox")


async def _timed(
    store: PostgresStore, events: int, drain: Callable[[PostgresStore, int], Awaitable[int]], batch: int, prefix: str
) -> float:
    await pg_load(store, events, prefix)
    started = time.perf_counter()
    moved = await drain(store, batch)
    seconds = time.perf_counter() - started
    async with store.transaction() as cur:
        await cur.execute("SELECT COUNT(*) FROM room_outbox WHERE status = 'pending'")
        (left,) = await cur.fetchone()
    assert moved == events and left == 0, (moved, events, left)
    return events / seconds


async def run_pg_noop(store: PostgresStore, events: int, batch_size: int) -> PgNoopResult:
    """Interleaved and each taken at its best of two, as part (a) does."""
    dispatcher = await _timed(store, events, dispatcher_drain, batch_size, "d")  # type: ignore[arg-type]
    raw = await _timed(store, events, raw_drain, batch_size, "r")  # type: ignore[arg-type]
    dispatcher = max(dispatcher, await _timed(store, events, dispatcher_drain, batch_size, "d2"))  # type: ignore[arg-type]
    raw = max(raw, await _timed(store, events, raw_drain, batch_size, "r2"))  # type: ignore[arg-type]
    return PgNoopResult(batch_size, events, dispatcher, raw)
