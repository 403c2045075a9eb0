"""The lanes a MySQL database holds, what each one owes, and dropping a retired one.

A lane of its own exists in the database as its table ``room_outbox_lane_<name>`` and, once
it has run, a row of ``room_outbox_lane_cursor``; the IM lane is ``room_outbox.status``. Every
count here reads an index range (``status`` first in the lane tables' claim index, the
primary key of ``room_outbox``), never a whole table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from room_outbox.store.dialect import table_names
from room_outbox.store.leased import now_ms
from room_outbox.store.mysql_lanes import CURSOR_TABLE, lane_table

if TYPE_CHECKING:
    from room_outbox.store.factory import SQLStore

LANE_PREFIX = "room_outbox_lane_"


@dataclass(frozen=True)
class LaneBacklog:
    """What a lane still owes: rows it holds pending, rows not fed to it yet, rows parked."""

    pending: int
    #: Rows of ``room_outbox`` above the lane's watermark that are not in its table yet.
    unfed: int
    parked: int
    #: ``created_at_ms`` of the oldest event it owes (pending or unfed); None: owes nothing.
    oldest_created_ms: int | None

    @property
    def backlog(self) -> int:
        return self.pending + self.unfed

    def oldest_age_ms(self, now: int | None = None) -> int:
        if self.oldest_created_ms is None:
            return 0
        return max(0, (now if now is not None else now_ms()) - self.oldest_created_ms)


@dataclass(frozen=True)
class StoredLane:
    """A lane of its own as the database holds it."""

    name: str
    has_table: bool
    #: ``room_outbox_lane_cursor.fed_through_id``; None: the lane has never run.
    fed_through_id: int | None


async def stored_lanes(store: SQLStore) -> list[StoredLane]:
    """Every lane of its own with a table or a cursor row, sorted by name."""
    async with store.transaction() as cur:
        names = {name for name in await table_names(cur, store.dialect) if name.startswith(LANE_PREFIX)}
        cursors: dict[str, int] = {}
        if CURSOR_TABLE in names:
            await cur.execute(f"SELECT lane, fed_through_id FROM {CURSOR_TABLE}")
            cursors = {str(lane): int(fed) for lane, fed in await cur.fetchall()}
    tables = {name[len(LANE_PREFIX) :] for name in names - {CURSOR_TABLE}}
    return [StoredLane(name, name in tables, cursors.get(name)) for name in sorted(tables | cursors.keys())]


async def own_lane_backlog(store: SQLStore, lane: StoredLane) -> LaneBacklog:
    table = lane_table(lane.name)
    p = store.profile  # the outbox the lanes are fed from
    outbox, key, created = p.table, p.key, p.as_ms(p.created)
    async with store.transaction() as cur:
        pending = parked = 0
        oldest: list[int] = []
        if lane.has_table:
            await cur.execute(f"SELECT COUNT(*), MIN(outbox_id) FROM {table} WHERE status = 'pending'")
            pending, lowest = await cur.fetchone()
            await cur.execute(f"SELECT COUNT(*) FROM {table} WHERE status = 'failed'")
            (parked,) = await cur.fetchone()
            if lowest is not None:
                await cur.execute(f"SELECT {created} FROM {outbox} WHERE {key} = %s", (lowest,))
                found = await cur.fetchone()
                if found:
                    oldest.append(int(found[0]))
        unfed = 0
        if lane.fed_through_id is not None:
            await cur.execute(f"SELECT COUNT(*) FROM {outbox} WHERE {key} > %s", (lane.fed_through_id,))
            (above,) = await cur.fetchone()
            fed_above = 0
            if lane.has_table:
                await cur.execute(f"SELECT COUNT(*) FROM {table} WHERE outbox_id > %s", (lane.fed_through_id,))
                (fed_above,) = await cur.fetchone()
            unfed = max(0, int(above) - int(fed_above))
            if unfed:
                await cur.execute(
                    f"SELECT {created} FROM {outbox} WHERE {key} > %s"
                    + (
                        f" AND NOT EXISTS (SELECT 1 FROM {table} l WHERE l.outbox_id = {outbox}.{key})"
                        if lane.has_table
                        else ""
                    )
                    + f" ORDER BY {key} LIMIT 1",
                    (lane.fed_through_id,),
                )
                found = await cur.fetchone()
                if found:
                    oldest.append(int(found[0]))
    return LaneBacklog(int(pending), unfed, int(parked), min(oldest) if oldest else None)


async def im_lane_backlog(store: SQLStore) -> LaneBacklog:
    """The IM lane: open and parked rows of the outbox (it is fed by the insert itself), in the
    words of its table profile."""
    p = store.profile
    async with store.transaction() as cur:
        await cur.execute(f"SELECT COUNT(*) FROM {p.table} WHERE {p.is_open()}")
        (pending,) = await cur.fetchone()
        await cur.execute(f"SELECT {p.as_ms(p.created)} FROM {p.table} WHERE {p.is_open()} ORDER BY {p.key} LIMIT 1")
        oldest = await cur.fetchone()
        await cur.execute(f"SELECT COUNT(*) FROM {p.table} WHERE status = %s", (p.parked,))
        (parked,) = await cur.fetchone()
    return LaneBacklog(int(pending), 0, int(parked), int(oldest[0]) if oldest else None)


async def retire_lane(store: SQLStore, lane: str) -> list[str]:
    """Drop ``lane``'s table and cursor row; returns what was dropped (empty: nothing was there)."""
    table = lane_table(lane)  # validates the name before it reaches SQL
    done: list[str] = []
    for stored in await stored_lanes(store):
        if stored.name != lane:
            continue
        async with store.transaction() as cur:
            if stored.fed_through_id is not None:
                await cur.execute(f"DELETE FROM {CURSOR_TABLE} WHERE lane = %s", (lane,))
                done.append(f"deleted the cursor of lane {lane} (fed through id {stored.fed_through_id})")
            if stored.has_table:
                await cur.execute(f"DROP TABLE IF EXISTS {table}")
                done.append(f"dropped table {table}")
    return done


async def owes_rows(store: SQLStore, lane: str) -> bool:
    """Whether ``lane``'s table holds a pending or parked row (one index probe)."""
    async with store.transaction() as cur:
        await cur.execute(f"SELECT 1 FROM {lane_table(lane)} WHERE status IN ('pending', 'failed') LIMIT 1")
        return await cur.fetchone() is not None


async def first_row_after(store: SQLStore, outbox_id: int) -> int | None:
    """``created_at_ms`` of the first ``room_outbox`` row above ``outbox_id`` (ids rise with
    time, so it is the oldest of them); None when there is none."""
    async with store.transaction() as cur:
        p = store.profile
        await cur.execute(
            f"SELECT {p.as_ms(p.created)} FROM {p.table} WHERE {p.key} > %s ORDER BY {p.key} LIMIT 1", (outbox_id,)
        )
        found = await cur.fetchone()
    return int(found[0]) if found else None
