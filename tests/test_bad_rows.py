"""Bad rows don't flood: failures retrying cannot fix back off exponentially up to retry.cap,
even with the V1 defaults (fixed interval, no parking), and a row failing again and again is
logged once, then in a periodic summary with counts."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from support import RecordingSink, envelope, fetch_rows, insert_events, insert_rows, make_dispatcher, wait_until

from room_outbox.attempt.retry import RetryPolicy
from room_outbox.delivery.dispatcher import Dispatcher
from room_outbox.delivery.failure_log import FailureLog
from room_outbox.sink import PermanentSinkError
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.clock import now_ms

pytestmark = pytest.mark.anyio

#: The V1 default strategy; the exponential parameters only apply to unfixable failures.
V1_RETRY = RetryPolicy(strategy="fixed_interval", interval=0.05, base=0.1, factor=2.0, cap=0.8, jitter=0.0)


def test_unfixable_failures_back_off_exponentially_whatever_the_strategy() -> None:
    for strategy in ("fixed_interval", "linear", "exponential"):
        policy = RetryPolicy(strategy=strategy, interval=1.0, base=1.0, factor=2.0, cap=300.0, jitter=0.0)
        delays = [policy.delay(n, permanent=True) for n in (1, 2, 3, 4, 9, 10, 1000)]
        assert delays == [1.0, 2.0, 4.0, 8.0, 256.0, 300.0, 300.0], strategy
    assert RetryPolicy(interval=1.0).delay(50) == 1.0  # a retryable failure keeps poll_interval


async def _retry_delays(store: MySQLStore, dispatcher: Dispatcher, event_id: str, attempts: int) -> list[float]:
    """The delay each attempt set before the row's next one (seconds, to the millisecond the
    clock allows). Between attempts the row is made due at once, as if the wait had passed,
    so the test waits for nothing."""
    delays = []
    for _ in range(attempts):
        before = now_ms()
        assert (await dispatcher.run_once()).claimed == 1
        after = now_ms()
        (result,) = [r for r in dispatcher._unrecorded if r.event_id == event_id]
        await dispatcher.flush()
        # The delay was added to a time between `before` and `after`.
        low, high = (result.retry_at_ms - after) / 1000, (result.retry_at_ms - before) / 1000
        matches = [d for d in (0.05, 0.1, 0.2, 0.4, 0.8) if low <= d <= high]
        delays.append(matches[0] if matches else round(low, 3))
        async with store.transaction() as cur:
            await cur.execute("UPDATE room_outbox SET lock_until_ms = 0 WHERE event_id = %s", (event_id,))
    return delays


@pytest.mark.parametrize(
    "kind",
    ["bad_envelope", "permanent"],  # an event no sink takes is parked at once (tests/test_dispatcher.py)
)
async def test_a_bad_row_backs_off_up_to_the_cap_without_parking(store: MySQLStore, kind: str) -> None:
    sink = RecordingSink(fail={"bad"}, error=PermanentSinkError("group gone"))
    if kind == "bad_envelope":
        await insert_rows(store, [("default", "bad", "RoomUserJoined", "r_1", "{not json")])
    else:
        await insert_events(store, [envelope("bad", "RoomUserJoined")])
    dispatcher = make_dispatcher(store, sink, retry=V1_RETRY)
    delays = await _retry_delays(store, dispatcher, "bad", 6)
    assert delays == [0.1, 0.2, 0.4, 0.8, 0.8, 0.8]


async def test_a_retryable_failure_keeps_the_poll_interval(store: MySQLStore) -> None:
    await insert_events(store, [envelope("flaky")])
    dispatcher = make_dispatcher(store, RecordingSink(fail={"flaky"}), retry=V1_RETRY)
    assert await _retry_delays(store, dispatcher, "flaky", 4) == [0.05, 0.05, 0.05, 0.05]


@pytest.mark.parametrize("kind", ["bad_envelope", "permanent"])
async def test_per_room_parks_a_row_that_can_never_succeed_even_without_parking(store: MySQLStore, kind: str) -> None:
    """Left pending, it would hold back its room for ever: parked (status failed, envelope and
    error kept), and the room's later events go out in order."""
    sink = RecordingSink(fail={"bad"}, error=PermanentSinkError("group gone"))
    if kind == "bad_envelope":
        await insert_rows(store, [("", "bad", "RoomUserJoined", "r_1", "{not json")])
    else:
        await insert_events(store, [envelope("bad", "RoomUserJoined")])
    await insert_events(store, [envelope("after1"), envelope("after2")])
    dispatcher = make_dispatcher(store, sink, retry=V1_RETRY, per_room=True, concurrency=4)
    assert not dispatcher.options.retry.parking

    async def room_delivered() -> bool:
        await dispatcher.run_once()
        await dispatcher.flush()
        return {r["status"] for r in (await fetch_rows(store)).values()} == {"failed", "published"}

    await wait_until(room_delivered, timeout=20)
    rows = await fetch_rows(store)
    assert rows["bad"]["status"] == "failed" and rows["bad"]["retry_count"] == 1
    assert [e for e in sink.received if e != "bad"] == ["after1", "after2"]


async def test_an_envelope_whose_event_id_is_empty_is_parked_as_malformed(store: MySQLStore) -> None:
    """An event_id that is empty names no event (clients and consumers de-duplicate by it): the
    row is parked, its error naming the field, and its room's later events go out."""
    await insert_rows(store, [("", "", "RoomUserJoined", "r_1", json.dumps(envelope("")))])
    await insert_events(store, [envelope("after1")])
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink, retry=V1_RETRY, per_room=True)

    async def room_delivered() -> bool:
        await dispatcher.run_once()
        await dispatcher.flush()
        return {r["status"] for r in (await fetch_rows(store)).values()} == {"failed", "published"}

    await wait_until(room_delivered, timeout=20)
    rows = await fetch_rows(store)
    assert rows[""]["last_error"].startswith("malformed envelope: event_id: empty: it names no event")
    assert sink.received == ["after1"]


async def test_per_room_keeps_retrying_a_retryable_failure_without_parking(store: MySQLStore) -> None:
    """Retrying may fix it (an IM outage): the room waits for it, in order, as before."""
    await insert_events(store, [envelope("flaky"), envelope("after")])
    sink = RecordingSink(fail={"flaky"})
    dispatcher = make_dispatcher(store, sink, retry=V1_RETRY, per_room=True)
    for _ in range(3):
        await dispatcher.run_once()
        await dispatcher.flush()
        async with store.transaction() as cur:  # due at once, as if the retry delay had passed
            await cur.execute("UPDATE room_outbox SET lock_until_ms = 0 WHERE event_id = 'flaky'")
    rows = await fetch_rows(store)
    assert (rows["flaky"]["status"], rows["flaky"]["retry_count"]) == ("pending", 3)
    assert rows["after"]["status"] == "pending" and sink.received == ["flaky"] * 3


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _warnings(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "room_outbox.dispatcher" and r.getMessage() == message]


async def test_repeated_failures_of_a_row_are_logged_once_then_summarised(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    await insert_rows(store, [("default", f"bad{n}", "RoomUserJoined", "r_1", "{not json") for n in range(3)])
    await insert_events(store, [envelope("flaky")])
    sink = RecordingSink(fail={"flaky"})
    dispatcher = make_dispatcher(store, sink, retry=V1_RETRY)
    clock = Clock()
    dispatcher.failures = FailureLog(logging.getLogger("room_outbox.dispatcher"), 60.0, clock=clock, lane="main")
    caplog.set_level(logging.WARNING, "room_outbox.dispatcher")
    for _ in range(5):  # five failed attempts of every row
        assert (await dispatcher.run_once()).claimed == 4
        await dispatcher.flush()
        async with store.transaction() as cur:
            await cur.execute("UPDATE room_outbox SET lock_until_ms = 0")
        clock.now += 1
        dispatcher.failures.summarise()  # not due yet: nothing
    first = _warnings(caplog, "delivery failed")
    assert sorted(r.__dict__["event_id"] for r in first) == ["bad0", "bad1", "bad2", "flaky"]  # 20 failures, 4 lines
    assert _warnings(caplog, "repeated delivery failures (not logged one by one)") == []

    clock.now += 60
    dispatcher.failures.summarise()
    (summary,) = _warnings(caplog, "repeated delivery failures (not logged one by one)")
    fields: dict[str, Any] = summary.__dict__
    assert (fields["held_back"], fields["rows"], fields["lane"]) == (16, 4, "main")
    assert {entry["event_id"]: entry["failures"] for entry in fields["most_frequent"]} == {
        "bad0": 4, "bad1": 4, "bad2": 4, "flaky": 4,
    }  # fmt: skip
    assert fields["most_frequent"][0]["error"]  # the latest error of each

    # A row that is published again is forgotten: its next failure is news, logged in full.
    sink.fail.clear()
    assert (await dispatcher.run_once()).claimed == 4
    await dispatcher.flush()
    sink.fail.add("flaky")
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status = 'pending', lock_until_ms = 0 WHERE event_id = 'flaky'")
    caplog.clear()
    await dispatcher.run_once()
    assert [r.__dict__["event_id"] for r in _warnings(caplog, "delivery failed")] == ["flaky"]


class FailsAtFirst(RecordingSink):
    """Refuses ``flaky`` its first ``times`` attempts, then takes it; each attempt of it moves
    ``clock`` on by a second."""

    def __init__(self, times: int, clock: Clock) -> None:
        super().__init__(fail={"flaky"})
        self.times = times
        self.clock = clock

    async def deliver(self, envelope: Any) -> None:
        if envelope.event_id == "flaky":
            self.clock.now += 1
            if self.received.count("flaky") >= self.times:
                self.fail.clear()
        await super().deliver(envelope)


async def test_repeated_failures_are_summarised_while_a_backlog_keeps_the_round_going(
    store: MySQLStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each claim writes the last one's failure itself, and so sees that row due again:
    # written beside it, the row may come back a claim later and the round end first.
    monkeypatch.setattr(MySQLStore, "writes_beside_claims", False)
    await insert_events(store, [envelope("flaky"), *(envelope(f"e{n}") for n in range(5))])
    clock = Clock()
    sink = FailsAtFirst(times=3, clock=clock)
    # Batch 1 and failures due again at once: every claim is full, so one round goes on until
    # flaky is through.
    dispatcher = make_dispatcher(store, sink, batch_size=1, retry=RetryPolicy(interval=0.0))
    dispatcher.failures = FailureLog(logging.getLogger("room_outbox.dispatcher"), 1.0, clock=clock, lane="main")
    caplog.set_level(logging.WARNING, "room_outbox.dispatcher")
    round_ = await dispatcher.run_once()
    assert sink.received.count("flaky") == 4 and round_.claimed == 9
    assert len(_warnings(caplog, "delivery failed")) == 1  # the first failure; the others held back
    assert _warnings(caplog, "repeated delivery failures (not logged one by one)")  # within the round


def test_the_failure_log_forgets_quiet_rows_and_stays_bounded() -> None:
    clock = Clock()
    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test.failure_log")
    logger.addHandler(Capture())
    logger.propagate = False
    failures = FailureLog(logger, interval=10.0, max_rows=100, clock=clock)
    for n in range(1000):
        failures.failed(f"e{n}", "delivery failed", {}, "boom")
    assert len(failures._rows) == 100 and records.count("delivery failed") == 1000
    failures.failed("e999", "delivery failed", {}, "boom")  # remembered: counted, not logged
    assert records.count("delivery failed") == 1000
    clock.now += 11 * 10.0 + 1
    failures.summarise()
    assert len(failures._rows) == 0  # quiet for ten intervals: forgotten
    failures.failed("e999", "delivery failed", {}, "boom")
    assert records.count("delivery failed") == 1001
