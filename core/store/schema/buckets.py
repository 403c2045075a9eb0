"""The cluster's tables: their names, their DDL, and the plan that adds them with each table's
room bucket. Live nodes and room buckets (:mod:`room_outbox.store.membership`) live in tables
of their own. A row's bucket is a STORED column, last in the claim index, in the MySQL/MariaDB
tables ``migrate`` creates; it is computed on the row in a table that was there before (a
generated column would take away its owner's online column changes) and on PostgreSQL (the
claim index holds the expression). :func:`read_row_bucket` says which, per table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from room_outbox.errors import SchemaError
from room_outbox.store.dialect import POSTGRESQL, Dialect, column_names, table_names, text
from room_outbox.store.schema.columns import printed_name
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


def bucket_column(dialect: Dialect, profile: Profile = V1) -> str:
    """The bucket column's definition (MySQL/MariaDB), STORED, in a table the same migration
    creates, whose rows are shaped as ``profile`` says. A table already there gets none: a
    STORED column is added by copying the table, and a VIRTUAL one in an index takes away
    every online ADD or DROP COLUMN of the table on MariaDB. PostgreSQL has no column: its
    claim index holds the expression."""
    if dialect.name == "mysql":
        return f"{BUCKET_COLUMN} SMALLINT UNSIGNED AS ({row_bucket(dialect, profile)}) STORED"
    raise ValueError(f"no room bucket column on the {dialect.name} dialect")


def row_bucket(dialect: Dialect, profile: Profile = V1) -> str:
    """SQL: the room bucket of a row shaped as ``profile`` says, computed on the row (the
    dialect's :meth:`~room_outbox.store.dialect.Dialect.room_bucket`: :func:`bucket_of` in SQL)."""
    return dialect.room_bucket(profile.app_code, profile.room_id)


def _insert_buckets(buckets: Sequence[int]) -> str:
    """SQL: the rows of ``buckets`` in the bucket table, owned by no process yet."""
    rows = ", ".join(f"({bucket}, NULL, 0)" for bucket in buckets)
    return f"INSERT INTO {BUCKET_TABLE} (bucket, owner, updated_at_ms) VALUES {rows}"


async def missing_buckets(cur: Any) -> list[int]:
    """The buckets the bucket table has no row for. A room whose bucket has no row is never
    handed to any process: with per-room ordering its events would wait for ever."""
    await cur.execute(f"SELECT bucket FROM {BUCKET_TABLE}")
    there = {int(row[0]) for row in await cur.fetchall()}
    return [bucket for bucket in range(BUCKETS) if bucket not in there]


#: How a MySQL/MariaDB table holds the bucket (:func:`bucket_column_kind`).
STORED, VIRTUAL, NO_COLUMN = "stored", "virtual", ""


async def bucket_column_kind(cur: Any, table: str) -> str:
    """How ``table`` holds the room bucket (MySQL/MariaDB): :data:`STORED` (tables ``migrate``
    created), :data:`VIRTUAL` (a table an earlier version adopted) or :data:`NO_COLUMN`."""
    await cur.execute(
        "SELECT EXTRA FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s"
        " AND COLUMN_NAME = %s",
        (table, BUCKET_COLUMN),
    )
    row = await cur.fetchone()
    if row is None:
        return NO_COLUMN
    return VIRTUAL if "VIRTUAL" in text(row[0] or "").upper() else STORED


async def read_row_bucket(cur: Any, dialect: Dialect, table: str, profile: Profile = V1) -> str:
    """SQL: the room bucket of a row of ``table`` (shaped as ``profile`` says) as claims and
    the handover fence read it, decided from the table's columns: the STORED column where the
    table has one (the claim index's last column: a claim checks it in the index entries),
    else computed on the row. A VIRTUAL column (an earlier version's adoption, kept for its
    processes) is computed on every read anyway, and is left unread so that it can be dropped
    while these processes run."""
    if dialect.name == "mysql" and await bucket_column_kind(cur, table) == STORED:
        return BUCKET_COLUMN
    return row_bucket(dialect, profile)


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
    ``membership``, the node and bucket tables when missing, and the rows an existing bucket
    table lacks (:func:`missing_buckets`); for each of ``tables`` (created by
    an earlier step or already there, rows shaped as ``profile`` says, keyed by ``key``,
    default the profile's), the claim's index with the room bucket last where the bucket has a
    place in it (PostgreSQL: :func:`_pg_bucket_steps`; ``function_planned``: an earlier step of
    the same plan sees to the bucket function).

    MySQL/MariaDB: a table the same plan creates gets the STORED bucket column, last in its
    claim index; a table already there without one gets none, and the index without it (the
    claims compute the bucket on the row: :func:`read_row_bucket`). A column already there
    stays: processes of an earlier version read it. With it STORED the index must hold it (an
    earlier install's index without it is rebuilt); VIRTUAL (an earlier version's adoption),
    either index is left as it is."""
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
            steps.append((f"created table {BUCKET_TABLE}", (bucket_ddl(dialect), _insert_buckets(range(BUCKETS)))))
        else:
            missing = await missing_buckets(cur)
            if missing:  # a migrate stopped between the CREATE and the INSERT: those rooms had no owner
                steps.append(
                    (
                        f"added {len(missing)} missing row(s) to table {BUCKET_TABLE}",
                        (_insert_buckets(missing),),
                    )
                )
    if dialect.name == "postgresql":
        function = [] if function_planned else await _pg_function_steps(cur)
        return steps + function + await _pg_bucket_steps(cur, tables, existing, profile, key or profile.key)
    for table in tables:  # MySQL/MariaDB
        there = table.lower() in existing  # not there: created by an earlier step of the same plan
        kind = await bucket_column_kind(cur, table) if there else STORED
        if not there:
            steps.append(
                (
                    f"added column {table}.{BUCKET_COLUMN}",
                    (f"ALTER TABLE {table} ADD COLUMN {bucket_column(dialect, profile)}",),
                )
            )
        name, plain = claim_index(table, profile.lock, key or profile.key)
        with_bucket = claim_index(table, profile.lock, key or profile.key, BUCKET_COLUMN)[1]
        accepted = {STORED: [with_bucket], VIRTUAL: [plain, with_bucket], NO_COLUMN: [plain]}[kind]
        have = await _index_columns(cur, table, name) if there else []
        if have in [_columns_of(columns) for columns in accepted]:
            continue
        if not have:
            steps.append((f"added index {table}.{name}", add_index_sql(dialect, table, name, accepted[0])))
        else:
            rebuilt = f" with {BUCKET_COLUMN}" if accepted[0] == with_bucket else ""
            steps.append((f"rebuilt index {table}.{name}{rebuilt}", _rebuild_index(dialect, table, name, accepted[0])))
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
                f" bucket; drop it (DROP INDEX {await printed_name(cur, POSTGRESQL, table, name)}: it blocks"
                " the table's writes while it runs) and run"
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
