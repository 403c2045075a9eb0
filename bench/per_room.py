"""(q) ``per_room`` against unordered delivery, in this process, for a sink that answers at once
(the no-op sink) and for one that answers after 1–10 ms (as a remote service does), over many
rooms and over a few hot ones.

Each round drains a fresh load with the dispatcher, ``ordering: none`` and ``per_room`` in turn
(the order swapped every round), at the same batch size and ``concurrency``. A slow sink is
where per-room ordering costs most: a claim must not take a room's rows while an earlier row of
the room is in flight, so a dispatcher that waited for every result before its next claim left
its workers idle behind the batch's slowest delivery.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import anyio

from bench.db import load, pending, reset
from bench.drive import run_until_empty
from bench.noop import noop_router
from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
from room_outbox.delivery.routing import Router
from room_outbox.envelope import KNOWN_EVENT_TYPES, EventEnvelope
from room_outbox.store.backends.mysql import MySQLStore

#: The slow sink's answer time, uniform between these (seconds).
SLOW = (0.001, 0.010)


class SlowSink:
    """Answers each delivery after 1–10 ms, from a seeded generator: every run waits alike."""

    def __init__(self) -> None:
        self._random = random.Random(7)

    async def deliver(self, envelope: EventEnvelope) -> None:
        await anyio.sleep(self._random.uniform(*SLOW))

    async def aclose(self) -> None:
        pass


@dataclass(frozen=True)
class PerRoomResult:
    sink: str  # "no-op" or "1–10 ms"
    rooms: int
    batch_size: int
    events: int
    unordered: list[float]  # events/s per round
    per_room: list[float]

    @property
    def ratio(self) -> float:
        return statistics.median(p / u for p, u in zip(self.per_room, self.unordered, strict=True))


async def drain(store: MySQLStore, router: Router, per_room: bool, batch_size: int) -> float:
    events = await pending(store)
    dispatcher = Dispatcher(
        store, router, LaneOptions(batch_size=batch_size, poll_interval=0.1, per_room=per_room), "q"
    )
    started = time.perf_counter()
    moved = await run_until_empty(dispatcher)
    seconds = time.perf_counter() - started
    assert moved == events and await pending(store) == 0, (moved, events)
    return events / seconds


async def run_per_room(
    store: MySQLStore, events: int, slow_events: int, batch_size: int, room_counts: list[int], rounds: int
) -> list[PerRoomResult]:
    results: list[PerRoomResult] = []
    for sink, count in (("no-op", events), ("1–10 ms", slow_events)):
        for rooms in room_counts:
            rates: dict[bool, list[float]] = {False: [], True: []}
            for n in range(rounds):
                for per_room in (False, True) if n % 2 == 0 else (True, False):
                    await reset(store)
                    await load(store, count, prefix=f"q{n}{int(per_room)}{rooms}{sink[0]}-", rooms=rooms)
                    router = (
                        noop_router()
                        if sink == "no-op"
                        else Router({"slow": SlowSink()}, dict.fromkeys(KNOWN_EVENT_TYPES, "slow"))
                    )
                    rates[per_room].append(await drain(store, router, per_room, batch_size))
            results.append(PerRoomResult(sink, rooms, batch_size, count, rates[False], rates[True]))
    return results
