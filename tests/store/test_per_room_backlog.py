"""Per-room claims over a backlog whose rows' locks are in any order, as an outage leaves them:
a claim takes the head of every room it meets, whichever of the room's rows it met, and holds
back the rows of a room that waits until its head may go. Each test runs on MariaDB,
PostgreSQL and SQLite; on a server also as a claim limited to room buckets (read first, then
locked by key)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from support import envelope, fetch_rows, insert_events, make_dispatcher, running, wait_until

from room_outbox.store.clock import now_ms
from room_outbox.store.membership import BUCKETS
from room_outbox.store.protocol import Claimed, DeliveryResult, Outcome, ReadAlong, SQLStore

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["every room", "room buckets"])
async def any_store(request: pytest.FixtureRequest, bare_store: SQLStore) -> SQLStore:
    """A migrated store on each database; "room buckets": its claims limited to buckets, as
    with several processes (all of them here), on a server only."""
    if request.param == "room buckets":
        if bare_store.dialect.name == "sqlite":
            pytest.skip("SQLite claims every room")

        async def every_bucket(cur: Any, along: ReadAlong | None = None) -> list[int]:
            return list(range(BUCKETS))  # a list: the claim reads, then locks what it found

        bare_store.room_buckets = every_bucket
    await bare_store.migrate()
    return bare_store


async def failed_once(store: SQLStore, event_id: str, retry_at_ms: int) -> None:
    """Claim ``event_id``'s row (the only one claimable) and record its attempt as failed."""
    (row,) = (await store.claim("x#1", 1, now_ms() + 60_000)).rows
    assert row.event_id == event_id
    await store.record([DeliveryResult(row.id, event_id, "x#1", Outcome.FAILED, "refused", retry_at_ms)])


async def test_a_room_met_through_a_later_row_has_its_due_head_taken(any_store: SQLStore) -> None:
    """The scan meets room A through a2 (a fresh row: the lowest lock, first in the claim
    index), not through its head a1 (due again after a failure, a later lock): the claim
    takes a1 instead, and leaves a2 as it is for the claim after."""
    await insert_events(any_store, [envelope("a1", room_id="A")])
    await failed_once(any_store, "a1", now_ms() - 1)
    await insert_events(any_store, [envelope("a2", room_id="A")])
    claimed = await any_store.claim("y#1", 1, now_ms() + 60_000, per_room=True, hold_back_ms=60_000)
    assert [row.event_id for row in claimed.rows] == ["a1"]
    assert (await fetch_rows(any_store))["a2"]["lock_until_ms"] == 0  # not held back: its room goes on
    in_flight = {claimed.rows[0].id: ("default", "A")}
    claimed = await any_store.claim("y#2", 1, now_ms() + 60_000, per_room=True, in_flight=in_flight)
    assert [row.event_id for row in claimed.rows] == ["a2"]


async def test_a_head_waiting_for_its_retry_is_not_taken_and_holds_its_room_until_then(any_store: SQLStore) -> None:
    """A room whose head waits for its retry goes on only then: its rows the scan met are held
    back until that time (not the whole hold-back), right behind the head in the claim index."""
    await insert_events(any_store, [envelope("a1", room_id="A")])
    retry_at = now_ms() + 20_000
    await failed_once(any_store, "a1", retry_at)
    await insert_events(any_store, [envelope("a2", room_id="A"), envelope("a3", room_id="A")])
    claimed = await any_store.claim("y#1", 10, now_ms() + 60_000, per_room=True, hold_back_ms=60_000)
    assert claimed.rows == []
    rows = await fetch_rows(any_store)
    assert [rows[e]["lock_until_ms"] for e in ("a1", "a2", "a3")] == [retry_at] * 3
    assert rows["a1"]["retry_count"] == 1 and rows["a2"]["retry_count"] == rows["a3"]["retry_count"] == 0


class RoomsInOrder:
    """Records each room's deliveries in order."""

    def __init__(self) -> None:
        self.delivered: dict[str, list[int]] = {}

    async def deliver(self, env: Any) -> None:
        self.delivered.setdefault(env.room_id, []).append(env.room_version)

    async def aclose(self) -> None:
        pass


@pytest.fixture
def claims(any_store: SQLStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Claimed]]:
    """Every claim the store makes from now on, in order."""
    made: list[Claimed] = []
    claim = any_store.claim

    async def counted(*args: Any, **kwargs: Any) -> Claimed:
        claimed = await claim(*args, **kwargs)
        made.append(claimed)
        return claimed

    monkeypatch.setattr(any_store, "claim", counted)
    yield made


async def pending_rows(store: SQLStore) -> int:
    async with store.transaction() as cur:
        await cur.execute("SELECT COUNT(*) FROM room_outbox WHERE status = 'pending'")
        return int((await cur.fetchone())[0])


async def all_due(store: SQLStore) -> bool:
    async with store.transaction() as cur:
        await cur.execute(
            "SELECT COUNT(*) FROM room_outbox WHERE status = 'pending' AND lock_until_ms > %s", (now_ms(),)
        )
        return int((await cur.fetchone())[0]) == 0


async def test_a_backlog_left_by_an_outage_drains_in_claims_in_proportion_to_its_rooms(
    any_store: SQLStore, claims: list[Claimed]
) -> None:
    """A backlog of 4,000 events over 100 rooms, left by an outage: per-room claims at
    moments of their own (each holding rows back for its own while, up to half a second),
    each room's head failing again and again (due again up to half a second later), until
    every room's head has failed three times; then a fresh event in every room (the lowest
    lock: first in the claim index, never a head). The rows' locks are then in no order, not
    even within a room. Once the destination is back, the backlog drains in a bounded number
    of claims, each room's events in order: a claim takes a row of every room it meets.
    (Before, a claim took only the rows it met that were heads, about one per room in a whole
    pass over the backlog, and held the rest back: past the bound, most of the backlog was
    still pending.)"""
    rooms, per_room, batch = 100, 40, 100
    await insert_events(
        any_store,
        [
            envelope(f"r{room}-{v}", room_id=f"r{room}", room_version=v)
            for v in range(per_room)
            for room in range(rooms)
        ],
    )
    chance = random.Random(5)
    failures = 0
    with anyio.fail_after(60):
        while failures < 3 * rooms:
            claim = f"outage#{len(claims)}"
            hold_back = chance.randint(1, 500)
            claimed = await any_store.claim(claim, batch, now_ms() + 60_000, per_room=True, hold_back_ms=hold_back)
            due = [now_ms() + chance.randint(1, 500) for _ in claimed.rows]
            await any_store.record(
                [
                    DeliveryResult(row.id, row.event_id, claim, Outcome.FAILED, "503 Service Unavailable", at)
                    for row, at in zip(claimed.rows, due, strict=True)
                ]
            )
            failures += len(claimed.rows)
    await insert_events(
        any_store, [envelope(f"r{room}-{per_room}", room_id=f"r{room}", room_version=per_room) for room in range(rooms)]
    )
    # Every retry and hold-back run out, so that the claims counted next are not those that
    # found nothing due yet.
    await wait_until(lambda: all_due(any_store))
    sink = RoomsInOrder()
    made_before = len(claims)
    bound = 4 * rooms * (per_room + 1) // batch  # four times the fewest claims that can take them

    async def drained_or_past_the_bound() -> bool:
        return len(claims) - made_before > bound or not await pending_rows(any_store)

    dispatcher = make_dispatcher(any_store, sink, batch_size=batch, concurrency=16, per_room=True, poll_interval=0.05)
    async with running(dispatcher):
        await wait_until(drained_or_past_the_bound, timeout=60)
    assert len(claims) - made_before <= bound, (len(claims) - made_before, await pending_rows(any_store))
    assert sink.delivered == {f"r{room}": list(range(per_room + 1)) for room in range(rooms)}
