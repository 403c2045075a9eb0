"""The ``activity`` handler: a per-room feed of what users see happen (``room_activity``).

Joins, leaves, gifts, mic changes, kicks and mutes, one row each, with the event's
``room_version``. The consumer hands a room's events over in order (``ordering: per_room``,
the default), so ``id`` grows with the room's history; read a room's feed with
:data:`FEED_QUERY` (oldest first, from a cursor ``id``). Written in the consumer's transaction:
a redelivered event adds no second row.

A value its column cannot hold (a ``user_id`` longer than the table's, one holding a NUL on
PostgreSQL, a detail beyond a TEXT column made by an earlier version) is a permanent failure
naming the column (the message becomes a dead letter at once, and the room goes on), checked
against the table as ``consume`` found it at start.
"""

from __future__ import annotations

import json

from room_outbox import (
    ConsumedEvent,
    HandleContext,
    HandlerColumn,
    HandlerFactoryContext,
    HandlerSettings,
    HandlerSpec,
    HandlerTable,
    hookimpl,
)

TABLE = "room_activity"

#: The user-facing event types and the feed's word for each.
ACTIVITY_KINDS = {
    "RoomUserJoined": "joined",
    "RoomUserLeft": "left",
    "RoomGiftSent": "gift",
    "RoomMicChanged": "mic",
    "RoomUserKicked": "kicked",
    "RoomUserMuted": "muted",
}

#: The columns it writes (all but the id): ``migrate`` creates them and, where the table was made
#: beforehand, checks it can hold them; the handler's rows are checked against them. The
#: detail (the payload's JSON, up to an envelope's size) is LONGTEXT on MySQL, whose TEXT holds
#: 64 KB. The unique key's app_code and event_id compare exactly: ids differing only in letter
#: case are two events, each written.
COLUMNS = HandlerTable(
    TABLE,
    {
        "app_code": HandlerColumn("text", 64, exact=True),
        "room_id": HandlerColumn("text", 64),
        "room_version": HandlerColumn("bigint", nullable=True),
        "event_id": HandlerColumn("text", 128, exact=True),
        "event_type": HandlerColumn("text", 64),
        "kind": HandlerColumn("text", 16),
        "user_id": HandlerColumn("text", 128, nullable=True),
        "detail": HandlerColumn("text"),
        "occurred_at_ms": HandlerColumn("bigint", nullable=True),
    },
)

#: The table, per database; ``migrate`` creates it.
SCHEMA = {
    "mysql": (
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  id             BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
{COLUMNS.definitions("mysql")},
  UNIQUE KEY uk_room_activity_event (app_code, event_id),
  KEY idx_room_activity_feed (app_code, room_id, id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
    ),
    "postgresql": (
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  id             BIGSERIAL    PRIMARY KEY,
{COLUMNS.definitions("postgresql")},
  CONSTRAINT uk_room_activity_event UNIQUE (app_code, event_id)
)""",
        f"CREATE INDEX IF NOT EXISTS idx_room_activity_feed ON {TABLE} (app_code, room_id, id)",
    ),
}

#: A room's feed in order, after cursor ``id`` (0 for the start): app_code, room_id, after, limit.
FEED_QUERY = (
    f"SELECT id, room_version, kind, user_id, detail, occurred_at_ms, event_id FROM {TABLE}"
    " WHERE app_code = %s AND room_id = %s AND id > %s ORDER BY id LIMIT %s"
)


class ActivityHandler:
    """``table``: ``room_activity`` as found at start (:meth:`HandlerFactoryContext.table`)."""

    def __init__(self, table: HandlerTable = COLUMNS) -> None:
        self.table = table
        self.insert = f"INSERT INTO {TABLE} ({table.insert_columns}) VALUES ({', '.join(['%s'] * len(table.columns))})"

    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        e = event.envelope
        payload = e.payload or {}
        user = payload.get("user_id")
        async with ctx.transaction() as tx:
            row = self.table.row(
                {"app_code": e.app_code, "room_id": e.room_id, "room_version": e.room_version, "event_id": e.event_id,
                 "event_type": e.event_type, "kind": ACTIVITY_KINDS[e.event_type],
                 "user_id": None if user is None else str(user), "detail": json.dumps(payload, ensure_ascii=False),
                 "occurred_at_ms": e.occurred_at_ms},
                tx.dialect,
            )  # fmt: skip
            await tx.execute(self.insert, row)

    async def aclose(self) -> None:
        pass


def _create(settings: HandlerSettings, context: HandlerFactoryContext) -> ActivityHandler:
    return ActivityHandler(context.table(COLUMNS))


@hookimpl
def room_outbox_register_handlers() -> list[HandlerSpec[HandlerSettings]]:
    return [HandlerSpec("activity", _create, event_types=frozenset(ACTIVITY_KINDS), schema=SCHEMA, tables=(COLUMNS,))]
