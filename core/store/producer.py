"""The statements of the producer side (:mod:`room_outbox.producer`): the outbox row written
in the caller's own transaction, and the ``published`` mark after a successful push. They
name ``room_outbox`` and its V1 columns, as room-service's own statements do."""

from __future__ import annotations

from typing import Any

from room_outbox.store.dialect import MYSQL, POSTGRESQL, SQLITE, Dialect

INSERT_EVENT = (
    "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s)"
)
#: The same INSERT skipping a row whose event_id exists, per dialect: a retried command (the
#: same event_id) leaves the first row as it is and the caller's transaction goes on.
INSERT_EVENT_ONCE = {
    dialect.name: dialect.insert_skipping_duplicates(INSERT_EVENT, "event_id")
    for dialect in (MYSQL, POSTGRESQL, SQLITE)
}
#: Exactly room-service's statement, so both producers behave alike.
MARK_PUBLISHED = "UPDATE room_outbox SET status='published' WHERE event_id=%s"


async def insert_event(
    cur: Any, dialect: Dialect, app_code: str, event_id: str, event_type: str, room_id: str, envelope: str, now: int
) -> None:
    """A ``pending`` row through the caller's cursor (so in the caller's transaction); an
    event_id already in the table is skipped."""
    await cur.execute(INSERT_EVENT_ONCE[dialect.name], (app_code, event_id, event_type, room_id, envelope, now, now))


async def mark_published(cur: Any, event_id: str) -> None:
    """room-service's mark after its own push succeeded, through the caller's cursor."""
    await cur.execute(MARK_PUBLISHED, (event_id,))
