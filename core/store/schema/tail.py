"""The tailing lanes' table: rows that can never be delivered, parked with their error.

A tailing lane (a sink with ``ordered_log=True``, such as Kafka) keeps no per-row state: its
position is its row in the lanes' cursor table. The only rows it keeps are the ones it had to
pass over (too large, not serialisable; or its lane table had, before it tailed), so that
``status``, ``inspect`` and ``requeue`` see them: ``parked`` until an operator requeues them,
``requeued`` until the lane sends them again, or ``cancelled`` by an operator: never sent, the
entry kept as the record of it. One small table for every tailing lane, keyed by (lane,
outbox_id).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from room_outbox.store.dialect import Dialect, column_names, table_names
from room_outbox.store.schema.lanes import CURSOR_TABLE, KEPT_WIDTH, cursor_ddl, lane_table, tail_cursor_columns
from room_outbox.store.schema.outbox import Migration, add_column_sql
from room_outbox.store.schema.profiles import V1

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
            plan.append(await _hand_over(cur, lane, CURSOR_TABLE in existing, PARKED_TABLE in existing))
    return plan


async def _hand_over(cur: Any, lane: str, cursor_rows: bool, parked_rows: bool) -> Migration:
    """A lane switched from its own table to tailing: its cursor goes back to just below the
    table's first row still owed (``pending``: fresh, retrying or in flight), so nothing the
    table owed is lost (what it had sent or parked beyond may be sent once more: parked again if
    it still fails); the rows it parked (``failed``) below that move to the parked table as
    ``parked``, their error and times kept, where ``status``, ``inspect`` and ``requeue --lane``
    see them, instead of holding the cursor back to be sent again from there (months of events,
    perhaps), and the rows an operator cancelled, wherever they are, as ``cancelled``, so that
    the lane never sends them (:func:`_carried_over`); then the table is dropped, in the
    same step. The cursor is the tailing lane's whole state, and a table left behind would still
    count as owed: its pending rows shown as the lane's backlog, holding back retention, and
    moving the cursor back again at every migrate. It is room-outbox's own table, not
    room-service's.

    The statements are written from what was read now, never from what the cursor holds when
    they run, so a lane-table process still running meanwhile only makes the lane send again
    what it sent. Where each statement commits on its own (MySQL: the DROP commits anyway), a
    step interrupted half-way is made whole by the next migrate: the rows already moved are
    not moved twice, and the cursor is worked out again to the same place."""
    table = lane_table(lane)
    await cur.execute(f"SELECT MIN(outbox_id) FROM {table} WHERE {V1.is_open()}")
    (first_owed,) = await cur.fetchone()
    cursor = None
    if cursor_rows:
        await cur.execute(f"SELECT fed_through_id FROM {CURSOR_TABLE} WHERE lane = %s", (lane,))
        cursor = await cur.fetchone()
    # ints from the database: safe to write into the statements
    tail_from: int | None = None
    statements: list[str] = []
    changes: list[str] = []
    if cursor is not None:
        fed = int(cursor[0])
        tail_from = fed if first_owed is None else min(fed, int(first_owed) - 1)
        # Where a tailing run before the table had read to is past: from fed_through_id alone.
        statements.append(
            f"UPDATE {CURSOR_TABLE} SET fed_through_id = {tail_from}, read_through_id = NULL, open_gaps = NULL"
            f" WHERE lane = '{lane}'"
        )
        if tail_from < fed:
            changes.append(
                f"moved lane {lane}'s cursor back to {tail_from}: it tails from {table}'s first row still owed"
            )
        else:
            changes.append(f"kept lane {lane}'s cursor at {tail_from}: {table} owed no row up to it")
    elif first_owed is not None:  # a table whose lane never wrote its cursor row
        tail_from = int(first_owed) - 1
        statements.append(
            f"INSERT INTO {CURSOR_TABLE} (lane, fed_through_id, updated_at_ms) VALUES ('{lane}', {tail_from}, 0)"
        )
        changes.append(f"started lane {lane}'s cursor at {tail_from}: it tails from {table}'s first row still owed")
    carried = await _carried_over(cur, lane, table, tail_from, parked_rows)
    if carried is not None:
        statements.insert(0, carried[0])
        changes.insert(0, carried[1])
    statements.append(f"DROP TABLE IF EXISTS {table}")
    changes.append(
        f"dropped {table} (room-outbox's own table): lane {lane} tails from its cursor now, which holds all it owes"
    )
    return Migration("; ".join(changes), tuple(statements))


async def _carried_over(
    cur: Any, lane: str, table: str, tail_from: int | None, parked_rows: bool
) -> tuple[str, str] | None:
    """The statement that copies into the parked table the rows ``table`` parked at or below
    ``tail_from`` (all of them when None: the lane starts at its ``start``) and every row it
    cancelled, and what it does; None when there are none. One INSERT … SELECT, however many
    rows: the statement's size does not grow with them. Parked rows above ``tail_from`` are not
    copied: the lane reads them again, and parks again those that still fail. Cancelled rows
    are copied wherever they are: an operator decided they are never sent, and the tailing lane
    passes over the rows its parked table holds as cancelled. A row the parked table has already
    (moved by an interrupted run of this step) is left as it is. ``parked_rows``: the parked
    table exists now (else an earlier step of the plan creates it, empty)."""
    below = "" if tail_from is None else f" AND outbox_id <= {tail_from}"
    rows = f"FROM {table} WHERE (status = '{V1.parked}'{below} OR status = '{V1.cancelled}')"
    not_moved = (
        f" AND NOT EXISTS (SELECT 1 FROM {PARKED_TABLE} p WHERE p.lane = '{lane}' AND p.outbox_id = {table}.outbox_id)"
    )
    await cur.execute(f"SELECT status, COUNT(*) {rows}{not_moved if parked_rows else ''} GROUP BY status")
    counts = {str(status): int(count) for status, count in await cur.fetchall()}
    if not counts:
        return None
    statement = (
        f"INSERT INTO {PARKED_TABLE} (lane, outbox_id, event_id, room_id, status, last_error,"
        " created_at_ms, updated_at_ms)"
        f" SELECT '{lane}', outbox_id, event_id, room_id,"
        f" CASE status WHEN '{V1.parked}' THEN '{PARKED}' ELSE '{CANCELLED}' END,"
        f" last_error, created_at_ms, updated_at_ms {rows}{not_moved}"
    )
    up_to = "" if tail_from is None else f" up to {tail_from}"
    kinds = [
        f"{counts[status]} {name} row(s){where}"
        for status, name, where in ((V1.parked, PARKED, up_to), (V1.cancelled, CANCELLED, ""))
        if status in counts
    ]
    return statement, f"moved {table}'s {' and '.join(kinds)} to {PARKED_TABLE}"


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
