"""The ``activity`` handler: a per-room feed of what users see happen (``room_activity``).

Joins, leaves, gifts, mic changes, kicks and mutes, one row each, with the event's
``room_version``. The consumer hands a room's events over in order (``ordering: per_room``,
the default), so ``id`` grows with the room's history; read a room's feed with
:data:`FEED_QUERY` (oldest first, from a cursor ``id``). Written in the consumer's transaction:
a redelivered event adds no second row.
"""

from __future__ import annotations

import json

from room_outbox import (
    ConsumedEvent,
    HandleContext,
    HandlerFactoryContext,
    HandlerSettings,
    HandlerSpec,
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

#: The columns but the id, the same on both databases.
_COLUMNS = """  app_code       VARCHAR(64)  NOT NULL,
  room_id        VARCHAR(64)  NOT NULL,
  room_version   BIGINT       NULL,
  event_id       VARCHAR(128) NOT NULL,
  event_type     VARCHAR(64)  NOT NULL,
  kind           VARCHAR(16)  NOT NULL,
  user_id        VARCHAR(128) NULL,
  detail         TEXT         NOT NULL,
  occurred_at_ms BIGINT       NULL"""

#: The table, per database; ``migrate`` creates it.
SCHEMA = {
    "mysql": (
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  id             BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
{_COLUMNS},
  UNIQUE KEY uk_room_activity_event (app_code, event_id),
  KEY idx_room_activity_feed (app_code, room_id, id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
    ),
    "postgresql": (
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  id             BIGSERIAL    PRIMARY KEY,
{_COLUMNS},
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
    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        e = event.envelope
        payload = e.payload or {}
        user = payload.get("user_id")
        async with ctx.transaction() as tx:
            await tx.execute(
                f"INSERT INTO {TABLE} (app_code, room_id, room_version, event_id, event_type, kind, user_id, detail,"
                " occurred_at_ms) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (e.app_code, e.room_id, e.room_version, e.event_id, e.event_type, ACTIVITY_KINDS[e.event_type],
                 None if user is None else str(user), json.dumps(payload, ensure_ascii=False), e.occurred_at_ms),
            )  # fmt: skip

    async def aclose(self) -> None:
        pass


def _create(settings: HandlerSettings, context: HandlerFactoryContext) -> ActivityHandler:
    return ActivityHandler()


@hookimpl
def room_outbox_register_handlers() -> list[HandlerSpec[HandlerSettings]]:
    return [HandlerSpec("activity", _create, event_types=frozenset(ACTIVITY_KINDS), schema=SCHEMA)]
