"""Claims ahead of delivery: the next claim is made while a claim's last rows are still in
flight, never holding more than a batch of rows (a kill repeats at most one batch); a claim
that fails loses none of the results of the rows in flight; and each successful claim of a
long round counts for readiness."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
from support import RecordingSink, envelope, fetch_rows, insert_events, make_dispatcher

from bench.drive import run_until_empty
from room_outbox.delivery.dispatcher import Feed
from room_outbox.sink import RetryableSinkError
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.protocol import DeliveryResult, OutboxRow, Outcome

pytestmark = pytest.mark.anyio

HELD = "SELECT COUNT(*) FROM room_outbox WHERE status = 'pending' AND worker_id IS NOT NULL"


class GatedSink:
    """Delivers at once, except ``slow``, which waits (5 s at most) for ``gate`` and then, the
    first time, fails if ``fails`` (a retryable error); records what it was given
    (``started``), what it delivered (``received``) and, at each delivery, how many rows the
    database shows as claimed and not yet settled."""

    def __init__(self, store: MySQLStore, slow: str, fails: bool = False) -> None:
        self.store = store
        self.slow = slow
        self.fails = fails
        self.gate = anyio.Event()
        self.started: list[str] = []
        self.received: list[str] = []
        self.held: list[int] = []

    async def deliver(self, env: Any) -> None:
        self.started.append(env.event_id)
        async with self.store.transaction() as cur:
            await cur.execute(HELD)
            self.held.append(int((await cur.fetchone())[0]))
        if env.event_id == self.slow:
            with anyio.fail_after(5):
                await self.gate.wait()
            if self.fails:
                self.fails = False
                raise RetryableSinkError("the sink failed once")
        self.received.append(env.event_id)

    async def aclose(self) -> None:
        pass


async def test_the_next_claim_is_delivered_while_the_last_rows_are_in_flight_within_one_batch_held(
    store: MySQLStore,
) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(30)])
    sink = GatedSink(store, slow="e9")  # the first claim's last row
    dispatcher = make_dispatcher(store, sink, batch_size=10, concurrency=4)
    claims: list[int] = []
    real_claim = store.claim

    async def claim(*args: Any, **kwargs: Any) -> Any:
        claimed = await real_claim(*args, **kwargs)
        claims.append(len(claimed.rows))
        if any(row.event_id == "e10" for row in claimed.rows):
            sink.gate.set()  # e9 is still in flight: the next claim did not wait for it
        return claimed

    store.claim = claim  # type: ignore[method-assign]
    assert await run_until_empty(dispatcher) == 30
    assert sink.gate.is_set() and "e9" in sink.received  # e9 waited for the second claim, not in vain
    assert sorted(sink.received) == sorted(f"e{i}" for i in range(30))  # each once
    assert all(r["status"] == "published" for r in (await fetch_rows(store)).values())
    # Never more than a batch held, so a kill repeats at most one batch; a claim made with
    # rows in flight asks for fewer.
    assert max(sink.held) <= 10, sink.held
    assert claims[0] == 10 and any(n < 10 for n in claims[1:]), claims


async def test_a_claim_failing_while_rows_are_in_flight_loses_none_of_their_results(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(30)])
    sink = GatedSink(store, slow="e9")
    dispatcher = make_dispatcher(store, sink, batch_size=10, concurrency=4)
    real_claim = store.claim
    calls = 0

    async def claim(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # the claim made while e9 is in flight
            sink.gate.set()
            raise ConnectionError("database gone")
        return await real_claim(*args, **kwargs)

    store.claim = claim  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await dispatcher.run_once()  # raised once e9's delivery has ended
    assert sorted(sink.received) == sorted(f"e{i}" for i in range(10))
    assert sorted(r.event_id for r in dispatcher._unrecorded) == sorted(f"e{i}" for i in range(10))
    store.claim = real_claim  # type: ignore[method-assign]
    assert await run_until_empty(dispatcher) == 20  # the first claim writes the kept results
    rows = await fetch_rows(store)
    assert all(r["status"] == "published" for r in rows.values())
    assert sorted(sink.received) == sorted(f"e{i}" for i in range(30))  # none twice


async def test_a_successful_claim_inside_a_long_round_makes_the_lane_ready_again(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(30)])
    dispatcher = make_dispatcher(store, RecordingSink(), batch_size=10, concurrency=4)
    dispatcher.health.round_ended("database gone")  # rounds failed during an outage
    dispatcher.health.round_ended("database gone")
    failed_while_draining: list[int] = []
    real_claim = store.claim

    async def claim(*args: Any, **kwargs: Any) -> Any:
        claimed = await real_claim(*args, **kwargs)
        if any(row.event_id == "e29" for row in claimed.rows):  # a later claim of the same round
            failed_while_draining.append(dispatcher.health.failed_in_a_row)
        return claimed

    store.claim = claim  # type: ignore[method-assign]
    assert (await dispatcher.run_once()).claimed == 30  # one round
    assert failed_while_draining == [0]


def three_rounds_of_ten_rooms() -> list[dict[str, Any]]:
    """Rows 1-10: room r0's first event and nine other rooms; rows 11-20 and 21-30 likewise,
    each with r0's next event first."""
    return [
        envelope(f"r{room}-{n}", room_id=f"r{room}" if room == 0 else f"r{n}{room}")
        for n in range(3)
        for room in range(10)
    ]


async def test_per_room_a_claim_ahead_takes_the_next_rows_of_a_room_in_flight_and_delivers_them_after_it(
    store: MySQLStore,
) -> None:
    events = three_rounds_of_ten_rooms()
    await insert_events(store, events)
    sink = GatedSink(store, slow="r0-0")  # r0's first event is slow
    # A poll interval longer than the test: a row held back would wait for it.
    dispatcher = make_dispatcher(store, sink, batch_size=10, concurrency=4, per_room=True, poll_interval=30.0)
    ahead: list[list[str]] = []
    real_claim = store.claim

    async def claim(*args: Any, **kwargs: Any) -> Any:
        claimed = await real_claim(*args, **kwargs)
        if claimed.rows and not sink.gate.is_set() and "r0-0" not in [r.event_id for r in claimed.rows]:
            ahead.append([r.event_id for r in claimed.rows])  # made while r0-0 is in flight
            if "r0-1" in ahead[-1]:
                await anyio.wait_all_tasks_blocked()  # the workers free to take r0-1, had they been let
                assert "r0-1" not in sink.started
                sink.gate.set()
        return claimed

    store.claim = claim  # type: ignore[method-assign]
    with anyio.fail_after(10):
        assert await run_until_empty(dispatcher) == 30
    assert ahead and "r0-1" in ahead[0] and len(ahead[0]) >= 5, ahead  # r0's next row went ahead too
    assert [e for e in sink.started if e.startswith("r0-")] == ["r0-0", "r0-1", "r0-2"]  # in order, once
    assert sorted(sink.received) == sorted(e["event_id"] for e in events)
    assert max(sink.held) <= 10, sink.held  # a kill repeats at most one batch


async def test_per_room_rows_following_a_row_that_fails_are_released_and_delivered_after_its_retry(
    store: MySQLStore,
) -> None:
    events = three_rounds_of_ten_rooms()
    await insert_events(store, events)
    sink = GatedSink(store, slow="r0-0", fails=True)
    dispatcher = make_dispatcher(store, sink, batch_size=10, concurrency=4, per_room=True)
    real_claim = store.claim

    async def claim(*args: Any, **kwargs: Any) -> Any:
        claimed = await real_claim(*args, **kwargs)
        if "r0-1" in [r.event_id for r in claimed.rows] and not sink.gate.is_set():
            sink.gate.set()  # r0-0 fails with r0-1 waiting behind it
        return claimed

    store.claim = claim  # type: ignore[method-assign]
    with anyio.fail_after(10):
        while (await fetch_rows(store))["r0-2"]["status"] != "published":
            await run_until_empty(dispatcher)
    r0 = [e for e in sink.started if e.startswith("r0-")]
    assert r0 == ["r0-0", "r0-0", "r0-1", "r0-2"], r0  # r0-1 released untried, then in order
    assert sorted(sink.received) == sorted(e["event_id"] for e in events)  # each once
    rows = await fetch_rows(store)
    assert rows["r0-1"]["retry_count"] == 0  # released, not failed
    assert all(r["status"] == "published" for r in rows.values())


async def test_the_rows_of_a_claim_made_ahead_are_delivered_while_it_commits(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(30)])
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink, batch_size=10)
    real_claim = store.claim
    before_return: list[int] = []  # per claim made ahead: its rows delivered before it returned

    async def claim(*args: Any, **kwargs: Any) -> Any:
        claimed = await real_claim(*args, **kwargs)
        if claimed.rows and len(args) > 3 and args[3]:  # a claim with results: made during a round
            before_return.append(sum(row.event_id in sink.received for row in claimed.rows))
        return claimed

    store.claim = claim  # type: ignore[method-assign]
    assert await run_until_empty(dispatcher) == 30
    # (One that finds its results' write beside it blocked writes them itself and hands its
    # rows over on return: the last, short claim of a round may.)
    assert any(n > 0 for n in before_return), before_return
    assert sorted(sink.received) == sorted(f"e{i}" for i in range(30))  # each once
    assert all(r["status"] == "published" for r in (await fetch_rows(store)).values())


async def test_results_written_beside_a_claim_that_fails_are_not_written_again(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(20)])
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink, batch_size=10)
    real_due_ranges = store._due_ranges
    calls = 0

    async def due_ranges(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # the claim with the first batch's results, written beside it
            raise ConnectionError("database gone")
        return await real_due_ranges(*args, **kwargs)

    store._due_ranges = due_ranges  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await dispatcher.run_once()
    assert dispatcher._unrecorded == []  # written: not kept to be written again
    rows = await fetch_rows(store)
    assert sorted(e for e, r in rows.items() if r["status"] == "published") == sorted(f"e{i}" for i in range(10))
    with caplog.at_level(logging.INFO, logger="room_outbox"):
        assert await run_until_empty(dispatcher) == 10
    assert not [r.getMessage() for r in caplog.records if "not recorded" in r.getMessage()]
    assert sorted(sink.received) == sorted(f"e{i}" for i in range(20))  # none twice


async def test_per_room_stopping_releases_the_rows_waiting_behind_a_room_in_flight(store: MySQLStore) -> None:
    events = three_rounds_of_ten_rooms()
    await insert_events(store, events)
    sink = GatedSink(store, slow="r0-0")
    dispatcher = make_dispatcher(store, sink, batch_size=10, concurrency=4, per_room=True)
    real_claim = store.claim

    async def claim(*args: Any, **kwargs: Any) -> Any:
        claimed = await real_claim(*args, **kwargs)
        if "r0-1" in [r.event_id for r in claimed.rows]:
            dispatcher.stop()  # r0-1 waits behind r0-0, in flight
            sink.gate.set()
        return claimed

    store.claim = claim  # type: ignore[method-assign]
    with anyio.fail_after(10):
        await dispatcher.run_once()
        await dispatcher.flush()
    assert "r0-0" in sink.received and "r0-1" not in sink.started
    rows = await fetch_rows(store)
    assert rows["r0-0"]["status"] == "published"
    assert all(r["worker_id"] is None for r in rows.values())  # nothing left leased
    assert rows["r0-1"]["status"] == "pending" and rows["r0-1"]["retry_count"] == 0


def row_of(row_id: int, room: str) -> OutboxRow:
    return OutboxRow(row_id, f"e{row_id}", "RoomCreated", room, "default", None, 0, "c#1")


def test_feed_chained_a_rooms_next_queue_waits_for_the_one_taken_and_goes_once_it_is_published() -> None:
    feed = Feed(chained=True)
    a1, b1, a2 = row_of(1, "A"), row_of(2, "B"), row_of(3, "A")
    assert feed.put([[a1], [b1]], 2) == []
    assert feed.put([[a2]], 1, {("default", "A"): [1]}) == []
    assert feed.take() == [a1] and feed.take() == [b1] and feed.take() is None  # a2 waits behind a1
    assert feed.done([a1], published=True) == []
    assert feed.take() == [a2]


def test_feed_chained_the_queues_behind_one_not_published_are_returned_to_release() -> None:
    feed = Feed(chained=True)
    a1, a2, a3 = row_of(1, "A"), row_of(2, "A"), row_of(3, "A")
    feed.put([[a1]], 1)
    feed.put([[a2]], 1, {("default", "A"): [1]})
    feed.put([[a3]], 1, {("default", "A"): [1, 2]})
    assert feed.take() == [a1]
    assert feed.done([a1], published=False) == [[a2], [a3]]
    assert feed.take() is None
    # The room's next queue, claimed once those results are written, starts a chain of its own.
    assert feed.put([[row_of(4, "A")]], 1) == [] and feed.take() == [row_of(4, "A")]


def test_per_room_rows_following_a_row_that_ended_unpublished_before_they_were_handed_over_are_released() -> None:
    dispatcher = make_dispatcher(None, RecordingSink(), batch_size=10, per_room=True)
    feed = Feed(chained=True)
    failed = DeliveryResult(1, "e1", "c#1", Outcome.FAILED, "sink down")
    dispatcher._unrecorded.append(failed)  # its result came in after the claim began
    dispatcher._put(feed, [row_of(2, "A"), row_of(3, "B")], {1: ("default", "A")})
    assert feed.take() == [row_of(3, "B")] and feed.take() is None
    assert dispatcher._unrecorded[1:] == [DeliveryResult(2, "e2", "c#1", Outcome.RELEASED)]
    assert feed.outstanding == 1  # B's row
