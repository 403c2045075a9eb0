"""Lane feeding when auto-increment ids step by more than 1: the skipped ids are not waited
for, an id that commits late is still fed, a second writer with another offset is found, and
the ranges waited for stay bounded whatever happens to ids."""

from __future__ import annotations

import itertools
import json
import logging
import time
from typing import Any

import aiomysql
import pytest
from lanes.test_lanes import lane_dispatcher, lane_rows, max_id, watermark
from support import INSERT_V1, RecordingSink, envelope

from bench.drive import run_until_empty
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.lanes.store import STEP_EVIDENCE, LaneStore, migrate_lanes

pytestmark = pytest.mark.anyio


async def writer(store: MySQLStore, increment: int, offset: int = 1) -> aiomysql.Connection:
    """A room-service connection whose session hands out ids ``offset + k × increment``."""
    conn = await aiomysql.connect(**store.address.connect_kwargs(), db=store.address.database)
    async with conn.cursor() as cur:
        await cur.execute(f"SET SESSION auto_increment_increment = {increment}, auto_increment_offset = {offset}")
    return conn


async def insert(conn: aiomysql.Connection, event_ids: list[str], commit: bool = True, at: int | None = None) -> None:
    """Insert as room-service does; ``at``: the id the server would hand out (tests that need
    one exact interleaving of two writers' ids)."""
    now = int(time.time() * 1000)
    async with conn.cursor() as cur:
        for event_id in event_ids:
            row = ("default", event_id, "RoomUserJoined", "r_1", json.dumps(envelope(event_id)), now, now)
            if at is None:
                await cur.execute(INSERT_V1, row)
            else:
                await cur.execute(INSERT_V1.replace("(app_code", "(id, app_code").replace("(%s", "(%s, %s"), (at, *row))
    if commit:
        await conn.commit()


def gaps_of(lane: Any) -> int:
    assert isinstance(lane, LaneStore)
    return len(lane._gaps)


async def test_a_step_of_2_feeds_everything_and_waits_for_no_skipped_id(store: MySQLStore) -> None:
    await migrate_lanes(store, ["t"])
    sink = RecordingSink()
    dispatcher = lane_dispatcher(store, sink, batch_size=100)
    conn = await writer(store, increment=2)
    try:
        most_gaps = 0
        for chunk in range(10):  # commits in between feeding rounds, as a live service does
            await insert(conn, [f"s{chunk}-{n}" for n in range(60)])
            await run_until_empty(dispatcher)
            most_gaps = max(most_gaps, gaps_of(dispatcher.store))
        ids = sorted((await lane_rows(store)).values(), key=lambda r: r["outbox_id"])
        assert {b["outbox_id"] - a["outbox_id"] for a, b in itertools.pairwise(ids)} == {2}  # really step 2
        assert len(sink.received) == len(set(sink.received)) == 600
        # Without the learnt step each round would wait for its 59 skipped ids (hundreds of
        # OR terms by now); with it, only for what the first rows could not tell.
        assert most_gaps <= 1, most_gaps
        assert gaps_of(dispatcher.store) == 0
        assert await watermark(store) == await max_id(store)  # nothing held back

        # An id that commits late is still waited for, on the step-2 lattice.
        late = await writer(store, increment=2)
        try:
            await insert(late, ["late"], commit=False)
            await insert(conn, ["after1", "after2"])
            await run_until_empty(dispatcher)
            assert "late" not in sink.received and gaps_of(dispatcher.store) == 1
            assert await watermark(store) < await max_id(store)
            await late.commit()
        finally:
            late.close()
        await run_until_empty(dispatcher)
        assert sink.received.count("late") == 1 and gaps_of(dispatcher.store) == 0
        assert await watermark(store) == await max_id(store)
    finally:
        conn.close()


async def test_a_second_writer_with_another_offset_is_found(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Writer A (offset 1) teaches the feeder step 2; writer B (offset 2) then commits an even
    id late, below what was read. Its next id shows the finer step, and the feeder looks back."""
    await migrate_lanes(store, ["t"])
    sink = RecordingSink()
    dispatcher = lane_dispatcher(store, sink, batch_size=100)
    a, b = await writer(store, 2, 1), await writer(store, 2, 2)
    try:
        await insert(a, [f"a{n}" for n in range(STEP_EVIDENCE + 4)])
        await run_until_empty(dispatcher)
        assert dispatcher.store._step == 2  # type: ignore[attr-defined]
        high = await max_id(store)  # odd: a0 … a19 took 1, 3, …
        await insert(b, ["b-late"], commit=False, at=high + 1)  # B's first id, held open
        await insert(a, ["a-more1", "a-more2"])  # high + 2, high + 4: nothing missing on step 2
        await run_until_empty(dispatcher)
        await b.commit()  # below the highest id read, and off the lattice learnt so far
        await run_until_empty(dispatcher)
        assert "b-late" not in sink.received
        with caplog.at_level(logging.WARNING):
            await insert(b, ["b-next"], at=high + 5)  # B's next id (even) shows the finer step
            await run_until_empty(dispatcher)
        assert sink.received.count("b-late") == 1 and sink.received.count("b-next") == 1
        assert any("finer step" in r.message for r in caplog.records)
        assert dispatcher.store._step == 1  # type: ignore[attr-defined]
        assert len(sink.received) == len(set(sink.received))  # rows looked at again are not sent again
    finally:
        a.close()
        b.close()


async def test_the_ranges_waited_for_are_capped_by_max_gaps(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    await migrate_lanes(store, ["t"])
    sink = RecordingSink()
    dispatcher = lane_dispatcher(store, sink, batch_size=100)
    lane = dispatcher.store
    assert isinstance(lane, LaneStore)
    lane.max_gaps = 4
    conn = await writer(store, increment=1)
    try:
        for n in range(12):  # twelve rolled-back inserts, each between two committed ones
            await insert(conn, [f"ok{n}"])
            await insert(conn, [f"ghost{n}"], commit=False)
            await conn.rollback()
        await insert(conn, ["last"])
        with caplog.at_level(logging.WARNING):
            await run_until_empty(dispatcher)
        assert gaps_of(lane) == 4  # not 12: the eight longest-missing were given up on
        assert any("lanes.max_gaps" in r.message for r in caplog.records)
        assert sorted(sink.received) == sorted([f"ok{n}" for n in range(12)] + ["last"])
        assert await watermark(store) < await max_id(store)  # the four kept still hold it
    finally:
        conn.close()
