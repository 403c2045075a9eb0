"""The cluster's tables: their names, their DDL, and the plan that adds them with each table's
room bucket. Live nodes and room buckets (:mod:`room_outbox.store.membership`) live in tables
of their own, and a row's bucket in a column of the outbox and lane tables (on PostgreSQL in
the claim index's expression)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from room_outbox.errors import SchemaError
from room_outbox.store.dialect import POSTGRESQL, Dialect, column_names, table_names
from room_outbox.store.schema.outbox import add_column_sql, add_index_sql, claim_index
from room_outbox.store.schema.partitions import index_statements, partitions_of
from room_outbox.store.schema.profiles import V1, Profile

BUCKET_COLUMN = "room_bucket"
NODE_TABLE = "room_outbox_node"
BUCKET_TABLE = "room_outbox_bucket"

#: Buckets rooms hash to. Fixed: it is part of the schema (the generated column's formula).
BUCKETS = 256

#: CRC-32 (IEEE, reflected polynomial 0xEDB88320) of a text's UTF-8 bytes, for PostgreSQL,
#: which has none built in. IMMUTABLE: an index may hold it. A byte at a time through the
#: usual 256-entry table (a constant the function's plan folds once): PostgreSQL computes it
#: for every row a claim limited to some buckets passes over.
PG_CRC32_FUNCTION = "room_outbox_crc32"


def _crc32_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
        table.append(crc)
    return table


PG_CRC32_DDL = f"""
CREATE OR REPLACE FUNCTION {PG_CRC32_FUNCTION}(key text) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
  data bytea := convert_to(key, 'UTF8');
  crc bigint := 4294967295;
BEGIN
  FOR i IN 0 .. length(data) - 1 LOOP
    crc := (crc >> 8) # (ARRAY[{", ".join(map(str, _crc32_table()))}]::bigint[])[((crc # get_byte(data, i)) & 255) + 1];
  END LOOP;
  RETURN crc # 4294967295;
END
$$
"""


#: The node table's column naming the ordering of each lane the process runs
#: (``main=per_room,kafka=none``), so that processes that disagree can say so. Added to a
#: table made before by a catalogue-only change.
NODE_ORDERINGS = "orderings VARCHAR(255) NOT NULL DEFAULT ''"


def node_ddl(dialect: Dialect) -> str:
    return f"""CREATE TABLE IF NOT EXISTS {NODE_TABLE} (
  node_id       VARCHAR(128) NOT NULL PRIMARY KEY,
  heartbeat_ms  BIGINT       NOT NULL,
  joined_ms     BIGINT       NOT NULL,
  view          VARCHAR(64)  NOT NULL DEFAULT '',
  view_since_ms BIGINT       NOT NULL DEFAULT 0,
  {NODE_ORDERINGS}
){dialect.table_options}"""


def bucket_ddl(dialect: Dialect) -> str:
    small = "SMALLINT UNSIGNED" if dialect.name == "mysql" else "SMALLINT"
    return f"""CREATE TABLE IF NOT EXISTS {BUCKET_TABLE} (
  bucket            {small} NOT NULL PRIMARY KEY,
  owner             VARCHAR(128) NULL,
  handing_over      SMALLINT     NOT NULL DEFAULT 0,
  claimable_from_ms BIGINT       NOT NULL DEFAULT 0,
  updated_at_ms     BIGINT       NOT NULL
){dialect.table_options}"""


def bucket_column(dialect: Dialect, profile: Profile = V1, stored: bool = True) -> str:
    """The bucket column's definition in a table whose rows are shaped as ``profile`` says.
    On MySQL/MariaDB ``stored`` only for a table the same migration creates (see the module
    docstring): a STORED column is added by copying the table, a VIRTUAL one instantly.
    PostgreSQL has no column: its claim index holds the expression (:func:`row_bucket`)."""
    if dialect.name == "mysql":
        return (
            f"{BUCKET_COLUMN} SMALLINT UNSIGNED AS ({bucket_sql('mysql', profile)}) {'STORED' if stored else 'VIRTUAL'}"
        )
    raise ValueError(f"no room bucket column on the {dialect.name} dialect")


def row_bucket(dialect: Dialect, profile: Profile = V1) -> str:
    """SQL: the room bucket of a row shaped as ``profile`` says, as claims and the handover
    fence read it (the column on MySQL/MariaDB, the claim index's expression on PostgreSQL)."""
    return dialect.room_bucket(profile.app_code, profile.room_id)


def bucket_sql(dialect: str = "mysql", profile: Profile = V1) -> str:
    """:func:`bucket_of` as a SQL expression over a row's app code and room (the columns, or
    expressions, ``profile`` names): the one definition each store renders in its own dialect."""
    app_code, room_id = profile.app_code, profile.room_id
    if dialect == "mysql":
        return f"CRC32(CONCAT({app_code}, ':', {room_id})) % {BUCKETS}"
    if dialect == "postgresql":
        return POSTGRESQL.room_bucket(app_code, room_id)
    raise ValueError(f"no bucket expression for the {dialect} dialect")


async def bucket_plan(
    cur: Any,
    dialect: Dialect,
    tables: Sequence[str],
    membership: bool = True,
    profile: Profile = V1,
    key: str | None = None,
    function_planned: bool = False,
) -> list[tuple[str, tuple[str, ...]]]:
    """What a migration adds (``(change, statements)`` steps, MySQL/MariaDB or PostgreSQL): with
    ``membership``, the node and bucket tables when missing; for each of ``tables`` (created by
    an earlier step or already there, rows shaped as ``profile`` says, keyed by ``key``,
    default the profile's), its bucket column when missing and the claim's index with the
    bucket last (an earlier install's index without it is rebuilt; PostgreSQL:
    :func:`_pg_bucket_steps`; ``function_planned``: an earlier step of the same plan sees to the
    bucket function). A column already there stays as it is, STORED or VIRTUAL."""
    steps: list[tuple[str, tuple[str, ...]]] = []
    existing = await table_names(cur, dialect)
    if membership:
        if NODE_TABLE not in existing:
            steps.append((f"created table {NODE_TABLE}", (node_ddl(dialect),)))
        elif "orderings" not in await column_names(cur, dialect, NODE_TABLE):
            steps.append(
                (f"added column {NODE_TABLE}.orderings", (add_column_sql(dialect, NODE_TABLE, NODE_ORDERINGS),))
            )
        if BUCKET_TABLE not in existing:
            rows = ", ".join(f"({bucket}, NULL, 0)" for bucket in range(BUCKETS))
            insert = f"INSERT INTO {BUCKET_TABLE} (bucket, owner, updated_at_ms) VALUES {rows}"
            steps.append((f"created table {BUCKET_TABLE}", (bucket_ddl(dialect), insert)))
    if dialect.name == "postgresql":
        function = [] if function_planned else await _pg_function_steps(cur)
        return steps + function + await _pg_bucket_steps(cur, tables, existing, profile, key or profile.key)
    # MySQL/MariaDB from here on. A table created by an earlier step of the same plan has no bucket column yet.
    missing = [
        table
        for table in tables
        if table.lower() not in existing or BUCKET_COLUMN not in await column_names(cur, dialect, table)
    ]
    for table in tables:
        if table in missing:
            steps.append(
                (f"added column {table}.{BUCKET_COLUMN}", (_add_bucket_column(dialect, table, existing, profile),))
            )
        name, columns = claim_index(table, profile.lock, key or profile.key, BUCKET_COLUMN)
        have = await _index_columns(cur, table, name) if table.lower() in existing else []
        if have == _columns_of(columns):
            continue
        if not have:
            steps.append((f"added index {table}.{name}", add_index_sql(dialect, table, name, columns)))
        else:
            steps.append(
                (f"rebuilt index {table}.{name} with {BUCKET_COLUMN}", _rebuild_index(dialect, table, name, columns))
            )
    return steps


async def _pg_bucket_steps(
    cur: Any, tables: Sequence[str], existing: set[str], profile: Profile, key: str
) -> list[tuple[str, tuple[str, ...]]]:
    """PostgreSQL: on each table the claim's index with the bucket expression last, built ``CONCURRENTLY`` (writes go on meanwhile). No column:
    adding a generated one rewrites the whole table under a lock that blocks even reads. An
    earlier install's index (the bucket column last, or no bucket) is replaced under its name:
    the new index is built beside it, the old one dropped, the new one renamed, each without
    blocking writes, and a rerun takes up where an interrupted one stopped. The earlier
    install's column stays (dropping it would break processes still running the old version)."""
    steps: list[tuple[str, tuple[str, ...]]] = []
    for table in tables:
        name, columns = claim_index(table, profile.lock, key, f"({row_bucket(POSTGRESQL, profile)})")
        indexes = await _pg_index_definitions(cur, table) if table.lower() in existing else {}
        current, beside = indexes.get(name), f"{name}_next"
        if current is not None and PG_CRC32_FUNCTION in current:
            continue
        partitions = await partitions_of(cur, table) if table.lower() in existing else None
        if current is None and beside not in indexes:
            steps.append((f"added index {table}.{name}", index_statements(table, name, columns, partitions)))
            continue
        if partitions is not None:  # a partitioned index cannot be dropped without blocking writes
            raise SchemaError(
                f"index {name} of the partitioned table {table} is an earlier version's, without the room"
                f" bucket; drop it (DROP INDEX {name}: it blocks the table's writes while it runs) and run"
                " migrate again, which builds the new one online"
            )
        build = f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {{name}} ON {table} {columns}"
        replace = (build.format(name=beside), f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
        steps.append(
            (f"rebuilt index {table}.{name} with the room bucket", (*replace, f"ALTER INDEX {beside} RENAME TO {name}"))
        )
    return steps


async def _pg_function_steps(cur: Any) -> list[tuple[str, tuple[str, ...]]]:
    """PostgreSQL: the CRC-32 function the bucket indexes compute, when missing or outdated."""
    # The one the index's expression will find: through the search path, not in any schema.
    await cur.execute("SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure(%s)", (f"{PG_CRC32_FUNCTION}(text)",))
    function = await cur.fetchone()
    if function is None:
        return [(f"created function {PG_CRC32_FUNCTION}", (PG_CRC32_DDL.strip(),))]
    if function[0] != PG_CRC32_DDL.split("$$")[1]:  # an earlier version: same results, slower
        return [(f"replaced function {PG_CRC32_FUNCTION} (same results, faster)", (PG_CRC32_DDL.strip(),))]
    return []


async def _pg_index_definitions(cur: Any, table: str) -> dict[str, str]:
    """``table``'s valid indexes: name → definition (PostgreSQL)."""
    await cur.execute(
        "SELECT ix.relname, pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class ix ON ix.oid = i.indexrelid"
        " JOIN pg_class t ON t.oid = i.indrelid JOIN pg_namespace n ON n.oid = t.relnamespace"
        " WHERE n.nspname = current_schema() AND t.relname = %s AND i.indisvalid",
        (table,),
    )
    return {str(row[0]): str(row[1]) for row in await cur.fetchall()}


def _add_bucket_column(dialect: Dialect, table: str, existing: set[str], profile: Profile) -> str:
    """The bucket column added to ``table`` (MySQL/MariaDB). A table already there (room-service's
    live table, a lane's full one) gets a VIRTUAL column, added instantly; a table created by
    the same migration is empty and gets a STORED one, which the claim reads in the index."""
    if table.lower() in existing:
        return add_column_sql(dialect, table, bucket_column(dialect, profile, stored=False))
    return f"ALTER TABLE {table} ADD COLUMN {bucket_column(dialect, profile)}"


def _rebuild_index(dialect: Dialect, table: str, name: str, columns: str) -> tuple[str, ...]:
    """Replaces ``table``'s index ``name`` by one on ``columns`` (MySQL/MariaDB): in one
    statement, built in place while writes go on (the claim never finds the index missing)."""
    return (f"ALTER TABLE {table} DROP INDEX {name}, ADD INDEX {name} {columns}{dialect.online_index}",)


def _columns_of(columns_sql: str) -> list[str]:
    """``(a, b, c)`` → ``["a", "b", "c"]``."""
    return [column.strip().lower() for column in columns_sql.strip("()").split(",")]


async def _index_columns(cur: Any, table: str, index: str) -> list[str]:
    """The columns of ``table``'s index ``index``, in order (MySQL/MariaDB; none: no such index)."""
    await cur.execute(
        "SELECT COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE()"
        " AND TABLE_NAME = %s AND INDEX_NAME = %s ORDER BY SEQ_IN_INDEX",
        (table, index),
    )
    return [str(row[0]).lower() for row in await cur.fetchall()]
