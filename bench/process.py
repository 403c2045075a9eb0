"""(s) The shipped process against the raw loop, and (j) a process joining during a burst.

**s.** ``room-outbox run`` as an operator starts it (a YAML file, telemetry and logging as
shipped; only the IM sink is off, so every event goes to the noop sink), draining 20,000
events over 500 rooms, at batch 100 and 500, unordered and ``per_room``. Its rounds alternate
with the raw claim → mark loop of part a (:func:`bench.noop.raw_drain`), run in this process
on a database of its own beside it on the same server, so a load that comes and goes on the
machine weighs on both alike. Each round loads its rows held back (status ``bench_hold``,
older than ``claim_after``) and releases them in one statement. Both are timed from the rows'
``updated_at_ms``, the time each mark was written: from the first mark to the last, counting
the rows after the first mark. So neither the process's poll interval nor this process's
polling of the pending count is in the figure.

**j.** The burst of issue 25: 6,000 events over 50 hot rooms, batch 100, ``per_room``. One
process drains it alone; then the same burst with a second process started when the rows are
released (it joins while they drain, and its buckets are handed over under load); then two
processes settled before the burst: the buckets split and claimable, and the second process's
worker running (its ``/readyz`` answers 200: it has joined the membership). Rounds alternate;
the second process is stopped (SIGTERM) and the buckets settled on one before the next round
alone.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio
import httpx

from bench import procs
from bench.db import load, pending, reset
from bench.noop import raw_drain
from bench.ordered import wait_for
from room_outbox.store.backends.mysql import MySQLStore

HOLD = "bench_hold"
T = TypeVar("T")
#: Older than the shipped ``claim_after`` (5 s): a backlog the producer did not push.
AGE_MS = 60_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(folder: str, dsn: str, ordering: str, batch_size: int, name: str = "") -> str:
    """The shipped defaults with the image's telemetry (the HTTP endpoint, so every delivery
    is counted for ``/metrics``), but for the batch size, the ordering, a short poll interval
    (an idle process notices the burst soon) and the IM sink off (no fake server in the way)."""
    config = {
        "mysql": {"dsn": dsn},
        "outbox_worker": {"batch_size": batch_size, "poll_interval": "100ms", "ordering": ordering},
        "sinks": {"tencent_im": {"enabled": False}},
        "telemetry": {"http_listen": f"127.0.0.1:{free_port()}"},
    }
    path = Path(folder) / f"process-{ordering}-{batch_size}{name}.yaml"  # each its own HTTP port
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


async def marked_rate(store: MySQLStore) -> float:
    """Events/s from the rows' marks: the rows marked after the first mark, over the time from
    the first mark to the last."""
    async with store.transaction() as cur:
        await cur.execute("SELECT MIN(updated_at_ms), MAX(updated_at_ms) FROM room_outbox WHERE status = 'published'")
        first, last = (await cur.fetchone()) or (None, None)
        await cur.execute(
            "SELECT COUNT(*), SUM(updated_at_ms > %s) FROM room_outbox WHERE status = 'published'", (first,)
        )
        _total, after_first = await cur.fetchone()
    if first is None or last == first:
        raise RuntimeError("too few marks to time: raise the event count")
    return int(after_first) / ((int(last) - int(first)) / 1000)


async def held(store: MySQLStore, events: int, rooms: int, prefix: str) -> None:
    await reset(store)
    await load(store, events, prefix=prefix, rooms=rooms, status=HOLD, age_ms=AGE_MS)


async def release(store: MySQLStore) -> None:
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status = 'pending' WHERE status = %s", (HOLD,))


async def drained(store: MySQLStore, events: int, timeout: float = 600.0) -> None:
    """Until no row is pending (a claimed row stays pending until its mark), then every row
    must be published. Polled by one probe of the claim index, not a count: the polling must
    not load the server whose throughput it measures, and a count of the published rows
    every 50 ms reads a growing range each time."""
    deadline = time.monotonic() + timeout
    while True:
        async with store.transaction() as cur:
            await cur.execute("SELECT EXISTS (SELECT 1 FROM room_outbox WHERE status = 'pending')")
            if not int((await cur.fetchone())[0]):
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{events} events not drained within {timeout:g}s")
        await anyio.sleep(0.05)
    async with store.transaction() as cur:
        await cur.execute("SELECT COUNT(*) FROM room_outbox WHERE status = 'published'")
        published = int((await cur.fetchone())[0])
    if published != events:
        raise RuntimeError(f"{published} of {events} events published, none left pending")


async def raw_round(store: MySQLStore, events: int, rooms: int, batch: int, prefix: str) -> float:
    await held(store, events, rooms, prefix)
    await release(store)
    moved = await raw_drain(store, batch)
    assert moved == events and await pending(store) == 0, (moved, events)
    return await marked_rate(store)


async def process_round(
    store: MySQLStore, events: int, rooms: int, prefix: str, on_release: Callable[[], object] = lambda: None
) -> float:
    await held(store, events, rooms, prefix)
    await release(store)
    on_release()
    await drained(store, events)
    return await marked_rate(store)


def start(config: str, node: str) -> subprocess.Popen[str]:
    env = {"ROOM_OUTBOX__NODE_ID": node}
    return procs.room_outbox("--config", config, "run", env=env, stderr=subprocess.DEVNULL)


async def serving(config: str, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    """Until the process's ``/readyz`` answers 200: its worker runs (it has joined the
    membership, so it claims its buckets' rows)."""
    address = json.loads(Path(config).read_text())["telemetry"]["http_listen"]
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"room-outbox run exited with {proc.returncode}")
            try:
                if (await client.get(f"http://{address}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"room-outbox run not ready within {timeout:g}s")
            await anyio.sleep(0.05)


async def ready(store: MySQLStore, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    """The process claims: a probe row is published."""
    await reset(store)
    await load(store, 1, prefix="probe-", age_ms=AGE_MS)
    deadline = time.monotonic() + timeout
    while await pending(store):
        if proc.poll() is not None:
            raise RuntimeError(f"room-outbox run exited with {proc.returncode} before it claimed")
        if time.monotonic() > deadline:
            raise RuntimeError(f"room-outbox run claimed nothing within {timeout:g}s")
        await anyio.sleep(0.05)


@dataclass
class Pairs:
    """Alternating rounds: the measured side and its baseline, each round's pair in turn."""

    ordering: str
    batch_size: int
    measured: list[float]
    baseline: list[float]

    @property
    def ratios(self) -> list[float]:
        return [m / b for m, b in zip(self.measured, self.baseline, strict=True)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


async def alternate(
    rounds: int, first: Callable[[int], Awaitable[T]], second: Callable[[int], Awaitable[T]]
) -> tuple[list[T], list[T]]:
    """``rounds`` pairs, the order within a pair swapped every round (first, second; second, first…)."""
    a: list[T] = []
    b: list[T] = []
    for n in range(rounds):
        order = [(first, a), (second, b)] if n % 2 == 0 else [(second, b), (first, a)]
        for run, into in order:
            into.append(await run(n))
    return a, b


async def run_process(
    raw_store: MySQLStore, store: MySQLStore, dsn: str, events: int, rooms: int, batches: list[int], rounds: int
) -> list[Pairs]:
    """Part s: the process, unordered and per_room, against the raw loop, per batch size."""
    results: list[Pairs] = []
    with tempfile.TemporaryDirectory() as folder:
        for batch in batches:
            for ordering in ("none", "per_room"):
                proc = start(write_config(folder, dsn, ordering, batch), f"bench-s-{ordering}-{batch}")
                try:
                    await ready(store, proc)

                    async def by_process(n: int, batch: int = batch, ordering: str = ordering) -> float:
                        return await process_round(store, events, rooms, f"s{ordering[0]}{batch}-{n}-")

                    async def by_raw(n: int, batch: int = batch, ordering: str = ordering) -> float:
                        return await raw_round(raw_store, events, rooms, batch, f"r{ordering[0]}{batch}-{n}-")

                    measured, baseline = await alternate(rounds, by_process, by_raw)
                finally:
                    procs.stop(proc)
                results.append(Pairs(ordering, batch, measured, baseline))
    return results


@dataclass
class JoinResult:
    joining: Pairs  # a second process started as the burst is released, against one alone
    settled: Pairs  # two processes with the buckets settled before the burst, against one alone


async def run_join(store: MySQLStore, dsn: str, events: int, rooms: int, batch: int, rounds: int) -> JoinResult:
    """Part j: one process alone, a second one joining during the burst, and two settled before
    it, in turns (the order rotates every round)."""
    alone_rates: list[float] = []
    joining: list[float] = []
    settled: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        first = start(write_config(folder, dsn, "per_room", batch, "-1"), "bench-j-1")
        second: list[subprocess.Popen[str]] = []
        second_config = write_config(folder, dsn, "per_room", batch, "-2")

        def start_second(n: int) -> None:
            second.append(start(second_config, f"bench-j-2-{n}"))

        async def stop_second() -> None:
            procs.stop(second.pop())  # SIGTERM: gives its buckets back
            await wait_for(store, 1)

        async def alone(n: int) -> None:
            alone_rates.append(await process_round(store, events, rooms, f"j1-{n}-"))

        async def with_joiner(n: int) -> None:
            joining.append(await process_round(store, events, rooms, f"j2-{n}-", lambda: start_second(n)))
            await stop_second()

        async def two_settled(n: int) -> None:
            start_second(n)
            await wait_for(store, 2)
            # The buckets may be claimable before the new process's worker runs: it joins once
            # every process has applied the new membership for a rate-limit window.
            await serving(second_config, second[-1])
            settled.append(await process_round(store, events, rooms, f"j3-{n}-"))
            await stop_second()

        try:
            await ready(store, first)
            await wait_for(store, 1)
            variants = [alone, with_joiner, two_settled]
            for n in range(rounds):
                for variant in variants[n % 3 :] + variants[: n % 3]:
                    await variant(n)
        finally:
            for proc in [*second, first]:
                procs.stop(proc)
    return JoinResult(Pairs("per_room", batch, joining, alone_rates), Pairs("per_room", batch, settled, alone_rates))
