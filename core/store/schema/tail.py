"""The tailing lanes' table: rows that can never be delivered, parked with their error.

A tailing lane (a sink with ``ordered_log=True``, such as Kafka) keeps no per-row state: its
position is its row in the lanes' cursor table. The only rows it keeps are the ones it had to
pass over (too large, not serialisable), so that ``status``, ``inspect`` and ``requeue`` see
them: ``parked`` until an operator requeues them, ``requeued`` until the lane sends them again,
or ``cancelled`` by an operator: never sent, the entry kept as the record of it. One small
table for every tailing lane, keyed by (lane, outbox_id).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from room_outbox.store.dialect import Dialect, column_names, table_names
from room_outbox.store.schema.lanes import CURSOR_TABLE, KEPT_WIDTH, cursor_ddl, lane_table, tail_cursor_columns
from room_outbox.store.schema.outbox import Migration, add_column_sql

PARKED_TABLE = "room_outbox_tail_parked"
PARKED = "parked"
REQUEUED = "requeued"
CANCELLED = "cancelled"


def parked_ddl(dialect: Dialect) -> list[str]:
    return [
        f"""CREATE TABLE {PARKED_TABLE} (
  lane          VARCHAR(64)   NOT NULL,
  outbox_id     {dialect.id_type} NOT NULL,
  event_id      VARCHAR({KEPT_WIDTH})  NOT NULL,
  room_id       VARCHAR({KEPT_WIDTH})  NOT NULL,
  status        VARCHAR(16)   NOT NULL DEFAULT '{PARKED}',
  last_error    VARCHAR(1024) NULL,
  created_at_ms BIGINT        NOT NULL,
  updated_at_ms BIGINT        NOT NULL,
  PRIMARY KEY (lane, outbox_id)
){dialect.table_options}"""
    ]


async def tail_steps(cur: Any, dialect: Dialect, lanes: Sequence[str], cursor_planned: bool = False) -> list[Migration]:
    """What tailing ``lanes`` need, read from the catalogue in the caller's transaction: the
    cursor table (unless an earlier step of the same plan creates it: ``cursor_planned``) with
    the columns where a tailing lane keeps what it has read (added to a cursor table made
    before them), and the parked table; a lane that ran on its own table before hands over
    from it (:func:`_hand_over`)."""
    if not lanes:
        return []
    existing = await table_names(cur, dialect)
    wanted = [(PARKED_TABLE, parked_ddl(dialect))]
    if not cursor_planned:
        wanted.insert(0, (CURSOR_TABLE, cursor_ddl(dialect)))
    plan = [Migration(f"created table {name}", tuple(ddl)) for name, ddl in wanted if name not in existing]
    if CURSOR_TABLE in existing:  # made before tailing lanes kept where they read to
        have = set(await column_names(cur, dialect, CURSOR_TABLE))
        plan += [
            Migration(
                f"added column {CURSOR_TABLE}.{name}",
                (add_column_sql(dialect, CURSOR_TABLE, f"{name} {definition}"),),
            )
            for name, definition in tail_cursor_columns(dialect).items()
            if name not in have
        ]
    for lane in lanes:
        if lane_table(lane) in existing:
            plan.append(await _hand_over(cur, lane, cursor_rows=CURSOR_TABLE in existing))
    return plan


async def _hand_over(cur: Any, lane: str, cursor_rows: bool) -> Migration:
    """A lane switched from its own table to tailing: its cursor goes back to just below the
    table's first unfinished row (pending, or parked: sent again, parked again if it still
    fails), so nothing the table owed is lost (what it had sent beyond may be sent once more);
    then the table is dropped, in the same step. The cursor is the tailing lane's whole state,
    and a table left behind would still count as owed: its pending rows shown as the lane's
    backlog, holding back retention, and moving the cursor back again at every migrate. It is
    room-outbox's own table, not room-service's. The cursor is written from what was read now,
    never from what it holds when the step runs, so a lane-table process still running meanwhile
    only makes the lane send again what it sent."""
    table = lane_table(lane)
    await cur.execute(f"SELECT MIN(outbox_id) FROM {table} WHERE status <> 'published'")
    (first_unfinished,) = await cur.fetchone()
    cursor = None
    if cursor_rows:
        await cur.execute(f"SELECT fed_through_id FROM {CURSOR_TABLE} WHERE lane = %s", (lane,))
        cursor = await cur.fetchone()
    drop = f"DROP TABLE IF EXISTS {table}"
    why = f"dropped {table} (room-outbox's own table): lane {lane} tails from its cursor now, which holds all it owes"
    # ints from the database: safe to write into the statements
    if cursor is not None:
        fed = int(cursor[0])
        tail_from = fed if first_unfinished is None else min(fed, int(first_unfinished) - 1)
        # Where a tailing run before the table had read to is past: from fed_through_id alone.
        move = (
            f"UPDATE {CURSOR_TABLE} SET fed_through_id = {tail_from}, read_through_id = NULL, open_gaps = NULL"
            f" WHERE lane = '{lane}'"
        )
        if tail_from < fed:
            change = f"moved lane {lane}'s cursor back to {tail_from}: it tails from {table}'s first unfinished row"
        else:
            change = f"kept lane {lane}'s cursor at {tail_from}: {table} had finished every row up to it"
        return Migration(f"{change}; {why}", (move, drop))
    if first_unfinished is not None:  # a table whose lane never wrote its cursor row
        tail_from = int(first_unfinished) - 1
        start = f"INSERT INTO {CURSOR_TABLE} (lane, fed_through_id, updated_at_ms) VALUES ('{lane}', {tail_from}, 0)"
        change = f"started lane {lane}'s cursor at {tail_from}: it tails from {table}'s first unfinished row"
        return Migration(f"{change}; {why}", (start, drop))
    return Migration(why, (drop,))


async def parked_while_tailing(cur: Any, dialect: Dialect, lanes: Sequence[str]) -> list[str]:
    """Why lanes switched back to a lane table (``lanes``) cannot be: events they parked while
    tailing, still parked or requeued, which a lane table would never see, count or send (its
    feeder goes on from the cursor). The operator requeues or cancels them first."""
    if not lanes or PARKED_TABLE not in await table_names(cur, dialect):
        return []
    held = ", ".join(["%s"] * len(lanes))
    await cur.execute(
        f"SELECT lane, COUNT(*) FROM {PARKED_TABLE} WHERE lane IN ({held}) AND status IN (%s, %s) GROUP BY lane",
        (*lanes, PARKED, REQUEUED),
    )
    return [
        f"lane {lane} has {count} event(s) it parked while it tailed room_outbox (relay: tail), which a lane"
        f" table would never send: with relay: tail, requeue them (`room-outbox requeue --lane {lane}`) and let"
        f" the lane send them, or cancel them (`room-outbox cancel EVENT_ID --lane {lane}`); then migrate again"
        for lane, count in sorted(await cur.fetchall())
    ]


__all__ = ["PARKED", "PARKED_TABLE", "REQUEUED", "parked_ddl", "parked_while_tailing", "tail_steps"]
