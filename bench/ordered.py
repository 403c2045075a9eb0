"""(o) Per-room ordering with several processes: the noop lane drained by 1, 2 and 3
``room-outbox run`` processes on one table, measured from the outside (the pending count),
for few hot rooms (50), rooms as many as a batch (500) and many rooms (5,000), at batch 100
and 500; and the unordered lane beside it, which must not lose from the buckets.

Per configuration the process count goes 1, 2, 3, then 3, 2, 1 (a process joins, or stops
and gives its buckets up, and the buckets are rebalanced and claimable before the next
measurement): each count is measured twice, once on the way up and once on the way down, so a
machine load that rises or falls steadily during the run weighs on every count alike; the
figure is the mean of the two. Each measurement loads its rows held back (status
``bench_hold``) and releases them in one statement, so every process sees the whole backlog
at once.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from bench import procs
from bench.db import load, pending, reset
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.schema.buckets import BUCKET_TABLE, BUCKETS

HOLD = "bench_hold"
#: Older than the shipped ``claim_after`` (5 s): a backlog the producer did not push, claimed
#: at once (fresh rows would be timed mostly waiting for claim_after).
AGE_MS = 60_000


@dataclass
class OrderedResult:
    ordering: str
    batch_size: int
    rooms: int
    processes: int
    rates: list[float]  # events/s, one per measurement (up, then down)

    @property
    def rate(self) -> float:
        return sum(self.rates) / len(self.rates)


#: The process counts in the order they are measured: up, then down.
def counts(max_processes: int) -> list[int]:
    up = list(range(1, max_processes + 1))
    return up + up[::-1]


def write_config(folder: str, dsn: str, ordering: str, batch_size: int) -> str:
    config = {
        "mysql": {"dsn": dsn, "pool_size": 4},
        "outbox_worker": {"batch_size": batch_size, "poll_interval": "100ms", "ordering": ordering},
        "sinks": {"tencent_im": {"enabled": False}},  # the main lane runs the noop sink only
        "cluster": {"heartbeat_interval": "300ms", "node_timeout": "3s"},
        "log": {"level": "WARNING"},
    }
    path = Path(folder) / f"ordered-{ordering}-{batch_size}.yaml"
    path.write_text(json.dumps(config))
    return str(path)


async def settled(store: MySQLStore, nodes: int) -> bool:
    """Every bucket owned by one of ``nodes`` live nodes, spread evenly, and claimable."""
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT owner, COUNT(*) FROM {BUCKET_TABLE} WHERE owner IS NOT NULL AND handing_over = 0"
            " AND claimable_from_ms <= %s GROUP BY owner",
            (int(time.time() * 1000),),
        )
        counts = [int(n) for _owner, n in await cur.fetchall()]
    return len(counts) == nodes and sum(counts) == BUCKETS and max(counts) - min(counts) <= 1


async def wait_for(store: MySQLStore, nodes: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await settled(store, nodes):
        if time.monotonic() > deadline:
            raise RuntimeError(f"buckets not settled on {nodes} processes within {timeout:g}s")
        await anyio.sleep(0.1)


async def drain(store: MySQLStore, events: int, rooms: int, prefix: str, timeout: float = 600.0) -> float:
    """Load ``events`` rows over ``rooms`` rooms, release them at once, time until none is pending."""
    await reset(store)
    await load(store, events, prefix=prefix, rooms=rooms, status=HOLD, age_ms=AGE_MS)
    started = time.perf_counter()
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status = 'pending' WHERE status = %s", (HOLD,))
    deadline = time.monotonic() + timeout
    while await pending(store):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{events} events over {rooms} rooms not drained within {timeout:g}s")
        await anyio.sleep(0.02)
    return events / (time.perf_counter() - started)


async def run_ordered(
    store: MySQLStore, dsn: str, events: int, batches: list[int], room_counts: list[int], max_processes: int = 3
) -> list[OrderedResult]:
    results: dict[tuple[str, int, int, int], OrderedResult] = {}
    cases = [("per_room", batch) for batch in batches] + [("none", batches[0])]
    with tempfile.TemporaryDirectory() as folder:
        for ordering, batch in cases:
            config = write_config(folder, dsn, ordering, batch)
            running: list[subprocess.Popen[str]] = []
            started = 0
            try:
                for n in counts(max_processes):
                    while len(running) < n:
                        started += 1
                        env = {"ROOM_OUTBOX__NODE_ID": f"bench-{ordering}-{batch}-{started}"}
                        running.append(procs.room_outbox("--config", config, "run", env=env, stderr=subprocess.DEVNULL))
                    while len(running) > n:
                        procs.stop(running.pop())  # SIGTERM: gives its buckets up
                    await wait_for(store, n)
                    for rooms in room_counts if ordering == "per_room" else [room_counts[len(room_counts) // 2]]:
                        rate = await drain(store, events, rooms, f"o{ordering[0]}{batch}-{started}-{n}-{rooms}-")
                        key = (ordering, batch, rooms, n)
                        results.setdefault(key, OrderedResult(ordering, batch, rooms, n, [])).rates.append(rate)
            finally:
                for proc in reversed(running):
                    procs.stop(proc)
            await _wait_left(store)
    return sorted(results.values(), key=lambda r: (r.ordering != "per_room", r.batch_size, r.processes, r.rooms))


async def _wait_left(store: MySQLStore, timeout: float = 30.0) -> None:
    """Stopped processes give their buckets up; the next case starts from none owned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with store.transaction() as cur:
            await cur.execute(f"SELECT COUNT(*) FROM {BUCKET_TABLE} WHERE owner IS NOT NULL")
            if not (await cur.fetchone())[0]:
                return
        await anyio.sleep(0.1)
