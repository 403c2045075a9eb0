"""The lanes a database holds, what each one owes, and dropping a retired one.

A lane of its own exists in the database as its table ``room_outbox_lane_<name>`` and, once
it has run, a row of ``room_outbox_lane_cursor``; a tailing lane as its cursor row alone (a lane
switched to tailing has its table dropped by ``migrate``, see :mod:`room_outbox.store.schema.tail`,
and no tailing process starts while it is there); the main lane is ``room_outbox.status``. Every
count here reads an index range (``status`` first in the lane tables' claim index, the
primary key of ``room_outbox`` up to a bound), never a whole table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from room_outbox.store.by_status import open_rows
from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import table_names
from room_outbox.store.lanes.store import CURSOR_TABLE, lane_table
from room_outbox.store.lanes.tail import TailCursor
from room_outbox.store.schema.tail import PARKED, PARKED_TABLE, SKIPPED_TABLE, skipped_rows

if TYPE_CHECKING:
    from room_outbox.store.protocol import SQLStore

LANE_PREFIX = "room_outbox_lane_"


@dataclass(frozen=True)
class LaneBacklog:
    """What a lane still owes: rows it holds pending, rows not fed to it yet, rows parked, rows
    skipped."""

    pending: int
    #: Rows of ``room_outbox`` above the lane's feeding point, not in its table yet: counted up
    #: to :data:`UNFED_COUNTED`, estimated beyond (see :func:`own_lane_backlog`).
    unfed: int
    parked: int
    #: ``created_at_ms`` of the oldest event it owes (pending or unfed); None: owes nothing.
    oldest_created_ms: int | None
    #: Events it skipped and never sent: rows in the id ranges it gave up on as rolled back
    #: (:func:`~room_outbox.store.schema.tail.skipped_rows`), which committed after all. Not
    #: part of :attr:`backlog`: the lane sends them only once an operator requeues them.
    skipped: int = 0

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
    #: The lane's row in ``room_outbox_lane_cursor`` (a lane table's leaves the tailing columns
    #: NULL); None: the lane has never run.
    cursor: TailCursor | None

    @property
    def fed_through_id(self) -> int | None:
        return None if self.cursor is None else self.cursor.fed_through_id

    def tailed_past(self, outbox_id: int) -> bool:
        """Whether this tailing lane is past ``outbox_id`` (:meth:`TailCursor.passed`)."""
        return self.cursor is not None and self.cursor.passed(outbox_id)


async def stored_lanes(store: SQLStore) -> list[StoredLane]:
    """Every lane of its own with a table or a cursor row, sorted by name."""
    async with store.transaction() as cur:
        names = {name for name in await table_names(cur, store.dialect) if name.startswith(LANE_PREFIX)}
        cursors: dict[str, dict[str, Any]] = {}
        if CURSOR_TABLE in names:
            # Every column: a cursor table that only lane tables use may lack read_through_id.
            await cur.execute(f"SELECT * FROM {CURSOR_TABLE}")
            columns = [str(d[0]).lower() for d in cur.description]
            rows = [dict(zip(columns, row, strict=True)) for row in await cur.fetchall()]
            cursors = {str(row["lane"]): row for row in rows}
    tables = {name[len(LANE_PREFIX) :] for name in names - {CURSOR_TABLE}}
    return [
        StoredLane(name, name in tables, _cursor(cursors[name]) if name in cursors else None)
        for name in sorted(tables | cursors.keys())
    ]


def _cursor(row: dict[str, Any]) -> TailCursor:
    return TailCursor.from_row(row["fed_through_id"], row.get("read_through_id"), row.get("open_gaps"))


#: Rows above a lane's feeding point counted one by one; beyond, estimated (see own_lane_backlog).
UNFED_COUNTED = 10_000


async def own_lane_backlog(store: SQLStore, lane: StoredLane, counted: int = UNFED_COUNTED) -> LaneBacklog:
    """What ``lane`` owes, in a bounded number of index reads whatever the backlog.

    Pending and parked rows are counted in the lane's claim index (``status`` first), as the IM
    lane's are in ``room_outbox``'s. The rows not fed yet are those of ``room_outbox`` above the
    lane's feeding point (its watermark or the highest id in its table, or a tailing lane's
    highest id read, whichever is higher; committed rows inside the id ranges the feeder still
    waits for are fed within a round and not counted). Those rows sit in ``room_outbox``'s
    primary key, whole rows with their envelopes, so a million of them cannot be counted
    within a query timeout: the first ``counted`` (at least 2) are counted and the rest
    estimated from the ids above them at the density of the counted ones' ids (exact while ids
    follow one step, whatever the step). Skipped rows: a short primary-key range of the outbox
    per skipped range (one range however many ids a rolled-back transaction held).
    """
    table = lane_table(lane.name)
    p = store.profile  # the outbox the lanes are fed from
    outbox, key, created = p.table, p.key, p.as_ms(p.created)
    async with store.transaction() as cur:
        pending = parked = skipped = 0
        oldest: list[int] = []
        tables = await table_names(cur, store.dialect)
        # A tailing lane's rows are held in the parked table, made with the skipped table.
        if SKIPPED_TABLE in tables and (lane.has_table or PARKED_TABLE in tables):
            await cur.execute(f"SELECT COUNT(*){skipped_rows(p, table if lane.has_table else None)}", (lane.name,))
            (skipped,) = await cur.fetchone()
        fed_up_to = lane.fed_through_id
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
            await cur.execute(f"SELECT MAX(outbox_id) FROM {table}")
            (highest_fed,) = await cur.fetchone()
            if highest_fed is not None and fed_up_to is not None:
                fed_up_to = max(fed_up_to, int(highest_fed))
        else:  # a tailing lane: its parked rows live in the tailing lanes' table
            parked = await _tail_parked(cur, lane.name) if PARKED_TABLE in tables else 0
            read_through = lane.cursor.read_through_id if lane.cursor is not None else None
            if read_through is not None and fed_up_to is not None:
                fed_up_to = max(fed_up_to, read_through)
        unfed = 0
        if fed_up_to is not None:
            await cur.execute(
                f"SELECT COUNT(*), MIN({key}), MAX({key}) FROM"
                f" (SELECT {key} FROM {outbox} WHERE {key} > %s ORDER BY {key} LIMIT %s) first_unfed",
                (fed_up_to, max(counted, 2)),
            )
            found, first, last = await cur.fetchone()
            unfed = int(found)
            if unfed == max(counted, 2):  # more beyond: as many as the first ones' ids per id
                await cur.execute(f"SELECT MAX({key}) FROM {outbox}")
                (highest,) = await cur.fetchone()
                unfed += round((int(highest) - int(last)) * (unfed - 1) / (int(last) - int(first)))
            if unfed:
                await cur.execute(
                    f"SELECT {created} FROM {outbox} WHERE {key} > %s ORDER BY {key} LIMIT 1", (fed_up_to,)
                )
                found = await cur.fetchone()
                if found:
                    oldest.append(int(found[0]))
    return LaneBacklog(int(pending), unfed, int(parked), min(oldest) if oldest else None, int(skipped))


async def _tail_parked(cur: Any, lane: str) -> int:
    await cur.execute(f"SELECT COUNT(*) FROM {PARKED_TABLE} WHERE lane = %s AND status = %s", (lane, PARKED))
    (parked,) = await cur.fetchone()
    return int(parked)


async def im_lane_backlog(store: SQLStore) -> LaneBacklog:
    """The main lane: open and parked rows of the outbox (it is fed by the insert itself), in the
    words of its table profile."""
    p = store.profile
    async with store.transaction() as cur:
        pending, oldest = await open_rows(cur, store)
        await cur.execute(f"SELECT COUNT(*) FROM {p.table} WHERE status = %s", (p.parked,))
        (parked,) = await cur.fetchone()
    return LaneBacklog(pending, 0, int(parked), oldest)


async def tailing_lanes(store: SQLStore) -> list[str]:
    """The lanes that tail ``room_outbox``: a cursor row and no table of their own; sorted."""
    return [stored.name for stored in await stored_lanes(store) if not stored.has_table]


async def retire_lane(store: SQLStore, lane: str) -> list[str]:
    """Drop ``lane``'s table, cursor row, skipped ranges and (a tailing lane) parked rows;
    returns what was dropped (empty: nothing was there)."""
    table = lane_table(lane)  # validates the name before it reaches SQL
    done: list[str] = []
    for stored in await stored_lanes(store):
        if stored.name != lane:
            continue
        async with store.transaction() as cur:
            if stored.fed_through_id is not None:
                await cur.execute(f"DELETE FROM {CURSOR_TABLE} WHERE lane = %s", (lane,))
                done.append(f"deleted the cursor of lane {lane} (fed through id {stored.fed_through_id})")
            tables = await table_names(cur, store.dialect)
            if PARKED_TABLE in tables:
                await cur.execute(f"DELETE FROM {PARKED_TABLE} WHERE lane = %s", (lane,))
                if cur.rowcount:
                    done.append(f"deleted {cur.rowcount} parked row(s) of lane {lane}")
            if SKIPPED_TABLE in tables:
                await cur.execute(f"DELETE FROM {SKIPPED_TABLE} WHERE lane = %s", (lane,))
                if cur.rowcount:
                    done.append(f"deleted {cur.rowcount} skipped id range(s) of lane {lane}")
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
