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
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.clock import now_ms

pytestmark = pytest.mark.anyio

HELD = "SELECT COUNT(*) FROM room_outbox WHERE status = 'pending' AND worker_id IS NOT NULL"


class GatedSink:
    """Delivers at once, except ``slow``, which waits (5 s at most) for ``gate``; records what
    it received and, at each delivery, how many rows the database shows as claimed and not
    yet settled."""

    def __init__(self, store: MySQLStore, slow: str) -> None:
        self.store = store
        self.slow = slow
        self.gate = anyio.Event()
        self.received: list[str] = []
        self.held: list[int] = []

    async def deliver(self, env: Any) -> None:
        async with self.store.transaction() as cur:
            await cur.execute(HELD)
            self.held.append(int((await cur.fetchone())[0]))
        if env.event_id == self.slow:
            with anyio.fail_after(5):
                await self.gate.wait()
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


async def test_per_room_the_next_claim_skips_a_room_in_flight_without_holding_it_back(store: MySQLStore) -> None:
    # Rows 1-10: room r0's first event and nine other rooms; rows 11-20 and 21-30 likewise,
    # each with r0's next event first. r0's first event is slow.
    events = [
        envelope(f"r{room}-{n}", room_id=f"r{room}" if room == 0 else f"r{n}{room}")
        for n in range(3)
        for room in range(10)
    ]
    await insert_events(store, events)
    sink = GatedSink(store, slow="r0-0")
    # A poll interval longer than the test: a row held back would wait for it.
    dispatcher = make_dispatcher(store, sink, batch_size=10, concurrency=4, per_room=True, poll_interval=30.0)
    ahead: list[list[str]] = []
    r0_next_while_in_flight: list[dict[str, Any]] = []
    real_claim = store.claim

    async def claim(*args: Any, **kwargs: Any) -> Any:
        claimed = await real_claim(*args, **kwargs)
        if claimed.rows and not sink.gate.is_set() and "r0-0" not in [r.event_id for r in claimed.rows]:
            ahead.append([r.event_id for r in claimed.rows])  # made while r0-0 is in flight
            r0_next_while_in_flight.append((await fetch_rows(store))["r0-1"])
            sink.gate.set()
        return claimed

    store.claim = claim  # type: ignore[method-assign]
    with anyio.fail_after(10):
        assert await run_until_empty(dispatcher) == 30
    assert ahead and "r0-1" not in ahead[0] and len(ahead[0]) >= 5, ahead  # the other rooms' rows went ahead
    (r0_next,) = r0_next_while_in_flight
    assert r0_next["worker_id"] is None and (r0_next["lock_until_ms"] or 0) <= now_ms()  # not held back
    assert [e for e in sink.received if e.startswith("r0-")] == ["r0-0", "r0-1", "r0-2"]  # in order, once
    assert sorted(sink.received) == sorted(e["event_id"] for e in events)
    assert max(sink.held) <= 10, sink.held  # a kill repeats at most one batch


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


def test_per_room_a_claim_ahead_that_took_under_half_its_limit_makes_the_next_wait_for_every_result() -> None:
    per_room = make_dispatcher(None, RecordingSink(), batch_size=100, per_room=True)
    unordered = make_dispatcher(None, RecordingSink(), batch_size=100)
    assert per_room._outstanding_before_next_claim(limit=60, taken=30) == 50  # half taken: ahead again
    assert per_room._outstanding_before_next_claim(limit=60, taken=29) == 0  # hot rooms: in turn
    assert unordered._outstanding_before_next_claim(limit=60, taken=0) == 50
