"""What a lane of its own (``relay: lane_table``) skipped: an id missing longer than
``gap_timeout`` is taken as a rolled-back insert and its feeder goes on without it. When that
insert commits after all, the row was never fed into the lane's table; the feeder records the
ranges it gave up on (the table tailing lanes record theirs in), so that ``status`` and
``lanes`` count it (and the ``room_outbox_lane_skipped`` gauge, sampled from the same count),
``inspect`` says so and ``requeue --lane`` feeds it. On MariaDB and PostgreSQL."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from lanes.test_lanes import lane_dispatcher, lane_rows
from support import RecordingSink, envelope, execute, id_held_open, insert_events, wait_until

from bench.drive import run_until_empty
from room_outbox.attempt.retry import RetryPolicy
from room_outbox.cli import lanes as lanes_command
from room_outbox.cli.cancel import cancel_lane_command
from room_outbox.cli.inspect import inspect_events
from room_outbox.cli.requeue import requeue_lane_command
from room_outbox.config import LanePlan
from room_outbox.delivery.dispatcher import Dispatcher
from room_outbox.errors import SchemaError
from room_outbox.sink import PermanentSinkError
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.store import CURSOR_TABLE, migrate_lanes
from room_outbox.store.operator.changes import RequeueFilter
from room_outbox.store.operator.reports import lane_statuses
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.tail import SKIPPED_TABLE

pytestmark = pytest.mark.anyio

#: The lane's gap_timeout here: short, so that a test waits for it.
GAP_TIMEOUT = 0.5


@pytest.fixture(params=["mariadb", "postgresql"])
async def any_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    store = await open_store(
        request.getfixturevalue("database_dsn" if request.param == "mariadb" else "postgresql_dsn")
    )
    await store.migrate()
    await migrate_lanes(store, ["t"])
    try:
        yield store
    finally:
        await store.aclose()


async def past_everything(dispatcher: Dispatcher, store: SQLStore) -> None:
    """Rounds until the lane's watermark is at the highest id: every id still missing given up on."""
    async with store.transaction() as cur:
        await cur.execute("SELECT MAX(id) FROM room_outbox")
        (target,) = await cur.fetchone()

    async def past() -> bool:
        await run_until_empty(dispatcher)
        async with store.transaction() as cur:
            await cur.execute(f"SELECT fed_through_id FROM {CURSOR_TABLE} WHERE lane = 't'")
            return int((await cur.fetchone())[0]) >= int(target)

    await wait_until(past, timeout=GAP_TIMEOUT + 10)


async def skipped_count(store: SQLStore) -> int:
    (lane,) = [lane for lane in await lane_statuses(store) if lane.lane == "t"]
    return lane.skipped


async def test_a_row_committed_after_the_feeder_gave_up_on_its_id_is_shown_counted_and_fed_on_requeue(
    any_store: SQLStore,
) -> None:
    sink = RecordingSink()
    dispatcher = lane_dispatcher(any_store, sink, gap_timeout=GAP_TIMEOUT)
    await insert_events(any_store, [envelope("before")])
    async with id_held_open(any_store, "late"):
        await insert_events(any_store, [envelope("after")])
        await past_everything(dispatcher, any_store)
    await run_until_empty(dispatcher)
    assert sorted(sink.received) == ["after", "before"]
    assert "late" not in await lane_rows(any_store)  # never fed: the feeder never reads its id again

    assert await skipped_count(any_store) == 1
    shown = {row.lane: row for row in await lanes_command.lane_rows(any_store, LanePlan(main=True, own=("t",)))}
    assert (shown["t"].skipped, shown["main"].skipped) == (1, None)  # `lanes`; the gauge reads the same count
    (doc,) = await inspect_events(any_store, "late")
    assert str(doc["lanes"]["t"]).startswith("skipped by the lane, never fed to its table"), doc["lanes"]

    out, err = io.StringIO(), io.StringIO()
    assert await requeue_lane_command(any_store, "t", RequeueFilter(), False, out, err) == 0, err.getvalue()
    assert "1 event(s) would be requeued" in out.getvalue(), out.getvalue()
    assert "late" not in await lane_rows(any_store)
    out = io.StringIO()
    assert await requeue_lane_command(any_store, "t", RequeueFilter(event_ids=("late",)), True, out, err) == 0
    assert "requeued 1 event(s) in lane t" in out.getvalue(), out.getvalue() + err.getvalue()
    assert (await lane_rows(any_store))["late"]["status"] == "pending"
    await wait_until(lambda: _delivered(dispatcher, sink, "late"))
    assert sorted(sink.received) == ["after", "before", "late"]
    assert await skipped_count(any_store) == 0
    (doc,) = await inspect_events(any_store, "late")
    assert str(doc["lanes"]["t"]).startswith("published"), doc["lanes"]


async def test_inspect_names_a_skip_no_range_recorded_as_an_earlier_versions(any_store: SQLStore) -> None:
    """A feeder of an earlier version skipped ids without recording them: the row is still in
    room_outbox and below the lane's watermark, and inspect said "before its start, or cleaned
    up", neither true (retention removes a lane's rows with the outbox's)."""
    dispatcher = lane_dispatcher(any_store, RecordingSink(), gap_timeout=GAP_TIMEOUT)
    async with id_held_open(any_store, "late"):
        await insert_events(any_store, [envelope("after")])
        await past_everything(dispatcher, any_store)
    await execute(any_store, f"DELETE FROM {SKIPPED_TABLE}")  # as that version left it: no range
    (doc,) = await inspect_events(any_store, "late")
    assert doc["lanes"]["t"] == (
        "not in this lane: written before the lane started, or skipped by an earlier version of room-outbox,"
        " whose feeder recorded no skipped ids"
    )


async def test_requeue_lane_takes_a_lane_tables_parked_and_skipped_events_together_and_cancel_either(
    any_store: SQLStore,
) -> None:
    """A lane table's parked rows and the events its feeder skipped are one listing, one cap and
    one change for ``requeue --lane``; ``cancel --lane`` takes one of either kind."""
    sink = RecordingSink(fail={"bad-1", "bad-2"}, error=PermanentSinkError("too large"))
    dispatcher = lane_dispatcher(
        any_store, sink, gap_timeout=GAP_TIMEOUT, retry=RetryPolicy(parking=True, interval=0.05)
    )
    await insert_events(any_store, [envelope("bad-1")])
    async with id_held_open(any_store, "late-1"), id_held_open(any_store, "late-2"):
        await insert_events(any_store, [envelope("bad-2")])
        await past_everything(dispatcher, any_store)
    await run_until_empty(dispatcher)
    statuses = {event_id: row["status"] for event_id, row in (await lane_rows(any_store)).items()}
    assert statuses == {"bad-1": "failed", "bad-2": "failed"}  # the late ones never fed
    assert await skipped_count(any_store) == 2

    async def requeue(apply: bool, limit: int = 10_000, error_contains: str | None = None) -> Any:
        out, err = io.StringIO(), io.StringIO()
        where = RequeueFilter(error_contains=error_contains)
        assert await requeue_lane_command(any_store, "t", where, apply, out, err, limit, as_json=True) == 0, err
        return json.loads(out.getvalue())

    def listed(doc: Any) -> list[tuple[str, str]]:
        return [(row["event_id"], row["status"]) for row in doc["rows"]]

    doc = await requeue(False)  # both kinds, lowest ids first, one cap over both
    assert listed(doc) == [
        ("bad-1", "failed"), ("late-1", "skipped"), ("late-2", "skipped"), ("bad-2", "failed")]  # fmt: skip
    doc = await requeue(False, limit=3)
    assert (doc["matched"], doc["more"]) == (3, True)
    assert (await requeue(False, error_contains="TOO LARGE"))["matched"] == 2  # the lane's own error
    assert (await requeue(False, error_contains="feeder"))["matched"] == 2  # the skipped ones' error

    # cancel --lane: a parked row of the table, then a skipped event (fed in as cancelled)
    for event_id, was in (("bad-2", "failed"), ("late-2", "skipped")):
        out, err = io.StringIO(), io.StringIO()
        assert await cancel_lane_command(any_store, "t", event_id, out, err, apply=False) == 0, err.getvalue()
        assert out.getvalue().startswith(f"would cancel {event_id} in lane t (now {was})")
        assert await cancel_lane_command(any_store, "t", event_id, out, err) == 0, err.getvalue()
        assert (await lane_rows(any_store))[event_id]["status"] == "cancelled"
    err = io.StringIO()
    assert await cancel_lane_command(any_store, "t", "late-2", io.StringIO(), err) == 1
    assert (
        err.getvalue()
        == "room-outbox cancel: late-2 is cancelled in lane t: only parked (failed) events can be cancelled\n"
    )
    assert await skipped_count(any_store) == 1

    sink.fail.clear()
    doc = await requeue(True)  # what is left of both kinds, in one change
    assert listed(doc) == [("bad-1", "failed"), ("late-1", "skipped")]
    assert doc["requeued"] == 2
    await wait_until(lambda: _delivered(dispatcher, sink, "late-1"))
    await run_until_empty(dispatcher)
    statuses = {event_id: row["status"] for event_id, row in (await lane_rows(any_store)).items()}
    assert statuses == {"bad-1": "published", "late-1": "published", "late-2": "cancelled", "bad-2": "cancelled"}
    assert await skipped_count(any_store) == 0
    assert (await requeue(False))["matched"] == 0


async def _delivered(dispatcher: Dispatcher, sink: RecordingSink, event_id: str) -> bool:
    await run_until_empty(dispatcher)
    return event_id in sink.received


async def test_migrate_goes_on_past_a_lane_tables_own_skipped_events_and_run_needs_the_skipped_table(
    any_store: SQLStore,
) -> None:
    """The skipped ranges are the lane table's own: migrate neither refuses nor drops them (as
    it refuses a lane back from tailing with events skipped while it tailed). ``run`` needs the
    table where the feeder records them: migrate creates it with the lanes' tables."""
    dispatcher = lane_dispatcher(any_store, RecordingSink(), gap_timeout=GAP_TIMEOUT)
    await insert_events(any_store, [envelope("before")])
    async with id_held_open(any_store, "late"):
        await insert_events(any_store, [envelope("after")])
        await past_everything(dispatcher, any_store)
    assert await migrate_lanes(any_store, ["t"]) == []
    assert await skipped_count(any_store) == 1

    await execute(any_store, f"DROP TABLE {SKIPPED_TABLE}")
    with pytest.raises(SchemaError, match=f"table {SKIPPED_TABLE} does not exist: run `room-outbox migrate`"):
        await check_schema(any_store, lanes=["t"])
    assert await migrate_lanes(any_store, ["t"]) == [f"created table {SKIPPED_TABLE}"]
    await check_schema(any_store, lanes=["t"])
