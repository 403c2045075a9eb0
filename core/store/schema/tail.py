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
    before them), and the parked table; a lane that ran on its own table before starts tailing just below that
    table's first unfinished row, so nothing it owed is lost (the table itself is kept)."""
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
        if lane_table(lane) in existing and CURSOR_TABLE in existing:
            plan += await _upgrade(cur, lane)
    return plan


async def _upgrade(cur: Any, lane: str) -> list[Migration]:
    table = lane_table(lane)
    await cur.execute(f"SELECT MIN(outbox_id) FROM {table} WHERE status <> 'published'")
    (first_unfinished,) = await cur.fetchone()
    await cur.execute(f"SELECT fed_through_id FROM {CURSOR_TABLE} WHERE lane = %s", (lane,))
    cursor = await cur.fetchone()
    if first_unfinished is None or cursor is None or int(cursor[0]) < int(first_unfinished):
        return []
    back_to = int(first_unfinished) - 1  # ints from the database: safe to write into the statement
    return [
        Migration(
            f"moved lane {lane}'s cursor back to {back_to}: it tails from {table}'s first unfinished row",
            # From the cursor: where the tailing lane had read to before it ran on its table is past.
            (
                f"UPDATE {CURSOR_TABLE} SET fed_through_id = {back_to}, read_through_id = NULL, open_gaps = NULL"
                f" WHERE lane = '{lane}'",
            ),
        )
    ]


__all__ = ["PARKED", "PARKED_TABLE", "REQUEUED", "parked_ddl", "tail_steps"]
