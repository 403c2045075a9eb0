"""Results whose row another session holds locked (room-service's transaction that updated
it): the result write skips that row instead of waiting for it, writes the others, and
hands the skipped result back (``row_locked``) for a later write; the claim goes on. So
neither the lane nor room-service's writes of the other rows wait for that transaction."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from support import envelope, fetch_rows, insert_events

from room_outbox.store.factory import open_store
from room_outbox.store.protocol import DeliveryResult, Outcome, SQLStore

pytestmark = pytest.mark.anyio

LEASE = 10**13
#: Every store call ends within this (the stores' query_timeout is 5 s): a wait for the lock
#: would overrun it.
PROMPT = 2.0
EVENTS = [f"e{i}" for i in range(1, 11)]
LOCKED = "e5"


@pytest.fixture(params=["mysql", "postgresql"])
def dsn(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn"))


@pytest.fixture
async def store(dsn: str) -> AsyncIterator[SQLStore]:
    store = await open_store(dsn, query_timeout=5.0)
    try:
        await store.migrate()
        yield store
    finally:
        await store.aclose()


@pytest.fixture
async def room_service(dsn: str) -> AsyncIterator[SQLStore]:
    """Another program's sessions on the same database."""
    other = await open_store(dsn, query_timeout=30.0)
    try:
        yield other
    finally:
        await other.aclose()


@asynccontextmanager
async def row_locked(room_service: SQLStore, event_id: str) -> AsyncIterator[None]:
    """room-service updates ``event_id``'s row in a transaction it keeps open for the block."""
    locked, release = anyio.Event(), anyio.Event()

    async def hold() -> None:
        async with room_service.transaction() as cur:
            await cur.execute("UPDATE room_outbox SET envelope = envelope WHERE event_id = %s", (event_id,))
            locked.set()
            with anyio.fail_after(20):
                await release.wait()

    async with anyio.create_task_group() as holding:
        holding.start_soon(hold)
        with anyio.fail_after(5):
            await locked.wait()
        try:
            yield
        finally:
            release.set()


async def delivered(store: SQLStore) -> list[DeliveryResult]:
    """:data:`EVENTS` claimed and published (results in hand, not written)."""
    await insert_events(store, [envelope(e, room_id=f"r{e}") for e in EVENTS])
    claimed = await store.claim("n#1", len(EVENTS), LEASE)
    return [DeliveryResult(r.id, r.event_id, r.claim, Outcome.PUBLISHED) for r in claimed.rows]


async def statuses(store: SQLStore) -> dict[str, tuple[str, str | None]]:
    return {e: (r["status"], r["worker_id"]) for e, r in (await fetch_rows(store)).items()}


async def test_a_claim_writes_the_results_of_the_rows_not_locked_and_hands_back_the_locked_ones(
    store: SQLStore, room_service: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    results = await delivered(store)
    await insert_events(store, [envelope("new1", room_id="other")])
    async with row_locked(room_service, LOCKED):
        with anyio.fail_after(PROMPT):
            claimed = await store.claim("n#2", 10, LEASE, results)
        assert [r.event_id for r in claimed.rows] == ["new1"]  # the lane goes on
        assert [(r.event_id, r.row_locked) for r in claimed.stale] == [(LOCKED, True)]
        now = await statuses(store)
        assert now[LOCKED] == ("pending", "n#1")  # still the claim's, its result unwritten
        assert {e: s for e, s in now.items() if e not in (LOCKED, "new1")} == dict.fromkeys(
            set(EVENTS) - {LOCKED}, ("published", None)
        )
        # Carried to the next write: skipped again while the lock lasts.
        [waiting] = claimed.stale
        with anyio.fail_after(PROMPT):
            assert [(r.event_id, r.row_locked) for r in await store.record([waiting])] == [(LOCKED, True)]
    with caplog.at_level(logging.DEBUG, logger="room_outbox.store"):
        assert await store.record([waiting]) == []  # the lock released: written
    assert (await statuses(store))[LOCKED] == ("published", None)
    assert any("row another session held locked is free again" in r.getMessage() for r in caplog.records)


async def test_room_services_update_of_another_row_of_the_batch_does_not_wait(
    store: SQLStore, room_service: SQLStore
) -> None:
    """Its transaction holds one row; it updates another row whose result the claim writes.
    The claim's transaction, which holds that other row's lock once it wrote its result,
    never waits for the first one, so room-service's update waits a moment at most."""
    results = await delivered(store)
    handed_back: list[DeliveryResult] = []

    async def claim() -> None:
        with anyio.fail_after(PROMPT):
            handed_back.extend((await store.claim("n#2", 10, LEASE, results)).stale)

    async with row_locked(room_service, LOCKED):
        async with anyio.create_task_group() as both:
            both.start_soon(claim)
            with anyio.fail_after(PROMPT):
                async with room_service.transaction() as cur:
                    await cur.execute("UPDATE room_outbox SET updated_at_ms = updated_at_ms + 1 WHERE event_id = 'e4'")
        # e4's result is written, or handed back if room-service's update held it at the time.
        assert {r.event_id for r in handed_back} <= {LOCKED, "e4"} and all(r.row_locked for r in handed_back)
    assert await store.record(handed_back) == []
    assert await statuses(store) == dict.fromkeys(EVENTS, ("published", None))


async def test_a_lease_renewal_renews_the_rows_not_locked_and_counts_the_locked_one_as_held(
    store: SQLStore, room_service: SQLStore
) -> None:
    await insert_events(store, [envelope(e, room_id=f"r{e}") for e in EVENTS])
    claimed = await store.claim("n#1", len(EVENTS), 1_000)
    ids = sorted(r.id for r in claimed.rows)
    async with row_locked(room_service, LOCKED):
        with anyio.fail_after(PROMPT):
            assert await store.renew("n#1", ids, LEASE) == len(EVENTS)
    rows = await fetch_rows(store)
    lock = "lock_until_ms"
    assert rows[LOCKED][lock] == 1_000  # not renewed while locked
    assert {e for e, r in rows.items() if r[lock] == LEASE} == set(EVENTS) - {LOCKED}
    assert await store.renew("n#1", ids, LEASE) == len(EVENTS)
    assert (await fetch_rows(store))[LOCKED][lock] == LEASE
