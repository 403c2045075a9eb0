"""The ``audit`` handler: every room event once, in the append-only table ``room_audit_log``.

One row per (app_code, event_id), holding the whole envelope and where it was read from. The
row is written in the consumer's transaction together with its processed record, so a
redelivered message never writes a second row; the unique key on (app_code, event_id) keeps
the log to one row per event even across consumers (a second consumer running ``audit``
finds the row there and adds nothing). Rows are only ever inserted: ``id`` is the order in
which they were recorded, which for one room is the room's order.

A value its column cannot hold (a field longer than the column, a NUL on PostgreSQL) is a
permanent failure naming the column (the message becomes a dead letter): the log never holds a
value cut short, on either database. The columns are those of the table as ``consume`` found it
at start, which ``migrate`` and ``consume`` check can hold what the handler writes: a table made
beforehand with narrower columns is refused, naming the column and the fix.
"""

from __future__ import annotations

import time

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

TABLE = "room_audit_log"


#: The columns it writes (all but the id): ``migrate`` creates them and, where the table was made
#: beforehand, checks it can hold them; the handler's rows are checked against them. The
#: envelope is LONGTEXT on MySQL, whose TEXT holds 64 KB. The unique key's app_code and event_id
#: compare exactly: ids differing only in letter case are two events, each logged.
COLUMNS = HandlerTable(
    TABLE,
    {
        "app_code": HandlerColumn("text", 64, exact=True),
        "event_id": HandlerColumn("text", 128, exact=True),
        "event_type": HandlerColumn("text", 64),
        "room_id": HandlerColumn("text", 64),
        "room_version": HandlerColumn("bigint", nullable=True),
        "occurred_at_ms": HandlerColumn("bigint", nullable=True),
        "envelope": HandlerColumn("text"),
        "consumer": HandlerColumn("text", 64),
        "topic": HandlerColumn("text", 249),
        "kafka_partition": HandlerColumn("int"),
        "kafka_offset": HandlerColumn("bigint"),
        "recorded_at_ms": HandlerColumn("bigint"),
    },
)


#: The table, per database; ``migrate`` creates it.
SCHEMA = {
    "mysql": (
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  id              BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
{COLUMNS.definitions("mysql")},
  UNIQUE KEY uk_room_audit_log_event (app_code, event_id),
  KEY idx_room_audit_log_room (app_code, room_id, id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
    ),
    "postgresql": (
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
  id              BIGSERIAL    PRIMARY KEY,
{COLUMNS.definitions("postgresql")},
  CONSTRAINT uk_room_audit_log_event UNIQUE (app_code, event_id)
)""",
        f"CREATE INDEX IF NOT EXISTS idx_room_audit_log_room ON {TABLE} (app_code, room_id, id)",
    ),
}

_VALUES = ", ".join(["%s"] * len(COLUMNS.columns))
#: Insert unless the event is in the log already, per dialect. Not MySQL's ``INSERT IGNORE``:
#: it turns every error into a warning, a value too long for its column into a cut one.
INSERT = {
    "mysql": f"INSERT INTO {TABLE} ({COLUMNS.insert_columns}) VALUES ({_VALUES}) ON DUPLICATE KEY UPDATE id = id",
    "postgresql": f"INSERT INTO {TABLE} ({COLUMNS.insert_columns}) VALUES ({_VALUES})"
    " ON CONFLICT (app_code, event_id) DO NOTHING",
}


def _values(event: ConsumedEvent, recorded_at_ms: int) -> dict[str, object]:
    """The row for ``event``, by column."""
    e = event.envelope
    return {"app_code": e.app_code, "event_id": e.event_id, "event_type": e.event_type, "room_id": e.room_id,
            "room_version": e.room_version, "occurred_at_ms": e.occurred_at_ms, "envelope": _envelope_json(event),
            "consumer": event.consumer, "topic": event.topic, "kafka_partition": event.partition,
            "kafka_offset": event.offset, "recorded_at_ms": recorded_at_ms}  # fmt: skip


def _envelope_json(event: ConsumedEvent) -> str:
    """The envelope exactly as it was sent (it parsed, so it is UTF-8 JSON)."""
    return event.value.decode() if event.value else event.envelope.model_dump_json()


class AuditHandler:
    """``table``: ``room_audit_log`` as found at start (:meth:`HandlerFactoryContext.table`)."""

    def __init__(self, table: HandlerTable = COLUMNS) -> None:
        self.table = table

    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        values = _values(event, int(time.time() * 1000))
        async with ctx.transaction() as tx:
            await tx.execute(INSERT[tx.dialect], self.table.row(values, tx.dialect))

    async def handle_batch(self, events: list[ConsumedEvent], ctx: HandleContext) -> None:
        """One multi-row statement; rows in the order given, so ``id`` keeps each room's order."""
        recorded = int(time.time() * 1000)
        async with ctx.transaction() as tx:
            rows = [self.table.row(_values(event, recorded), tx.dialect) for event in events]
            await tx.executemany(INSERT[tx.dialect], rows)

    async def aclose(self) -> None:
        pass


def _create(settings: HandlerSettings, context: HandlerFactoryContext) -> AuditHandler:
    return AuditHandler(context.table(COLUMNS))


@hookimpl
def room_outbox_register_handlers() -> list[HandlerSpec[HandlerSettings]]:
    return [HandlerSpec("audit", _create, schema=SCHEMA, tables=(COLUMNS,))]
