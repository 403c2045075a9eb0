"""(d) Claim cost as the table grows, and retention running beside delivery.

The claim query is timed on 1,000 pending rows behind 1,000,000 published ones and on the
same 1,000 pending rows alone; ``Handler_read_*`` counts show how many index entries it read.
Then delivery (noop lane) drains a backlog alone, and again while ``room-outbox cleanup``
removes the published rows in another process.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import dataclass

import anyio

from bench import procs
from bench.db import DAY_MS, load, pending
from bench.noop import dispatcher_drain
from room_outbox.store.backends.leased import now_ms
from room_outbox.store.backends.mysql import CLAIM_SQL, MySQLStore


async def claim_times(store: MySQLStore, rounds: int, batch_size: int = 100) -> tuple[float, int]:
    """Median ms of the claim query (rolled back, so every round sees the same rows) and the
    index entries one claim reads."""
    times = []
    reads = 0
    for _ in range(rounds):
        conn = await store._pool.acquire()  # the raw connection: to roll back, not commit
        try:
            async with conn.cursor() as cur:
                await cur.execute("SHOW SESSION STATUS LIKE 'Handler_read%%'")
                before = sum(int(v) for _, v in await cur.fetchall())
                started = time.perf_counter()
                await cur.execute(CLAIM_SQL, (now_ms(), batch_size))
                await cur.fetchall()
                times.append((time.perf_counter() - started) * 1000)
                await cur.execute("SHOW SESSION STATUS LIKE 'Handler_read%%'")
                reads = sum(int(v) for _, v in await cur.fetchall()) - before
            await conn.rollback()
        finally:
            store._pool.release(conn)
    return statistics.median(times), reads


@dataclass
class ClaimResult:
    published: int
    empty_ms: float
    empty_reads: int
    full_ms: float
    full_reads: int
    load_seconds: float


async def run_claim(empty: MySQLStore, full: MySQLStore, published: int, rounds: int) -> ClaimResult:
    await load(empty, 1000, prefix="e")
    started = time.monotonic()
    await load(full, published, prefix="p", status="published", age_ms=30 * DAY_MS)
    load_seconds = time.monotonic() - started
    await load(full, 1000, prefix="e")
    async with full.transaction() as cur:
        await cur.execute("ANALYZE TABLE room_outbox")
        await cur.fetchall()
    e_ms, e_reads = await claim_times(empty, rounds)
    f_ms, f_reads = await claim_times(full, rounds)
    e_ms = min(e_ms, (await claim_times(empty, rounds))[0])  # interleaved second pass: noise
    f_ms = min(f_ms, (await claim_times(full, rounds))[0])
    return ClaimResult(published, e_ms, e_reads, f_ms, f_reads, load_seconds)


@dataclass
class RetentionResult:
    events: int
    alone: float  # events/s
    with_cleanup: float
    cleanup_rows_per_s: float


async def run_retention(full: MySQLStore, dsn: str, events: int, batch_size: int = 100) -> RetentionResult:
    """Needs ``full`` loaded by :func:`run_claim` (published rows 30 days old)."""
    await load(full, events, prefix="ra")
    started = time.perf_counter()
    await dispatcher_drain(full, batch_size)
    alone = events / (time.perf_counter() - started)
    before = await _old_rows(full)
    await load(full, events, prefix="rb")
    cleaner = procs.room_outbox(
        "cleanup",
        "--older-than",
        "168h",
        env={"ROOM_OUTBOX__MYSQL__DSN": dsn, "ROOM_OUTBOX__LOG__LEVEL": "WARNING"},
        stdout=subprocess.DEVNULL,
    )
    try:
        cleanup_started = time.perf_counter()
        # let it get going (its first batches removed) before delivery starts
        while await _old_rows(full) > before - 2000 and cleaner.poll() is None:
            await anyio.sleep(0.05)
        started = time.perf_counter()
        await dispatcher_drain(full, batch_size)
        with_cleanup = events / (time.perf_counter() - started)
        running = cleaner.poll() is None
        removed = before - await _old_rows(full)
        cleanup_rate = removed / (time.perf_counter() - cleanup_started)
    finally:
        procs.stop(cleaner)
    assert await pending(full) == 0
    return RetentionResult(events, alone, with_cleanup if running else -with_cleanup, cleanup_rate)


async def _old_rows(store: MySQLStore) -> int:
    async with store.transaction() as cur:
        await cur.execute(
            "SELECT COUNT(*) FROM room_outbox WHERE status = 'published' AND created_at_ms < %s",
            (now_ms() - 7 * DAY_MS,),
        )
        return int((await cur.fetchone())[0])
