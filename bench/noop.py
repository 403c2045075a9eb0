"""(a) Noop-lane throughput: the dispatcher against two loops with no framework.

* **raw SQL reference** — the practical limit: the same cycle the dispatcher runs, written
  straight on the driver: one transaction claims a batch (``FOR UPDATE SKIP LOCKED``, lease)
  and marks the previous batch published; "delivery" is a no-op.
* **seed-style loop** — room-service's V1 worker: select a batch, publish, then
  ``UPDATE … WHERE event_id = ?`` and a commit per row.
* **claims in turn** — the dispatcher with its next claim waiting for every result, as its
  rounds were before claims overlapped the last deliveries.

All drain the same number of freshly loaded rows from an empty table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bench.db import load, pending, reset
from bench.drive import run_until_empty
from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
from room_outbox.delivery.routing import Router
from room_outbox.envelope import KNOWN_EVENT_TYPES
from room_outbox.plugins.noop import NoopSink
from room_outbox.store.backends.leased import now_ms
from room_outbox.store.backends.mysql import CLAIM_SQL, MySQLStore


@dataclass
class NoopResult:
    batch_size: int
    events: int
    dispatcher: float  # events/s
    raw: float
    seed: float
    claims_in_turn: float  # the dispatcher with claims in turn with delivery (InTurnDispatcher)
    dispatcher_cpu_us: float  # this process's CPU time per event, in the dispatcher's faster drain
    raw_cpu_us: float  # the same in the raw loop's faster drain

    @property
    def serial_bound(self) -> float:
        """The rate the dispatcher would have if its extra CPU per event simply added to the
        raw loop's time per event: what claiming, delivering and recording in series allows."""
        return 1 / (1 / self.raw + max(0.0, self.dispatcher_cpu_us - self.raw_cpu_us) / 1e6)


def noop_router() -> Router:
    return Router({"noop": NoopSink()}, dict.fromkeys(KNOWN_EVENT_TYPES, "noop"))


async def dispatcher_drain(store: MySQLStore, batch_size: int, cls: type[Dispatcher] = Dispatcher) -> int:
    dispatcher = cls(store, noop_router(), LaneOptions(batch_size=batch_size, poll_interval=0.1), "bench")
    return await run_until_empty(dispatcher)


class InTurnDispatcher(Dispatcher):
    """The dispatcher with claims in turn with delivery, as its rounds were before claims
    overlapped the last deliveries: the next claim waits for every row's result."""

    def _outstanding_before_next_claim(self) -> int:
        return 0


async def in_turn_drain(store: MySQLStore, batch_size: int) -> int:
    return await dispatcher_drain(store, batch_size, InTurnDispatcher)


async def raw_drain(store: MySQLStore, batch_size: int) -> int:
    done: list[int] = []
    total = 0
    while True:
        async with store.transaction() as cur:
            if done:
                marks = ", ".join(["%s"] * len(done))
                await cur.execute(
                    f"UPDATE room_outbox SET status = 'published', worker_id = NULL, lock_until_ms = 0,"
                    f" updated_at_ms = %s WHERE id IN ({marks})",
                    (now_ms(), *done),
                )
            await cur.execute(CLAIM_SQL, (now_ms(), batch_size))
            rows = await cur.fetchall()
            ids = [row[0] for row in rows]
            if ids:
                marks = ", ".join(["%s"] * len(ids))
                await cur.execute(
                    f"UPDATE room_outbox SET worker_id = 'raw', lock_until_ms = %s WHERE id IN ({marks})",
                    (now_ms() + 30_000, *ids),
                )
        done = ids  # delivered: a no-op
        total += len(ids)
        if len(ids) < batch_size:
            if done:
                async with store.transaction() as cur:
                    marks = ", ".join(["%s"] * len(done))
                    await cur.execute(
                        f"UPDATE room_outbox SET status = 'published', updated_at_ms = %s WHERE id IN ({marks})",
                        (now_ms(), *done),
                    )
            return total


async def seed_drain(store: MySQLStore, batch_size: int) -> int:
    total = 0
    while True:
        async with store.transaction() as cur:
            await cur.execute(
                "SELECT event_id, envelope FROM room_outbox WHERE status = 'pending' ORDER BY id LIMIT %s",
                (batch_size,),
            )
            rows = await cur.fetchall()
        for event_id, _envelope in rows:  # publish: a no-op
            async with store.transaction() as cur:
                await cur.execute(
                    "UPDATE room_outbox SET status = 'published', updated_at_ms = %s WHERE event_id = %s",
                    (now_ms(), event_id),
                )
        total += len(rows)
        if len(rows) < batch_size:
            return total


@dataclass(frozen=True, order=True)
class Drain:
    rate: float  # events/s
    cpu_us: float  # this process's CPU time per event


async def timed(store: MySQLStore, events: int, drain: object, batch_size: int, prefix: str) -> Drain:
    await reset(store)
    await load(store, events, prefix=prefix)
    started, cpu = time.perf_counter(), time.process_time()
    moved = await drain(store, batch_size)  # type: ignore[operator]
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
    assert moved == events and await pending(store) == 0, (moved, events)
    return Drain(events / seconds, cpu_seconds / events * 1e6)


async def run_noop(store: MySQLStore, events: int, batch_size: int, seed_events: int) -> NoopResult:
    """Each variant on the same fresh load; the slow seed loop on fewer events (its rate does
    not depend on the count), interleaved so drift on a noisy machine hits all alike."""
    dispatcher = await timed(store, events, dispatcher_drain, batch_size, "d")
    raw = await timed(store, events, raw_drain, batch_size, "r")
    seed = await timed(store, seed_events, seed_drain, batch_size, "s")
    dispatcher = max(dispatcher, await timed(store, events, dispatcher_drain, batch_size, "d2"))
    raw = max(raw, await timed(store, events, raw_drain, batch_size, "r2"))
    in_turn = max(
        await timed(store, events, in_turn_drain, batch_size, "t"),
        await timed(store, events, in_turn_drain, batch_size, "t2"),
    )
    return NoopResult(
        batch_size, events, dispatcher.rate, raw.rate, seed.rate, in_turn.rate, dispatcher.cpu_us, raw.cpu_us
    )
