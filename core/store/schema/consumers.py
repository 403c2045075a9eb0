"""The consumer engine's tables (:mod:`room_outbox.store.consumers.sql`) on MySQL/MariaDB and
PostgreSQL, and what ``migrate`` adds for them. SQLite has none: consumers run on a server
their processes share."""

from __future__ import annotations

from typing import Any

from room_outbox.handler import EXACT_COLLATION
from room_outbox.store.dialect import Dialect, index_names, table_names
from room_outbox.store.schema.columns import compares_exactly, inexact_note, read_columns
from room_outbox.store.schema.outbox import Migration

PROCESSED = "room_consumer_processed"
RETRY = "room_consumer_retry"
#: The processed records' age index: retention walks it (``prune_processed``).
AGE_INDEX = "idx_room_consumer_processed_age"

#: room_consumer_processed's columns and key, the same on both servers. The key leads with
#: event_id: the same unique key, and ``inspect``'s look-up by event_id needs no second index
#: to maintain on every insert.
_PROCESSED_COLUMNS = """  consumer        VARCHAR(64)  NOT NULL,
  handler         VARCHAR(64)  NOT NULL,
  app_code        VARCHAR(64)  NOT NULL,
  event_id        VARCHAR(128) NOT NULL,
  topic           VARCHAR(249) NOT NULL,
  kafka_partition INT          NOT NULL,
  kafka_offset    BIGINT       NOT NULL,
  processed_at_ms BIGINT       NOT NULL,
  PRIMARY KEY (event_id, app_code, consumer, handler)"""


def _retry_columns(id_column: str, blob: str) -> str:
    """room_consumer_retry's columns; the servers differ in the id's and the value's types."""
    return f"""  id              {id_column},
  consumer        VARCHAR(64)   NOT NULL,
  handler         VARCHAR(64)   NOT NULL,
  app_code        VARCHAR(64)   NOT NULL,
  event_id        VARCHAR(128)  NOT NULL,
  event_type      VARCHAR(64)   NOT NULL DEFAULT '',
  room_key        VARCHAR(200)  NOT NULL,
  topic           VARCHAR(249)  NOT NULL,
  kafka_partition INT           NOT NULL,
  kafka_offset    BIGINT        NOT NULL,
  value           {blob:<14}NOT NULL,
  headers         TEXT          NOT NULL,
  status          VARCHAR(16)   NOT NULL,
  attempts        INT           NOT NULL DEFAULT 0,
  due_at_ms       BIGINT        NOT NULL,
  owner           VARCHAR(128)  NULL,
  last_error      VARCHAR(1024) NULL,
  created_at_ms   BIGINT        NOT NULL,
  updated_at_ms   BIGINT        NOT NULL,"""


#: The MySQL/MariaDB tables' options. Their text compares exactly (:data:`EXACT_COLLATION`), as
#: on PostgreSQL: room-service's table may hold two events whose ids differ only in letter case,
#: and under a default collation the second would find the first's processed record and be
#: taken for a duplicate, never handled.
_MYSQL_OPTIONS = f"ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE={EXACT_COLLATION}"
#: Per table, the columns that identify a handling (its key) or a room (the retry rows' order):
#: the ones that must compare exactly.
IDENTITY_COLUMNS = {
    PROCESSED: ("consumer", "handler", "app_code", "event_id"),
    RETRY: ("consumer", "handler", "app_code", "event_id", "room_key"),
}

#: Each table's creation, in order, per database: (table, its CREATE TABLE, its CREATE INDEX statements).
CONSUMER_TABLES: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "mysql": (
        (
            PROCESSED,
            f"""CREATE TABLE IF NOT EXISTS {PROCESSED} (
{_PROCESSED_COLUMNS},
  KEY {AGE_INDEX} (processed_at_ms)
) {_MYSQL_OPTIONS}""",
            (),
        ),
        (
            RETRY,
            f"""CREATE TABLE IF NOT EXISTS {RETRY} (
{_retry_columns(id_column="BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY", blob="LONGBLOB")}
  UNIQUE KEY uk_room_consumer_retry_event (consumer, handler, app_code, event_id),
  KEY idx_room_consumer_retry_due (consumer, status, due_at_ms, id),
  KEY idx_room_consumer_retry_room (consumer, room_key, status, handler, id),
  KEY idx_room_consumer_retry_event (event_id)
) {_MYSQL_OPTIONS}""",
            (),
        ),
    ),
    "postgresql": (
        (
            PROCESSED,
            f"""CREATE TABLE IF NOT EXISTS {PROCESSED} (
{_PROCESSED_COLUMNS}
)""",
            (f"CREATE INDEX IF NOT EXISTS {AGE_INDEX} ON {PROCESSED} (processed_at_ms)",),
        ),
        (
            RETRY,
            f"""CREATE TABLE IF NOT EXISTS {RETRY} (
{_retry_columns(id_column="BIGSERIAL PRIMARY KEY", blob="BYTEA")}
  CONSTRAINT uk_room_consumer_retry_event UNIQUE (consumer, handler, app_code, event_id)
)""",
            (
                f"CREATE INDEX IF NOT EXISTS idx_room_consumer_retry_due ON {RETRY} (consumer, status, due_at_ms, id)",
                f"CREATE INDEX IF NOT EXISTS idx_room_consumer_retry_room ON {RETRY}"
                " (consumer, room_key, status, handler, id)",
                f"CREATE INDEX IF NOT EXISTS idx_room_consumer_retry_event ON {RETRY} (event_id)",
            ),
        ),
    ),
}
#: Indexes added after the table first shipped, per database: (table, index, statement adding it).
CONSUMER_ADDED_INDEXES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "mysql": ((PROCESSED, AGE_INDEX, f"ALTER TABLE {PROCESSED} ADD INDEX {AGE_INDEX} (processed_at_ms)"),),
    "postgresql": ((PROCESSED, AGE_INDEX, f"CREATE INDEX IF NOT EXISTS {AGE_INDEX} ON {PROCESSED} (processed_at_ms)"),),
}


async def consumer_steps(cur: Any, dialect: Dialect) -> list[Migration]:
    """The consumers' tables and indexes that do not exist yet, read from the catalogue in the
    caller's transaction; nothing on a database without consumers' tables (SQLite)."""
    if dialect.name not in CONSUMER_TABLES:
        return []
    plan = []
    existing = await table_names(cur, dialect)
    for table, create, indexes in CONSUMER_TABLES[dialect.name]:
        if table not in existing:
            plan.append(Migration(f"created table {table}", (create, *indexes)))
    for table, index, statement in CONSUMER_ADDED_INDEXES[dialect.name]:
        if table in existing and index not in await index_names(cur, dialect, table):
            plan.append(Migration(f"added index {table}.{index}", (statement,)))
    plan += [Migration(f"left as it is: {warning}", ()) for warning in await inexact_tables(cur, dialect)]
    return plan


async def inexact_tables(cur: Any, dialect: Dialect) -> list[str]:
    """A warning per consumers' table made by an earlier version on MySQL/MariaDB, whose
    identity columns ignore letter case (the server's default collation). ``migrate`` leaves
    them as they are: the change copies the table with writes blocked, which an operator plans;
    ``migrate`` and ``consume`` say so, with the statement."""
    if dialect.name != "mysql":
        return []
    warnings = []
    for table, identity in IDENTITY_COLUMNS.items():
        found = await read_columns(cur, dialect, table)
        inexact = [found[name] for name in identity if name in found and not compares_exactly(found[name])]
        if inexact:
            fix = f"ALTER TABLE {table} CONVERT TO CHARACTER SET utf8mb4 COLLATE {EXACT_COLLATION}"
            warnings.append(inexact_note(table, inexact, "handled", fix))
    return warnings
