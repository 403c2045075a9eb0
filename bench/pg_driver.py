"""Which PostgreSQL driver the store uses: asyncpg against psycopg 3 on the store's hot cycle.

``python -m bench.pg_driver [--events N] [--batch B]`` drains the same freshly loaded table
with each driver, in the same run, with the cycle the dispatcher runs: one transaction claims
a batch (``FOR UPDATE SKIP LOCKED`` + lease) and marks the previous batch published with one
fenced ``UPDATE``. Each driver is used the way the store would use it: asyncpg through its own
pool, psycopg 3 through one ``AsyncConnection`` (psycopg_pool is a further dependency).
Prints events/s per driver and the ratio. Run it against a server on the same machine: the
figure is the driver's own cost per round trip, not the network's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable

import asyncpg
import psycopg

SERVER = os.environ.get("ROOM_OUTBOX_TEST_POSTGRESQL", "postgresql://postgres@127.0.0.1:5432")

DDL = """
CREATE TABLE room_outbox (
  id BIGSERIAL PRIMARY KEY, event_id VARCHAR(64) NOT NULL UNIQUE, status VARCHAR(16) NOT NULL DEFAULT 'pending',
  worker_id VARCHAR(128), lock_until_ms BIGINT NOT NULL DEFAULT 0, envelope TEXT NOT NULL
);
CREATE INDEX idx_claim ON room_outbox (status, lock_until_ms, id);
"""
LOAD = "INSERT INTO room_outbox (event_id, envelope) SELECT 'e' || g, repeat('x', 200) FROM generate_series(1, {n}) g"
CLAIM = (
    "SELECT id, envelope FROM room_outbox WHERE status = 'pending' AND lock_until_ms <= {0}"
    " ORDER BY lock_until_ms, id LIMIT {1} FOR UPDATE SKIP LOCKED"
)
LEASE = "UPDATE room_outbox SET worker_id = {0}, lock_until_ms = {1} WHERE id = ANY({2})"
MARK = (
    "UPDATE room_outbox SET status = 'published', worker_id = NULL, lock_until_ms = 0"
    " WHERE id = ANY({0}) AND worker_id = {1} AND status = 'pending'"
)


def _now_ms() -> int:
    return int(time.time() * 1000)


async def asyncpg_drain(dsn: str, batch: int) -> int:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    claim, lease, mark = CLAIM.format("$1", "$2"), LEASE.format("$1", "$2", "$3"), MARK.format("$1", "$2")
    done, previous, n = 0, [], 0
    try:
        while True:
            n += 1
            async with pool.acquire() as conn, conn.transaction():
                if previous:
                    done += int((await conn.execute(mark, previous, f"w#{n - 1}")).split()[-1])
                rows = await conn.fetch(claim, _now_ms(), batch)
                previous = [r[0] for r in rows]
                if previous:
                    await conn.execute(lease, f"w#{n}", _now_ms() + 60_000, previous)
            if not previous:
                return done
    finally:
        await pool.close()


async def psycopg_drain(dsn: str, batch: int) -> int:
    conn = await psycopg.AsyncConnection.connect(dsn)
    claim, lease, mark = CLAIM.format("%s", "%s"), LEASE.format("%s", "%s", "%s"), MARK.format("%s", "%s")
    done, previous, n = 0, [], 0
    try:
        while True:
            n += 1
            async with conn.transaction(), conn.cursor() as cur:
                if previous:
                    await cur.execute(mark, (previous, f"w#{n - 1}"))
                    done += cur.rowcount
                await cur.execute(claim, (_now_ms(), batch))
                previous = [r[0] for r in await cur.fetchall()]
                if previous:
                    await cur.execute(lease, (f"w#{n}", _now_ms() + 60_000, previous))
            if not previous:
                return done
    finally:
        await conn.close()


async def measure(events: int, batch: int) -> dict[str, float]:
    name = f"ro_bench_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(f"{SERVER}/postgres")
    await admin.execute(f'CREATE DATABASE "{name}"')
    rates: dict[str, float] = {}
    try:
        dsn = f"{SERVER}/{name}"
        setup = await asyncpg.connect(dsn)
        await setup.execute(DDL)
        drains: dict[str, Callable[[str, int], Awaitable[int]]] = {"asyncpg": asyncpg_drain, "psycopg": psycopg_drain}
        for round_ in range(2):  # twice each, alternating: the second round is warm for both
            for driver, drain in drains.items():
                await setup.execute("TRUNCATE room_outbox")
                await setup.execute(LOAD.format(n=events))
                await setup.execute("VACUUM ANALYZE room_outbox")
                started = time.perf_counter()
                drained = await drain(dsn, batch)
                assert drained == events, (driver, drained)
                if round_:
                    rates[driver] = events / (time.perf_counter() - started)
        await setup.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pg_driver", description=__doc__)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    rates = asyncio.run(measure(args.events, args.batch))
    for driver, rate in rates.items():
        print(f"{driver:<8} {rate:>9,.0f} ev/s  ({rate / rates['psycopg']:.2f}× psycopg)")


if __name__ == "__main__":
    main()
