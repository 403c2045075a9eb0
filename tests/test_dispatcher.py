"""The main lane's dispatcher on a real MariaDB: results, bad input, batching, store errors."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import anyio
import pytest
from support import (
    RecordingSink,
    envelope,
    fetch_rows,
    insert_events,
    insert_rows,
    make_dispatcher,
    running,
    wait_until,
)

from bench.drive import run_until_empty
from room_outbox.attempt.retry import RetryPolicy
from room_outbox.sink import PermanentSinkError, RetryableSinkError, ThrottledSinkError
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio


async def test_success_marks_published_and_clears_the_lease(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1"), envelope("e2", "RoomGiftSent", "r_2")])
    sink = RecordingSink()
    assert await run_until_empty(make_dispatcher(store, sink)) == 2
    rows = await fetch_rows(store)
    assert sorted(sink.received) == ["e1", "e2"]
    for row in rows.values():
        assert (row["status"], row["last_error"], row["worker_id"], row["retry_count"]) == ("published", None, None, 0)


async def test_failure_stays_pending_with_retry_count_and_error(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1"), envelope("e2")])
    await run_until_empty(make_dispatcher(store, RecordingSink(fail={"e1"})))
    rows = await fetch_rows(store)
    assert (rows["e1"]["status"], rows["e1"]["retry_count"], rows["e1"]["last_error"]) == (
        "pending",
        1,
        "test: refused e1",
    )
    assert rows["e1"]["worker_id"] is None
    assert rows["e2"]["status"] == "published"  # one failure does not stop the batch


async def test_fixed_interval_retries_on_the_next_scan_and_then_succeeds(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1")])
    sink = RecordingSink(fail={"e1"})
    dispatcher = make_dispatcher(store, sink, poll_interval=0.05)
    await run_until_empty(dispatcher)
    assert await run_until_empty(dispatcher) == 0  # not due before the interval has passed
    sink.fail.clear()

    async def published() -> bool:
        await run_until_empty(dispatcher)
        return (await fetch_rows(store))["e1"]["status"] == "published"

    await wait_until(published)
    row = (await fetch_rows(store))["e1"]
    assert (row["retry_count"], row["last_error"]) == (1, None)
    assert sink.received == ["e1", "e1"]


@pytest.mark.serial
async def test_a_throttled_delivery_is_released_unattempted_until_its_slot(store: MySQLStore) -> None:
    """A sink's own limit held the event back (any sink may say so): no retry counted, no
    error, never parked, not claimable before the slot; with per-room ordering the room's
    later events wait behind it."""
    await insert_events(store, [envelope("e1"), envelope("e2"), envelope("other", room_id="r_2")])
    sink = RecordingSink(fail={"e1"}, error=ThrottledSinkError("own limit", retry_after=30))
    dispatcher = make_dispatcher(
        store, sink, per_room=True, retry=RetryPolicy(parking=True, max_attempts=1, interval=0.05)
    )
    before = int(time.time() * 1000)
    await run_until_empty(dispatcher)
    rows = await fetch_rows(store)
    e1 = rows["e1"]
    assert (e1["status"], e1["retry_count"], e1["last_error"], e1["worker_id"]) == ("pending", 0, None, None)
    assert before + 30_000 <= e1["lock_until_ms"] <= int(time.time() * 1000) + 30_000
    assert (rows["e2"]["status"], rows["e2"]["retry_count"]) == ("pending", 0)  # released behind it
    assert rows["other"]["status"] == "published"
    assert await run_until_empty(dispatcher) == 0  # nothing of the room before the slot
    assert sorted(sink.received) == ["e1", "other"]


async def test_a_hanging_delivery_is_bounded_by_publish_timeout(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(5)])
    started = time.monotonic()
    await run_until_empty(make_dispatcher(store, RecordingSink(hang={"e2"}), publish_timeout=0.3))
    assert time.monotonic() - started < 2.0
    rows = await fetch_rows(store)
    assert rows["e2"]["status"] == "pending"
    assert rows["e2"]["last_error"] == "test: no answer within publish_timeout 0.3s"
    assert [rows[f"e{i}"]["status"] for i in (0, 1, 3, 4)] == ["published"] * 4


async def test_one_worker_bounds_each_hanging_delivery_and_goes_on(store: MySQLStore) -> None:
    # One worker takes every queue: each hanging call gets its own publish_timeout, and the
    # worker goes on with the rest of the batch after each; per room, a row that timed out
    # releases the rest of its room (not published, not attempted).
    rooms = {"e0": "r_a", "e1": "r_a", "e2": "r_a", "e3": "r_b", "e4": "r_c", "e5": "r_c"}
    await insert_events(store, [envelope(event_id, room_id=room) for event_id, room in rooms.items()])
    sink = RecordingSink(hang={"e1", "e4"}, delay=0.2)
    dispatcher = make_dispatcher(store, sink, publish_timeout=0.5, concurrency=1, per_room=True)
    started = time.monotonic()
    await run_until_empty(dispatcher)
    assert time.monotonic() - started < 3.0
    rows = await fetch_rows(store)
    for hung in ("e1", "e4"):
        assert (rows[hung]["status"], rows[hung]["last_error"]) == (
            "pending",
            "test: no answer within publish_timeout 0.5s",
        )
    assert [rows[e]["status"] for e in ("e0", "e3")] == ["published"] * 2
    assert [(rows[e]["status"], rows[e]["retry_count"]) for e in ("e2", "e5")] == [("pending", 0)] * 2
    assert sink.received == ["e0", "e1", "e3", "e4"]


async def test_a_worker_waiting_for_rows_longer_than_publish_timeout_times_nothing_out(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Between claims a worker waits for rows inside the scope that bounds its sink calls:
    the wait must not count against the call before it, however long the claim takes."""
    await insert_events(store, [envelope(f"e{i}", room_id=f"r{i}") for i in range(3)])
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink, publish_timeout=0.1, batch_size=1, concurrency=1)
    claim = store.claim

    async def slow_claim(*args: Any, **kwargs: Any) -> Any:
        if sink.received:  # the worker has delivered and now waits for the next row
            await anyio.sleep(0.3)
        return await claim(*args, **kwargs)

    dispatcher.store.claim = slow_claim
    with caplog.at_level(logging.INFO, logger="room_outbox"):
        await run_until_empty(dispatcher)
    rows = await fetch_rows(store)
    assert [(rows[f"e{i}"]["status"], rows[f"e{i}"]["last_error"]) for i in range(3)] == [("published", None)] * 3
    assert sink.received == ["e0", "e1", "e2"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # no timeout, none stale


async def test_per_room_a_claim_takes_the_next_row_of_a_room_whose_result_it_writes(store: MySQLStore) -> None:
    """A per-room claim carries the result of the room's row before: that row is still open
    when the claim reads (on MySQL the claim reads before it writes), yet published by the
    same transaction, so it holds nothing back: every claim takes the room's next row."""
    await insert_events(store, [envelope(f"e{i}", room_id="r_a") for i in range(3)])
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink, batch_size=1, concurrency=1, per_room=True)
    taken: list[int] = []
    claim = store.claim

    async def counted(*args: Any, **kwargs: Any) -> Any:
        claimed = await claim(*args, **kwargs)
        taken.append(len(claimed.rows))
        return claimed

    dispatcher.store.claim = counted
    await run_until_empty(dispatcher)
    assert taken == [1, 1, 1, 0] and sink.received == ["e0", "e1", "e2"]
    assert {r["status"] for r in (await fetch_rows(store)).values()} == {"published"}


async def test_per_room_a_published_result_taken_over_meanwhile_holds_its_room_back(store: MySQLStore) -> None:
    """The result of e0 reaches the claim after another claim took e0 over (a paused
    process): e0 is open elsewhere, so the room's next row is not claimed with it."""
    await insert_events(store, [envelope("e0", room_id="r_a"), envelope("e1", room_id="r_a")])

    class TakenOver(RecordingSink):
        async def deliver(self, env: Any) -> None:
            await super().deliver(env)
            if env.event_id == "e0":
                async with store.transaction() as cur:
                    await cur.execute(
                        "UPDATE room_outbox SET worker_id = 'other#1', lock_until_ms = %s WHERE event_id = 'e0'",
                        (int(time.time() * 1000) + 600_000,),
                    )

    sink = TakenOver()
    await run_until_empty(make_dispatcher(store, sink, batch_size=1, concurrency=1, per_room=True))
    rows = await fetch_rows(store)
    assert (rows["e0"]["status"], rows["e0"]["worker_id"]) == ("pending", "other#1")
    assert rows["e1"]["status"] == "pending" and sink.received == ["e0"]


async def test_per_room_a_row_whose_lease_ran_out_is_not_taken_again_by_the_claim_carrying_its_result(
    store: MySQLStore,
) -> None:
    """e0's lease ran out during its delivery (as after a pause): the next claim finds it due,
    but that claim also writes e0's result, which decides: published, delivered once."""
    await insert_events(store, [envelope("e0", room_id="r_a")])

    class LeaseRunsOut(RecordingSink):
        async def deliver(self, env: Any) -> None:
            await super().deliver(env)
            if env.event_id == "e0":
                async with store.transaction() as cur:
                    await cur.execute("UPDATE room_outbox SET lock_until_ms = 1 WHERE event_id = 'e0'")

    sink = LeaseRunsOut()
    await run_until_empty(make_dispatcher(store, sink, batch_size=1, concurrency=1, per_room=True))
    assert (await fetch_rows(store))["e0"]["status"] == "published"
    assert sink.received == ["e0"]


class _AnswersLate(RecordingSink):
    """Answers ``late`` only after the deadline, shielded from the cancellation (as a call that
    cannot be interrupted), so the deadline has passed when the call returns."""

    def __init__(self, late: str, after: float) -> None:
        super().__init__()
        self.late, self.after = late, after

    async def deliver(self, envelope: Any) -> None:
        if envelope.event_id == self.late:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(self.after)
        await super().deliver(envelope)


async def test_an_answer_after_the_deadline_is_a_timeout_of_its_own_row_only(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e0", room_id="r_a"), envelope("e1", room_id="r_b")])
    sink = _AnswersLate("e0", after=0.5)
    await run_until_empty(make_dispatcher(store, sink, publish_timeout=0.2, concurrency=1))
    rows = await fetch_rows(store)
    assert (rows["e0"]["status"], rows["e0"]["last_error"]) == (
        "pending",
        "test: no answer within publish_timeout 0.2s",
    )
    assert (rows["e1"]["status"], rows["e1"]["last_error"]) == ("published", None)
    assert sink.received == ["e0", "e1"]


async def test_a_sink_bug_is_recorded_not_lost(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1")])
    await run_until_empty(make_dispatcher(store, RecordingSink(fail={"e1"}, error=KeyError("boom"))))
    assert (await fetch_rows(store))["e1"]["last_error"] == "test: unexpected KeyError: 'boom'"


async def bad_failing_until_parked(
    store: MySQLStore, raised: BaseException
) -> tuple[dict[str, dict[str, Any]], RecordingSink]:
    """Events "bad", whose delivery raises ``raised``, and "good" (another room), delivered with
    two attempts and parking until "bad" is parked: the rows then, and the sink."""
    await insert_events(store, [envelope("bad"), envelope("good", room_id="r_2")])
    sink = RecordingSink(fail={"bad"}, error=raised)
    dispatcher = make_dispatcher(store, sink, retry=RetryPolicy(parking=True, max_attempts=2, interval=0.05))

    async def bad_parked() -> bool:
        await run_until_empty(dispatcher)
        return (await fetch_rows(store))["bad"]["status"] == "failed"  # parked

    with anyio.fail_after(20):
        await wait_until(bad_parked)
    return await fetch_rows(store), sink


@pytest.mark.parametrize(
    "raised",
    [asyncio.CancelledError(), SystemExit(3), BaseException("plain base"), KeyboardInterrupt(), GeneratorExit("bug")],
    ids=["CancelledError", "SystemExit", "BaseException", "KeyboardInterrupt", "GeneratorExit"],
)
async def test_a_sink_raising_a_base_exception_is_a_counted_sink_bug(store: MySQLStore, raised: BaseException) -> None:
    """What no sink may raise (KeyboardInterrupt, SystemExit, its own CancelledError or
    GeneratorExit) is a bug in the sink like any other: counted, recorded, parked after the
    last attempt, while the lane goes on with the other events."""
    rows, sink = await bad_failing_until_parked(store, raised)
    expected_error = f"test: unexpected {type(raised).__name__}" + (f": {raised}" if str(raised) else "")
    assert (rows["bad"]["retry_count"], rows["bad"]["last_error"]) == (2, expected_error)
    assert rows["good"]["status"] == "published"
    assert sink.received.count("bad") == 2


class Unprintable(Exception):
    """A sink's exception whose message cannot be read."""

    def __str__(self) -> str:
        raise RuntimeError("str exploded")


@pytest.mark.parametrize(
    ("raised", "expected_error"),
    [
        (Unprintable(), "test: unexpected Unprintable (its message could not be read: RuntimeError: str exploded)"),
        (RetryableSinkError(Unprintable()), "test: RetryableSinkError (its message could not be read: RuntimeError: str exploded)"),
    ],
    ids=["bare", "wrapped"],
)  # fmt: skip
async def test_a_sink_exception_whose_message_cannot_be_read_is_counted_and_parked(
    store: MySQLStore, raised: Exception, expected_error: str
) -> None:
    """Its attempts are recorded and counted like any failure's (the round never fails over
    it, the event is not delivered again for ever), and max_attempts parks it."""
    rows, sink = await bad_failing_until_parked(store, raised)
    assert (rows["bad"]["retry_count"], rows["bad"]["last_error"]) == (2, expected_error)
    assert rows["good"]["status"] == "published"
    assert sink.received.count("bad") == 2


async def test_a_permanent_error_stays_pending_in_v1(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1")])
    sink = RecordingSink(fail={"e1"}, error=PermanentSinkError("ErrorCode 10010 group dismissed"))
    await run_until_empty(make_dispatcher(store, sink))
    row = (await fetch_rows(store))["e1"]
    assert (row["status"], row["last_error"]) == ("pending", "test: permanent: ErrorCode 10010 group dismissed")


@pytest.mark.parametrize(
    ("row", "error"),
    [
        (("", "bad_json", "RoomUserJoined", "r_1", "{not json"), "malformed envelope: document: Invalid JSON"),
        (("", "no_room", "RoomUserJoined", "r_1", '{"event_id": "no_room", "event_type": "RoomUserJoined"}'),
         "malformed envelope: room_id: Field required"),
        (("", "mismatch", "RoomUserJoined", "r_1", '{"event_id": "other", "event_type": "RoomUserJoined", "room_id": "r_1"}'),
         "envelope event_id 'other' differs from the row's 'mismatch'"),
        (("app_b", "other_app", "RoomUserJoined", "r_1", '{"event_id": "other_app", "event_type": "RoomUserJoined", "room_id": "r_1", "app_code": "app_a"}'),
         "envelope app_code 'app_a' differs from the row's 'app_b'"),
        (("app_b", "no_app", "RoomUserJoined", "r_1", '{"event_id": "no_app", "event_type": "RoomUserJoined", "room_id": "r_1"}'),
         "envelope app_code '' differs from the row's 'app_b'"),
        (("", "unknown_type", "RoomTeleported", "r_1", '{"event_id": "unknown_type", "event_type": "RoomTeleported", "room_id": "r_1"}'),
         "no sink for event_type RoomTeleported"),
        (("", "bad_utf8", "RoomUserJoined", "r_1", b'{"event_id": "bad_utf8", "x": "\xff\xfe"}'),
         "envelope is not valid UTF-8"),
        (("", "not_finite", "RoomHeatChanged", "r_1", '{"event_id": "not_finite", "event_type": "RoomHeatChanged", "room_id": "r_1", "payload": {"heat": NaN}}'),
         "malformed envelope: payload.heat: not a finite number"),
        (("", "null_envelope", "RoomUserJoined", "r_1", None), "no envelope: the column is NULL"),
        (("", "bool_version", "RoomUserJoined", "r_1", '{"event_id": "bool_version", "event_type": "RoomUserJoined", "room_id": "r_1", "room_version": true}'),
         "malformed envelope: room_version: Input should be an integer (a whole number, or its decimal digits in a string), not true"),
    ],
)  # fmt: skip
async def test_bad_input_gets_a_clear_error_and_blocks_nothing(
    store: MySQLStore, row: tuple[str, str, str, str, str | bytes | None], error: str
) -> None:
    if not isinstance(row[4], str):
        async with store.transaction() as cur:  # deployments that store envelopes as BLOB (NULL allowed here)
            await cur.execute("ALTER TABLE room_outbox MODIFY envelope LONGBLOB NULL")
    await insert_rows(store, [row])
    await insert_events(store, [envelope("good")])
    sink = RecordingSink()
    # The bad row's next try is a minute away, so it is tried exactly once however slow the
    # machine is (with the poll interval as the retry delay it could come due again).
    retry = RetryPolicy(interval=60.0, base=60.0, cap=60.0, jitter=0.0)
    await run_until_empty(make_dispatcher(store, sink, batch_size=1, retry=retry))
    rows = await fetch_rows(store)
    bad = rows[row[1]]
    # An event no sink takes is parked at once (retrying cannot route it); the others retry.
    expected_status = "failed" if row[1] == "unknown_type" else "pending"
    assert bad["status"] == expected_status and bad["retry_count"] == 1
    assert bad["last_error"].startswith(error), bad["last_error"]
    assert bad["envelope"] == row[4]  # never rewritten or deleted
    assert rows["good"]["status"] == "published" and sink.received == ["good"]


async def test_an_app_code_mismatch_is_a_permanent_bad_envelope(store: MySQLStore) -> None:
    """Credentials follow the envelope's app_code, ordering the row's: they must agree."""

    mixed = envelope("mixed", app_code="app_a")
    await insert_rows(store, [("app_b", "mixed", "RoomUserJoined", "r_1", json.dumps(mixed))])
    sink = RecordingSink()
    await run_until_empty(make_dispatcher(store, sink, retry=RetryPolicy(interval=0.05, parking=True)))
    row = (await fetch_rows(store))["mixed"]
    assert (row["status"], row["last_error"]) == ("failed", "envelope app_code 'app_a' differs from the row's 'app_b'")
    assert sink.received == []


async def test_last_error_is_short_and_redacted(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1")])
    dispatcher = make_dispatcher(
        store, RecordingSink(fail={"e1"}, error=RuntimeError("key=TOPSECRETKEY " + "x" * 2000))
    )
    dispatcher.redactor.add("TOPSECRETKEY")
    await run_until_empty(dispatcher)
    error = (await fetch_rows(store))["e1"]["last_error"]
    assert len(error) <= 512 and "TOPSECRETKEY" not in error and "[REDACTED]" in error


async def test_a_backlog_drains_without_waiting_for_the_poll_interval(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(450)])
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink, batch_size=100, poll_interval=30.0)

    async def all_published() -> bool:
        return all(r["status"] == "published" for r in (await fetch_rows(store)).values())

    async with running(dispatcher):
        await wait_until(all_published, timeout=10.0)  # far less than one 30 s poll interval
    assert len(sink.received) == 450


async def test_results_are_written_in_batches_not_per_row(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(500)])
    transactions = 0
    real = store.transaction

    def counting() -> object:
        nonlocal transactions
        transactions += 1
        return real()

    store.transaction = counting  # type: ignore[method-assign]
    await run_until_empty(make_dispatcher(store, RecordingSink(), batch_size=100))
    store.transaction = real  # type: ignore[method-assign]
    # 6 claims, and beside each but the first the previous batch's results in a transaction
    # of their own: a commit or two per batch, not one per row
    assert transactions == 6 + 5
    assert all(r["status"] == "published" for r in (await fetch_rows(store)).values())


async def test_store_errors_are_logged_and_the_loop_survives(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Rounds failing one after another (the table gone) are logged once, not once a round;
    the loop goes on, and says so once a round succeeds again."""
    await insert_events(store, [envelope("e1")])
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink, poll_interval=0.05)
    async with store.transaction() as cur:
        await cur.execute("RENAME TABLE room_outbox TO room_outbox_away")
    async with running(dispatcher):
        await wait_until(lambda: dispatcher.health.failed_in_a_row >= 5)
        async with store.transaction() as cur:
            await cur.execute("RENAME TABLE room_outbox_away TO room_outbox")

        async def published() -> bool:
            return (await fetch_rows(store))["e1"]["status"] == "published"

        await wait_until(published)
    assert sink.received == ["e1"]
    failed = [r for r in caplog.records if r.message.startswith("outbox round failed")]
    assert len(failed) == 1 and "room_outbox" in failed[0].error and failed[0].lane == "main"
    [recovered] = [r for r in caplog.records if r.message == "outbox rounds succeed again"]
    assert recovered.failed_rounds >= 5 and recovered.lane == "main"


async def test_failed_events_are_logged_with_seed_000_fields(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    await insert_events(store, [envelope("e1", "RoomGiftSent", "r_7")])
    with caplog.at_level(logging.WARNING):
        await run_until_empty(make_dispatcher(store, RecordingSink(fail={"e1"})))
    (record,) = [r for r in caplog.records if r.message == "delivery failed"]
    assert (record.event_id, record.event_type, record.room_id, record.retry_count, record.status) == (  # type: ignore[attr-defined]
        "e1", "RoomGiftSent", "r_7", 1, "pending",
    )  # fmt: skip
    assert record.error == "test: refused e1"  # type: ignore[attr-defined]
    assert record.app_code == "default"  # type: ignore[attr-defined]  # ids repeat across apps


async def test_a_round_starts_no_more_delivery_workers_than_a_batch_holds(
    store: MySQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``concurrency`` far above ``batch_size``: each round starts ``batch_size`` workers, not
    one task per unit of concurrency (a million took the memory and delivered nothing)."""
    from room_outbox.delivery.dispatcher import Dispatcher

    started = 0
    deliver_in_turn = Dispatcher.deliver_in_turn

    async def counted(self: Any, *args: Any) -> Any:
        nonlocal started
        started += 1
        return await deliver_in_turn(self, *args)

    monkeypatch.setattr(Dispatcher, "deliver_in_turn", counted)
    await insert_events(store, [envelope(f"e{n}") for n in range(3)])
    dispatcher = make_dispatcher(store, RecordingSink(), batch_size=5, concurrency=50)
    await run_until_empty(dispatcher)
    assert started == 5
    assert (await fetch_rows(store))["e2"]["status"] == "published"
