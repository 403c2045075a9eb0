"""Databases for the benchmarks: created fresh, loaded fast, dropped afterwards."""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pymysql

from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore

#: Event types: the noop sink's (no I/O) and one the Tencent IM sink takes.
NOOP_TYPE = "RoomHeatChanged"
IM_TYPE = "RoomUserJoined"
DAY_MS = 86_400_000
#: Loading millions of rows takes statements far longer than a service's query_timeout.
BULK_QUERY_TIMEOUT = 600.0


def admin(server: str, sql: str) -> None:
    address = MySQLAddress.from_dsn(f"{server}/mysql")
    conn = pymysql.connect(
        host=address.host, port=address.port, user=address.user, password=address.password, read_timeout=60
    )
    try:
        with conn.cursor() as cur:
            cur.execute("SET SESSION lock_wait_timeout = 30")  # a leaked session fails, never hangs
            cur.execute(sql)
    finally:
        conn.close()


@asynccontextmanager
async def bench_database(server: str, pool_size: int = 4) -> AsyncIterator[tuple[str, MySQLStore]]:
    """A migrated, empty database ``ro_bench_<hex>`` and a store on it; dropped at exit."""
    name = f"ro_bench_{uuid.uuid4().hex[:10]}"
    admin(server, f"CREATE DATABASE `{name}`")
    dsn = f"{server}/{name}"
    try:
        store = await MySQLStore.connect(dsn, pool_size=pool_size, query_timeout=BULK_QUERY_TIMEOUT)
        try:
            await store.migrate()
            yield dsn, store
        finally:
            await store.aclose()
    finally:
        admin(server, f"DROP DATABASE IF EXISTS `{name}`")


async def load(
    store: MySQLStore,
    count: int,
    *,
    prefix: str,
    event_type: str = NOOP_TYPE,
    status: str = "pending",
    age_ms: int = 0,
    rooms: int = 100,
    pad: int = 120,
) -> None:
    """Insert ``count`` rows with set-based INSERT … SELECT over a 1,000-row numbers table
    (100,000 rows per statement), never row by row. Envelopes are valid and match their row;
    ``pad`` bytes of payload make them about the size of a real room event (~300 bytes)."""
    created = int(time.time() * 1000) - age_ms
    async with store.transaction() as cur:
        with warnings.catch_warnings():  # "already exists" is the expected case
            warnings.simplefilter("ignore")
            await cur.execute("CREATE TABLE IF NOT EXISTS bench_numbers (n INT PRIMARY KEY) ENGINE=InnoDB")
        await cur.execute("SELECT COUNT(*) FROM bench_numbers")
        if (await cur.fetchone())[0] < 1000:
            await cur.executemany("INSERT IGNORE INTO bench_numbers VALUES (%s)", [(n,) for n in range(1000)])
    event_id = "CONCAT(%s, a.n * 1000 + b.n)"
    envelope = (
        f'CONCAT(\'{{"event_id":"\', {event_id}, \'","event_type":"{event_type}","app_code":"default",'
        f'"room_id":"r_\', MOD(a.n * 1000 + b.n, {rooms}), \'","room_version":1,"occurred_at_ms":{created},'
        f'"payload":{{"user_id":"u1","note":"\', REPEAT(\'x\', {pad}), \'"}}}}\')'
    )
    for first in range(0, (count + 999) // 1000, 100):
        async with store.transaction() as cur:
            await cur.execute(
                "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, status,"
                " created_at_ms, updated_at_ms)"
                f" SELECT 'default', {event_id}, %s, CONCAT('r_', MOD(a.n * 1000 + b.n, {rooms})), {envelope},"
                " %s, %s, %s FROM bench_numbers a CROSS JOIN bench_numbers b"
                " WHERE a.n >= %s AND a.n < %s AND a.n * 1000 + b.n < %s ORDER BY a.n, b.n",
                (prefix, event_type, prefix, status, created, created, first, first + 100, count),
            )


async def pending(store: MySQLStore) -> int:
    async with store.transaction() as cur:
        await cur.execute("SELECT COUNT(*) FROM room_outbox WHERE status = 'pending'")
        return int((await cur.fetchone())[0])


async def reset(store: MySQLStore) -> None:
    async with store.transaction() as cur:
        await cur.execute("TRUNCATE TABLE room_outbox")
