"""The ``audit`` handler: every room event once, in the append-only table ``room_audit_log``.

One row per (app_code, event_id), holding the whole envelope and where it was read from. The
row is written in the consumer's transaction together with its processed record, so a
redelivered message never writes a second row; the unique key on (app_code, event_id) keeps
the log to one row per event even across consumers (a second consumer running ``audit``
finds the row there and adds nothing). Rows are only ever inserted: ``id`` is the order in
which they were recorded, which for one room is the room's order.

A field longer than its column is a permanent failure naming the field (the message becomes
a dead letter): the log never holds a value cut short, on either database.
"""

from __future__ import annotations

import time

from room_outbox import (
    ConsumedEvent,
    HandleContext,
    HandlerFactoryContext,
    HandlerSettings,
    HandlerSpec,
    PermanentHandlerError,
    hookimpl,
)

TABLE = "room_audit_log"


def _columns(text: str) -> str:
    """The columns but the id, the same on both databases but for the envelope's text type."""
    return f"""  app_code        VARCHAR(64)  NOT NULL,
  event_id        VARCHAR(128) NOT NULL,
  event_type      VARCHAR(64)  NOT NULL,
  room_id         VARCHAR(64)  NOT NULL,
  room_version    BIGINT       NULL,
  occurred_at_ms  BIGINT       NULL,
  envelope        {text:<12} NOT NULL,
  consumer        VARCHAR(64)  NOT NULL,
  topic           VARCHAR(249) NOT NULL,
  kafka_partition INT          NOT NULL,
  kafka_offset    BIGINT       NOT NULL,
  recorded_at_ms  BIGINT       NOT NULL"""


#: The table, per database; ``migrate`` creates it.
SCHEMA = {
    "mysql": (
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  id              BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
{_columns("LONGTEXT")},
  UNIQUE KEY uk_room_audit_log_event (app_code, event_id),
  KEY idx_room_audit_log_room (app_code, room_id, id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
    ),
    "postgresql": (
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  id              BIGSERIAL    PRIMARY KEY,
{_columns("TEXT")},
  CONSTRAINT uk_room_audit_log_event UNIQUE (app_code, event_id)
)""",
        f"CREATE INDEX IF NOT EXISTS idx_room_audit_log_room ON {TABLE} (app_code, room_id, id)",
    ),
}

_COLUMNS = (
    "app_code, event_id, event_type, room_id, room_version, occurred_at_ms, envelope, consumer, topic,"
    " kafka_partition, kafka_offset, recorded_at_ms"
)
_VALUES = "%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s"
#: Insert unless the event is in the log already, per dialect. Not MySQL's ``INSERT IGNORE``:
#: it turns every error into a warning, a value too long for its column into a cut one.
INSERT = {
    "mysql": f"INSERT INTO {TABLE} ({_COLUMNS}) VALUES ({_VALUES}) ON DUPLICATE KEY UPDATE id = id",
    "postgresql": f"INSERT INTO {TABLE} ({_COLUMNS}) VALUES ({_VALUES}) ON CONFLICT (app_code, event_id) DO NOTHING",
}


#: The text columns' lengths, checked before writing (PostgreSQL would refuse the whole
#: transaction; a retry cannot make a value shorter).
_LENGTHS = {"app_code": 64, "event_id": 128, "event_type": 64, "room_id": 64, "consumer": 64, "topic": 249}


def _row(event: ConsumedEvent, recorded_at_ms: int) -> tuple[object, ...]:
    """The row for ``event``, or :class:`PermanentHandlerError` naming a field too long."""
    e = event.envelope
    texts = {"app_code": e.app_code, "event_id": e.event_id, "event_type": e.event_type, "room_id": e.room_id,
             "consumer": event.consumer, "topic": event.topic}  # fmt: skip
    for field, value in texts.items():
        if len(value) > _LENGTHS[field]:
            raise PermanentHandlerError(f"{field} is {len(value)} characters; {TABLE}.{field} holds {_LENGTHS[field]}")
    return (e.app_code, e.event_id, e.event_type, e.room_id, e.room_version, e.occurred_at_ms,
            _envelope_json(event), event.consumer, event.topic, event.partition, event.offset, recorded_at_ms)  # fmt: skip


def _envelope_json(event: ConsumedEvent) -> str:
    """The envelope exactly as it was sent (it parsed, so it is UTF-8 JSON)."""
    return event.value.decode() if event.value else event.envelope.model_dump_json()


class AuditHandler:
    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        row = _row(event, int(time.time() * 1000))
        async with ctx.transaction() as tx:
            await tx.execute(INSERT[tx.dialect], row)

    async def handle_batch(self, events: list[ConsumedEvent], ctx: HandleContext) -> None:
        """One multi-row statement; rows in the order given, so ``id`` keeps each room's order."""
        recorded = int(time.time() * 1000)
        rows = [_row(event, recorded) for event in events]
        async with ctx.transaction() as tx:
            await tx.executemany(INSERT[tx.dialect], rows)

    async def aclose(self) -> None:
        pass


def _create(settings: HandlerSettings, context: HandlerFactoryContext) -> AuditHandler:
    return AuditHandler()


@hookimpl
def room_outbox_register_handlers() -> list[HandlerSpec[HandlerSettings]]:
    return [HandlerSpec("audit", _create, schema=SCHEMA)]
