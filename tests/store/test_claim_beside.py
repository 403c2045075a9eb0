"""Results written beside a claim: on a server, a claim given the results of the rows before
writes them in a transaction of their own on another connection while it reads its rows,
and waits for that write to be committed before it writes its leases (the rows held never
exceed what the caller holds). Where that write fails, or would wait for a row lock, the
claim writes the results itself. ``on_locked`` sees the rows once they are locked and the
results committed, never before."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from support import envelope, fetch_rows, insert_events

from room_outbox.store.backends.leased import LeasedRows
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import ClaimFailedAfterResults, DeliveryResult, OutboxRow, Outcome, SQLStore

pytestmark = pytest.mark.anyio

LEASE = 10**13


@pytest.fixture(params=["mysql", "postgresql"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    store = await open_store(
        str(request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn"))
    )
    try:
        await store.migrate()
        yield store
    finally:
        await store.aclose()


#: Rows claimed and delivered first (enough for MariaDB to read a short claim's range by the
#: claim index), then the rows pending.
DELIVERED = [f"d{i}" for i in range(50)]
PENDING = ["p0", "p1", "p2"]


async def delivered_first(store: SQLStore) -> list[DeliveryResult]:
    """:data:`DELIVERED` claimed and delivered (their results in hand, not written), and
    :data:`PENDING` not claimed yet."""
    await insert_events(store, [envelope(e) for e in DELIVERED + PENDING])
    claimed = await store.claim("n#1", len(DELIVERED), LEASE)
    return [DeliveryResult(r.id, r.event_id, r.claim, Outcome.PUBLISHED) for r in claimed.rows]


async def statuses(store: SQLStore) -> dict[str, tuple[str, str | None]]:
    return {e: (r["status"], r["worker_id"]) for e, r in (await fetch_rows(store)).items()}


def rows_as(delivered: tuple[str, str | None], pending: tuple[str, str | None]) -> dict[str, tuple[str, str | None]]:
    return {**dict.fromkeys(DELIVERED, delivered), **dict.fromkeys(PENDING, pending)}


@pytest.fixture
def transactions(store: SQLStore) -> Iterator[list[str]]:
    """The transactions opened, in order: "claim" or "beside"."""
    opened: list[str] = []
    plain, beside = store.transaction, store._beside_transaction  # type: ignore[attr-defined]

    def claim_transaction(*args: Any) -> Any:
        opened.append("claim")
        return plain(*args)

    def beside_transaction() -> Any:
        opened.append("beside")
        return beside()

    store.transaction, store._beside_transaction = claim_transaction, beside_transaction  # type: ignore[method-assign, attr-defined]
    yield opened


@pytest.fixture
def beside_first(store: SQLStore) -> None:
    """The claim reads its rows once the results' write beside it has ended, so that the
    write never meets a lock the claim's scan takes in passing (a row it reads and skips, on
    MariaDB, where the plan the optimizer picks for a small table may read every row): such a
    write fails, and the claim writes the results itself, which these tests do not look at."""
    writing: list[anyio.Event] = []  # one per write beside a claim, set once it has ended
    beside, scan = store._beside_transaction, store._scan  # type: ignore[attr-defined]

    @asynccontextmanager
    async def beside_then_tell() -> AsyncIterator[Any]:
        writing.append(anyio.Event())
        try:
            async with beside() as cur:
                yield cur
        finally:
            writing[-1].set()

    async def scan_after_it(*args: Any) -> Any:
        with anyio.fail_after(5):
            for ended in writing:
                await ended.wait()
        return await scan(*args)

    store._beside_transaction, store._scan = beside_then_tell, scan_after_it  # type: ignore[attr-defined]


async def test_results_are_committed_beside_the_claim_before_it_hands_over_its_rows(
    store: SQLStore, beside_first: None, transactions: list[str]
) -> None:
    results = await delivered_first(store)
    transactions.clear()
    seen: list[dict[str, tuple[str, str | None]]] = []

    async def on_locked(rows: list[OutboxRow]) -> None:
        seen.append(await statuses(store))  # another connection: what is committed

    claimed = await store.claim("n#2", 100, LEASE, results, on_locked=on_locked)
    assert transactions[:2] == ["beside", "claim"]
    assert [r.event_id for r in claimed.rows] == PENDING and claimed.stale == []
    # When the rows are handed over, the results are committed and the new leases are not.
    assert seen == [rows_as(("published", None), ("pending", None))]
    assert await statuses(store) == rows_as(("published", None), ("pending", "n#2"))


async def test_results_whose_write_beside_fails_are_written_in_the_claim_and_it_hands_over_nothing_early(
    store: SQLStore,
) -> None:
    results = await delivered_first(store)

    @asynccontextmanager
    async def gone() -> AsyncIterator[Any]:
        raise ConnectionError("database gone")
        yield

    store._beside_transaction = gone  # type: ignore[attr-defined]
    handed: list[list[OutboxRow]] = []

    async def on_locked(rows: list[OutboxRow]) -> None:
        handed.append(rows)

    claimed = await store.claim("n#2", 100, LEASE, results, on_locked=on_locked)
    assert [r.event_id for r in claimed.rows] == PENDING and claimed.stale == []
    assert handed == []  # the results were still to commit with the claim: the rows come with it
    assert await statuses(store) == rows_as(("published", None), ("pending", "n#2"))


async def test_the_write_beside_never_waits_for_a_lock_the_claim_holds(store: SQLStore) -> None:
    """A locking scan that comes back short locks the index entry that ends its range (on
    MariaDB): there, the row of a result being written. Waiting for it, the write would
    wait for the claim, which waits for the write: both would stop until query_timeout."""
    results = await delivered_first(store)
    scanned = anyio.Event()
    scan = store._scan  # type: ignore[attr-defined]
    beside = store._beside_transaction  # type: ignore[attr-defined]

    async def scan_then_tell(*args: Any) -> Any:
        rows = await scan(*args)
        scanned.set()
        return rows

    class WritesAfterTheScan:
        def __init__(self, cur: Any) -> None:
            self.cur = cur

        async def execute(self, *args: Any) -> Any:
            with anyio.fail_after(5):
                await scanned.wait()  # the claim's locks are taken: now write
            return await self.cur.execute(*args)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.cur, name)

    @asynccontextmanager
    async def after_the_scan() -> AsyncIterator[Any]:
        async with beside() as cur:
            yield WritesAfterTheScan(cur)

    store._scan, store._beside_transaction = scan_then_tell, after_the_scan  # type: ignore[attr-defined]
    with anyio.fail_after(3):  # query_timeout is 5 s
        claimed = await store.claim("n#2", 10, LEASE, results)  # a range the claim index is read for
    assert [r.event_id for r in claimed.rows] == PENDING
    assert await statuses(store) == rows_as(("published", None), ("pending", "n#2"))


async def test_a_claim_failing_after_the_results_were_written_beside_it_says_so(
    store: SQLStore, beside_first: None
) -> None:
    results = await delivered_first(store)

    async def on_locked(rows: list[OutboxRow]) -> None:
        raise RuntimeError("the caller gives up")

    with pytest.raises(ClaimFailedAfterResults) as failed:
        await store.claim("n#2", 100, LEASE, results, on_locked=on_locked)
    assert failed.value.stale == [] and isinstance(failed.value.__cause__, RuntimeError)
    assert await statuses(store) == rows_as(("published", None), ("pending", None))  # the claim's leases undone


async def test_a_per_room_claim_takes_the_rooms_next_rows_whose_earlier_rows_its_results_publish(
    store: SQLStore, beside_first: None, transactions: list[str]
) -> None:
    """Every row is of one room: the pending rows come next once the delivered ones' results
    are written, which the claim counts on while it reads, beside their write."""
    results = await delivered_first(store)
    transactions.clear()
    handed: list[list[str]] = []

    async def on_locked(rows: list[OutboxRow]) -> None:
        handed.append([r.event_id for r in rows])

    claimed = await store.claim("n#2", 100, LEASE, results, per_room=True, on_locked=on_locked)
    assert transactions[:2] == ["beside", "claim"]
    assert [r.event_id for r in claimed.rows] == PENDING and handed == [PENDING]
    assert await statuses(store) == rows_as(("published", None), ("pending", "n#2"))


async def test_a_pool_of_one_connection_writes_results_in_the_claim(database_dsn: str) -> None:
    store = await MySQLStore.connect(database_dsn, pool_size=1)
    try:
        await store.migrate()
        assert not store.writes_beside_claims
        results = await delivered_first(store)
        with anyio.fail_after(3):
            claimed = await store.claim("n#2", 100, now_ms() + 60_000, results)
        assert [r.event_id for r in claimed.rows] == PENDING
    finally:
        await store.aclose()


def test_only_a_mariadb_session_can_refuse_every_lock_wait() -> None:
    address = MySQLAddress.from_dsn("mysql://root@127.0.0.1/x")
    pool = SimpleNamespace(maxsize=10)
    assert MySQLStore(pool, address, server_version="10.11.19-MariaDB").writes_beside_claims  # type: ignore[arg-type]
    assert not MySQLStore(pool, address, server_version="8.4.3").writes_beside_claims  # type: ignore[arg-type]
    assert not LeasedRows().writes_beside_claims  # SQLite, lane tables
