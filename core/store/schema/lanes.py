"""The lanes' tables: their names, their DDL and what ``migrate`` adds for them. A lane besides
the main lane keeps its state in a table of its own, ``room_outbox_lane_<name>``, fed through
the cursor table (:mod:`room_outbox.store.lanes.store`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from room_outbox.errors import ConfigurationError
from room_outbox.store.dialect import Dialect, table_names
from room_outbox.store.schema.buckets import bucket_plan
from room_outbox.store.schema.outbox import ROOM_INDEX, Migration, claim_index, concurrent_step, invalid_index_steps

if TYPE_CHECKING:
    from room_outbox.store.schema.profiles import Profile

CURSOR_TABLE = "room_outbox_lane_cursor"
#: At most 36 characters: the lane table's longest derived name, its claim index
#: ``idx_room_outbox_lane_<name>_claim``, must fit PostgreSQL's 63-byte identifiers.
_LANE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,35}$")


def lane_table(lane: str) -> str:
    if not _LANE_NAME.match(lane):
        raise ConfigurationError(
            f"lane name {lane!r}: use lower-case letters, digits and _, at most 36"
            " (idx_room_outbox_lane_<name>_claim must fit a 63-byte identifier)"
        )
    return f"room_outbox_lane_{lane}"


def tail_cursor_columns(dialect: Dialect) -> dict[str, str]:
    """The cursor's columns for tailing lanes, name → definition: ``read_through_id``, the
    highest id the lane has read (every id up to it is sent, parked or in ``open_gaps``), and
    ``open_gaps``, the id ranges below it still waited for (see
    :mod:`room_outbox.store.lanes.tail`). NULL: read through ``fed_through_id``, no range
    waited for (a lane table's feeder leaves them NULL). Up to ``lanes.max_gaps`` ranges of
    about 40 characters each: more than MySQL's TEXT (64 KB) holds at the largest setting."""
    ranges = "MEDIUMTEXT" if dialect.name == "mysql" else "TEXT"
    return {"read_through_id": f"{dialect.id_type} NULL", "open_gaps": f"{ranges} NULL"}


def cursor_ddl(dialect: Dialect) -> list[str]:
    tail = "".join(f",\n  {name} {definition}" for name, definition in tail_cursor_columns(dialect).items())
    return [
        f"""CREATE TABLE {CURSOR_TABLE} (
  lane           VARCHAR(64) NOT NULL PRIMARY KEY,
  fed_through_id {dialect.id_type} NOT NULL,
  updated_at_ms  BIGINT      NOT NULL{tail}
){dialect.table_options}"""
    ]


SKIPPED_TABLE = "room_outbox_tail_skipped"


def skipped_ddl(dialect: Dialect) -> list[str]:
    """Ranges of ids ``[low_id, high_id]`` a lane skipped, and when (epoch ms, the database's
    clock): a tailing lane's (:mod:`room_outbox.store.lanes.tail`) and a lane table's feeder's
    alike (the table's name is from when only tailing lanes kept it)."""
    return [
        f"""CREATE TABLE {SKIPPED_TABLE} (
  lane          VARCHAR(64)   NOT NULL,
  low_id        {dialect.id_type} NOT NULL,
  high_id       {dialect.id_type} NOT NULL,
  skipped_at_ms BIGINT        NOT NULL,
  PRIMARY KEY (lane, low_id)
){dialect.table_options}"""
    ]


#: How wide a lane's copies of the outbox's text columns are (``event_id``, ``event_type``,
#: ``room_id``, ``app_code``; the parked table's too): as wide as the profiles' tables make them
#: (silk's ``aggregate_id`` holds 128 characters). A wider value (room-service's own column
#: widened) is cut to it when copied: refused, it would stop the lane at that row.
KEPT_WIDTH = 255


#: A lane table's parked (``failed``) rows in its claim index's order (``status``,
#: ``lock_until_ms``, ``outbox_id``): read by a walk of the index, no sort. A parked result
#: clears ``lock_until_ms`` to 0, so within ``failed`` this is the key's order.
PARKED_ORDER = ("lock_until_ms", "outbox_id")


def copied_columns(profile: Profile) -> str:
    """SQL: what a lane's table copies of an outbox row (its key, event id, event type, room id
    and app code), under the outbox profile's column names. Text is cut to its copy's width:
    room-service's columns may be wider (TEXT on PostgreSQL), and one value the copy refused
    would stop the lane's feeding at that row. The sink gets the envelope, whole; a room id cut
    short only orders rooms sharing that prefix together."""
    p = profile
    cut = ", ".join(
        f"SUBSTR({column}, 1, {KEPT_WIDTH})" for column in (p.event_id, p.event_type, p.room_id, p.app_code)
    )
    return f"{p.key}, {cut}"


def lane_ddl(lane: str, dialect: Dialect) -> list[str]:
    """A lane's table; its claim index too where there are no room buckets (SQLite): on a
    server the buckets' plan creates it after the bucket column (:mod:`.buckets`)."""
    table = lane_table(lane)
    name, columns = claim_index(table, key="outbox_id")
    claim = [] if dialect.room_buckets else [f"CREATE INDEX {name} ON {table} {columns}"]
    return [
        f"""CREATE TABLE {table} (
  outbox_id     {dialect.id_type} NOT NULL PRIMARY KEY,
  event_id      VARCHAR({KEPT_WIDTH})  NOT NULL,
  event_type    VARCHAR({KEPT_WIDTH})  NOT NULL,
  room_id       VARCHAR({KEPT_WIDTH})  NOT NULL,
  app_code      VARCHAR({KEPT_WIDTH})  NOT NULL DEFAULT '',
  status        VARCHAR(16)   NOT NULL DEFAULT 'pending',
  retry_count   INT           NOT NULL DEFAULT 0,
  last_error    VARCHAR(1024) NULL,
  worker_id     VARCHAR(128)  NULL DEFAULT NULL,
  lock_until_ms BIGINT        NOT NULL DEFAULT 0,
  created_at_ms BIGINT        NOT NULL,
  updated_at_ms BIGINT        NOT NULL
){dialect.table_options}""",
        *claim,
        f"CREATE INDEX {ROOM_INDEX.format(table=table)} ON {table} (room_id, status, outbox_id)",
    ]


async def lane_steps(
    cur: Any, dialect: Dialect, lanes: Sequence[str], function_planned: bool = False
) -> list[Migration]:
    """What the lanes need, read from the catalogue in the caller's transaction: the cursor
    table, the skipped ranges' table (where a feeder records the ids it gave up on) and each
    lane's table when missing, then (on a server) their room buckets (``function_planned``: an
    earlier step of the same plan sees to the bucket function)."""
    existing = await table_names(cur, dialect)
    wanted = [(CURSOR_TABLE, cursor_ddl(dialect)), (SKIPPED_TABLE, skipped_ddl(dialect))]
    wanted += [(lane_table(lane), lane_ddl(lane, dialect)) for lane in lanes]
    plan = [Migration(f"created table {name}", tuple(ddl)) for name, ddl in wanted if name not in existing]
    # Room buckets belong to the processes' membership: on a server, not SQLite (see .membership).
    tables = [lane_table(lane) for lane in lanes]
    buckets = (
        await bucket_plan(cur, dialect, tables, membership=False, key="outbox_id", function_planned=function_planned)
        if dialect.room_buckets
        else []
    )
    if dialect.name == "postgresql":  # interrupted index builds first
        plan = await invalid_index_steps(cur, [t for t in tables if t in existing]) + plan
    return plan + [concurrent_step(change, statements) for change, statements in buckets]
