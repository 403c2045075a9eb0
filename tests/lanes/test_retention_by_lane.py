"""Retention and lanes: while the main lane is off a row goes once every enabled lane has
finished it, whatever its status; a lane that never ran holds everything; a switched-off
lane's leftovers are named while they hold rows back."""

from __future__ import annotations

import pytest
from lanes.test_lanes import lane_dispatcher, lane_rows
from support import RecordingSink, envelope, fetch_rows, insert_events

from bench.drive import run_until_empty
from room_outbox.config import LanePlan
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.lanes.store import migrate_lanes
from room_outbox.store.operator.retention import RetentionOptions, cleanup

pytestmark = pytest.mark.anyio
OPTIONS = RetentionOptions(older_than=86400, pause=0)


async def age_everything(store: MySQLStore) -> None:
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET created_at_ms = created_at_ms - 864000000")


async def test_with_the_im_lane_off_status_does_not_decide(store: MySQLStore) -> None:
    await migrate_lanes(store, ["t"])
    dispatcher = lane_dispatcher(store, RecordingSink(fail={"owed"}))
    await insert_events(store, [envelope(e) for e in ("pending", "pushed", "parked", "owed")])
    async with store.transaction() as cur:  # what room-service's own pushes left behind
        await cur.execute("UPDATE room_outbox SET status = 'published' WHERE event_id = 'pushed'")
        await cur.execute("UPDATE room_outbox SET status = 'failed' WHERE event_id = 'parked'")
    await run_until_empty(dispatcher)  # the lane has all but "owed"
    await insert_events(store, [envelope("unfed")])
    await age_everything(store)

    report = await cleanup(store, OPTIONS, LanePlan(main=False, own=("t",)))
    assert report.removed == 3 and not report.by_status
    assert sorted(await fetch_rows(store)) == ["owed", "unfed"]
    assert sorted(await lane_rows(store)) == ["owed"]

    im_on = await cleanup(store, OPTIONS, LanePlan(main=True, own=("t",)))  # status decides again
    assert im_on.removed == 0 and im_on.by_status


async def test_an_enabled_lane_that_never_ran_holds_everything(store: MySQLStore) -> None:
    await migrate_lanes(store, ["t"])
    await insert_events(store, [envelope("a"), envelope("b")])
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status = 'published'")
    await age_everything(store)
    report = await cleanup(store, OPTIONS, LanePlan(main=True, own=("t",)))
    assert (report.removed, report.waiting_for) == (0, ["t"])  # "start: beginning" would need them all
    report = await cleanup(store, OPTIONS, LanePlan(main=True, own=()))  # not enabled: a leftover table
    assert (report.removed, report.held_back_by) == (2, [])  # it never ran: no cursor, nothing owed


async def test_a_switched_off_lane_is_named_while_it_holds_rows_back(store: MySQLStore) -> None:
    await migrate_lanes(store, ["t"])
    await run_until_empty(lane_dispatcher(store, RecordingSink()))  # the lane starts (empty table)
    await insert_events(store, [envelope("a"), envelope("b")])  # never fed: the lane is off now
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status = 'published'")
    await age_everything(store)
    report = await cleanup(store, OPTIONS, LanePlan(main=True, own=()))
    assert (report.removed, report.held_back_by) == (0, ["t"])
