"""Live nodes and room buckets in the database every process already shares (MySQL/MariaDB
and PostgreSQL).

Every room hashes to one of :data:`BUCKETS` buckets (:func:`bucket_of`, and the same function
in SQL: :func:`bucket_sql`); every bucket has one owner among the live nodes. With per-room
ordering a process claims only the rows of its own buckets, so two processes never compete
for one room: claims never collide and a room's events go out from one process, in order.

Tables (created by ``room-outbox migrate``):

* ``room_outbox_node``: one row per running ``room-outbox run``, its ``heartbeat_ms`` renewed
  every heartbeat; a node whose heartbeat is older than the node timeout is dead. ``view`` is
  the set of live nodes the node applies to its quota share right now, ``view_since_ms`` when
  it started to (see :mod:`room_outbox.cluster.quota`).
* ``room_outbox_bucket``: one row per bucket: ``owner`` (NULL: nobody), ``handing_over``
  (1: the owner waits for every other process's leases on the bucket to end) and
  ``claimable_from_ms``. The owner claims the bucket's rows only when ``handing_over`` is 0 and
  ``claimable_from_ms`` has come.
* the column ``room_bucket`` in ``room_outbox`` and in every lane table (MySQL/MariaDB): the
  bucket of the row's room, a generated column (room-service's INSERT does not know it exists), and the last
  column of the claim's index ``(status, lock_until_ms, id, room_bucket)``. The claim reads the
  same index range as without buckets, in the same order (MySQL/MariaDB: the index forced).
  On MySQL/MariaDB the column is VIRTUAL in a table that was already there (room-service's
  live table): added instantly, where a STORED one would copy the table with every write
  blocked. The price: both servers check a virtual column's condition on the row only, so the
  claim reads from the table the rows of other processes' buckets it passes over (with three
  equal processes about three rows per row taken). In a table ``migrate`` creates it is
  STORED, free on an empty table: the claim passes over other buckets' entries in the index
  itself (index condition pushdown) and reads only the rows it takes. A column already there
  stays as it is. PostgreSQL has no such column (adding a generated one rewrites the table
  under a lock that blocks even reads): the claim's index ends with the bucket's expression,
  which claims and the fence compute (:func:`row_bucket`). It has no CRC-32 either: the
  bucket is computed by the function
  ``room_outbox_crc32`` that ``migrate`` creates; its planner keeps an ``IN`` list on the
  index's last column as a filter on the row, to keep the index order, so a
  claim there computes the function for every row it passes over.

**Fencing.** A claim reads its node's buckets with a shared lock in its own
transaction, and a reassignment updates the bucket rows: so once a reassignment has
committed, the former owner's claims can no longer take the bucket's rows, and every lease
it took before is visible. A bucket none of whose rows is leased when the reassignment reads
the leases (under the bucket rows' locks) moves at once: claimable one rate-limit window
later. Otherwise the new owner starts with ``handing_over`` = 1 and checks, each
heartbeat, whether any row of the bucket is still leased (``worker_id`` set and
``lock_until_ms`` in the future, in any lane's table); once none is, the bucket becomes
claimable one rate-limit window later (so the group's last requests from the former owner
have left Tencent's one-second window too). A killed owner's leases simply run out; a
gracefully stopped one has written its results and left no lease.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import POSTGRESQL, Dialect, column_names, table_names
from room_outbox.store.dialect import marks as _marks
from room_outbox.store.schema.buckets import BUCKET_COLUMN, BUCKET_TABLE, NODE_TABLE
from room_outbox.store.schema.outbox import add_column_sql, add_index_sql, claim_index
from room_outbox.store.schema.profiles import V1, Profile

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


def node_ddl(dialect: Dialect) -> str:
    return f"""CREATE TABLE IF NOT EXISTS {NODE_TABLE} (
  node_id       VARCHAR(128) NOT NULL PRIMARY KEY,
  heartbeat_ms  BIGINT       NOT NULL,
  joined_ms     BIGINT       NOT NULL,
  view          VARCHAR(64)  NOT NULL DEFAULT '',
  view_since_ms BIGINT       NOT NULL DEFAULT 0
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


def bucket_key(app_code: str, room_id: str) -> bytes:
    """What the bucket hashes: ``app_code:room_id`` in UTF-8 (a room is per app)."""
    return f"{app_code}:{room_id}".encode()


def bucket_of(app_code: str, room_id: str) -> int:
    """The room's bucket: CRC-32 (IEEE, as zlib and MySQL's ``CRC32()`` compute it) of
    :func:`bucket_key`, modulo :data:`BUCKETS`. Stable across processes, hosts and Python runs
    (unlike ``hash()``), and the same as the database computes."""
    return zlib.crc32(bucket_key(app_code, room_id)) % BUCKETS


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
) -> list[tuple[str, tuple[str, ...]]]:
    """What a migration adds (``(change, statements)`` steps, MySQL/MariaDB or PostgreSQL): with
    ``membership``, the node and bucket tables when missing; for each of ``tables`` (created by
    an earlier step or already there, rows shaped as ``profile`` says, keyed by ``key``,
    default the profile's), its bucket column when missing and the claim's index with the
    bucket last (an earlier install's index without it is rebuilt; PostgreSQL:
    :func:`_pg_bucket_steps`). A column already there stays as it is, STORED or VIRTUAL."""
    steps: list[tuple[str, tuple[str, ...]]] = []
    existing = await table_names(cur, dialect)
    if membership:
        if NODE_TABLE not in existing:
            steps.append((f"created table {NODE_TABLE}", (node_ddl(dialect),)))
        if BUCKET_TABLE not in existing:
            rows = ", ".join(f"({bucket}, NULL, 0)" for bucket in range(BUCKETS))
            insert = f"INSERT INTO {BUCKET_TABLE} (bucket, owner, updated_at_ms) VALUES {rows}"
            steps.append((f"created table {BUCKET_TABLE}", (bucket_ddl(dialect), insert)))
    if dialect.name == "postgresql":
        return steps + await _pg_bucket_steps(cur, tables, existing, profile, key or profile.key)
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
            steps.append((f"added index {table}.{name}", (add_index_sql(dialect, table, name, columns),)))
        else:
            steps.append(
                (f"rebuilt index {table}.{name} with {BUCKET_COLUMN}", _rebuild_index(dialect, table, name, columns))
            )
    return steps


async def _pg_bucket_steps(
    cur: Any, tables: Sequence[str], existing: set[str], profile: Profile, key: str
) -> list[tuple[str, tuple[str, ...]]]:
    """PostgreSQL: the CRC-32 function when missing, and on each table the claim's index with
    the bucket expression last, built ``CONCURRENTLY`` (writes go on meanwhile). No column:
    adding a generated one rewrites the whole table under a lock that blocks even reads. An
    earlier install's index (the bucket column last, or no bucket) is replaced under its name:
    the new index is built beside it, the old one dropped, the new one renamed, each without
    blocking writes, and a rerun takes up where an interrupted one stopped. The earlier
    install's column stays (dropping it would break processes still running the old version)."""
    steps: list[tuple[str, tuple[str, ...]]] = []
    await cur.execute("SELECT prosrc FROM pg_proc WHERE proname = %s", (PG_CRC32_FUNCTION,))
    function = await cur.fetchone()
    if function is None:
        steps.append((f"created function {PG_CRC32_FUNCTION}", (PG_CRC32_DDL.strip(),)))
    elif function[0] != PG_CRC32_DDL.split("$$")[1]:  # an earlier version: same results, slower
        steps.append((f"replaced function {PG_CRC32_FUNCTION} (same results, faster)", (PG_CRC32_DDL.strip(),)))
    for table in tables:
        name, columns = claim_index(table, profile.lock, key, f"({row_bucket(POSTGRESQL, profile)})")
        indexes = await _pg_index_definitions(cur, table) if table.lower() in existing else {}
        current, beside = indexes.get(name), f"{name}_next"
        build = f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {{name}} ON {table} {columns}"
        if current is not None and PG_CRC32_FUNCTION in current:
            continue
        if current is None and beside not in indexes:
            steps.append((f"added index {table}.{name}", (build.format(name=name),)))
            continue
        replace = (build.format(name=beside), f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
        steps.append(
            (f"rebuilt index {table}.{name} with the room bucket", (*replace, f"ALTER INDEX {beside} RENAME TO {name}"))
        )
    return steps


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


async def claimable_buckets(cur: Any, dialect: Dialect, node_id: str) -> list[int]:
    """The buckets ``node_id`` may claim now, read with a shared lock: a reassignment of any of
    them waits until this transaction ends (the fence, see the module docstring)."""
    await cur.execute(
        f"SELECT bucket FROM {BUCKET_TABLE} WHERE owner = %s AND handing_over = 0 AND claimable_from_ms <= %s"
        " ORDER BY bucket" + (" LOCK IN SHARE MODE" if dialect.name == "mysql" else " FOR SHARE"),
        (node_id, now_ms()),
    )
    return [int(row[0]) for row in await cur.fetchall()]


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    heartbeat_ms: int
    joined_ms: int
    view: str
    view_since_ms: int


@dataclass(frozen=True)
class BucketRow:
    bucket: int
    owner: str | None
    handing_over: bool
    claimable_from_ms: int


async def heartbeat(cur: Any, dialect: Dialect, node_id: str, view: str, view_since_ms: int) -> None:
    now = now_ms()
    if dialect.name == "mysql":
        update = " ON DUPLICATE KEY UPDATE heartbeat_ms = VALUES(heartbeat_ms), view = VALUES(view),"
        update += " view_since_ms = VALUES(view_since_ms)"
    else:
        update = " ON CONFLICT (node_id) DO UPDATE SET heartbeat_ms = EXCLUDED.heartbeat_ms, view = EXCLUDED.view,"
        update += " view_since_ms = EXCLUDED.view_since_ms"
    await cur.execute(
        f"INSERT INTO {NODE_TABLE} (node_id, heartbeat_ms, joined_ms, view, view_since_ms) VALUES (%s, %s, %s, %s, %s)"
        + update,
        (node_id, now, now, view, view_since_ms),
    )


async def read_nodes(cur: Any) -> list[NodeRow]:
    await cur.execute(f"SELECT node_id, heartbeat_ms, joined_ms, view, view_since_ms FROM {NODE_TABLE}")
    return [NodeRow(str(r[0]), int(r[1]), int(r[2]), str(r[3]), int(r[4])) for r in await cur.fetchall()]


async def read_buckets(cur: Any, lock: bool = False) -> list[BucketRow]:
    await cur.execute(
        f"SELECT bucket, owner, handing_over, claimable_from_ms FROM {BUCKET_TABLE} ORDER BY bucket"
        + (" FOR UPDATE" if lock else "")
    )
    return [BucketRow(int(r[0]), r[1], bool(r[2]), int(r[3])) for r in await cur.fetchall()]


async def assign(cur: Any, moves: dict[int, str], unleased: Collection[int] = (), delay_ms: int = 0) -> None:
    """Give buckets new owners (the caller holds the bucket rows' locks). A bucket in
    ``unleased`` (no row leased in it, read under those locks: no claim of the former owner
    can take one any more) needs no handover: claimable ``delay_ms`` from now. The others start
    with ``handing_over``: the new owner waits for their leases to end."""
    groups: dict[tuple[str, bool], list[int]] = {}
    for bucket, owner in moves.items():
        groups.setdefault((owner, bucket in unleased), []).append(bucket)
    for (owner, free), buckets in sorted(groups.items()):
        await cur.execute(
            f"UPDATE {BUCKET_TABLE} SET owner = %s, handing_over = %s, claimable_from_ms = %s, updated_at_ms = %s"
            f" WHERE bucket IN ({_marks(buckets)})",
            (owner, 0 if free else 1, now_ms() + delay_ms if free else 0, now_ms(), *sorted(buckets)),
        )


async def still_leased(
    cur: Any, dialect: Dialect, tables: Iterable[tuple[str, Profile]], buckets: Sequence[int]
) -> set[int]:
    """Of ``buckets``, those with a row leased right now in any of ``tables`` (each with the
    profile its rows are shaped by: an open row a claim holds until a time to come)."""
    if not buckets:
        return set()
    leased: set[int] = set()
    for table, p in tables:
        bucket = row_bucket(dialect, p)
        await cur.execute(
            f"SELECT DISTINCT {bucket} FROM {table} WHERE {p.is_open()} AND {p.lock} > {p.ms('%s')}"
            f" AND {bucket} IN ({_marks(buckets)}) AND worker_id IS NOT NULL",
            (now_ms(), *buckets),
        )
        leased.update(int(row[0]) for row in await cur.fetchall())
    return leased


async def open_buckets(cur: Any, node_id: str, buckets: Sequence[int], delay_ms: int) -> None:
    """End the handover of ``buckets`` (still owned by ``node_id``): claimable after ``delay_ms``."""
    if buckets:
        await cur.execute(
            f"UPDATE {BUCKET_TABLE} SET handing_over = 0, claimable_from_ms = %s, updated_at_ms = %s"
            f" WHERE owner = %s AND handing_over = 1 AND bucket IN ({_marks(buckets)})",
            (now_ms() + delay_ms, now_ms(), node_id, *buckets),
        )


async def leave(cur: Any, node_id: str) -> None:
    """A graceful stop: give up every bucket and the node row (the caller has written its
    results, so it leaves no lease behind)."""
    await cur.execute(
        f"UPDATE {BUCKET_TABLE} SET owner = NULL, handing_over = 0, updated_at_ms = %s WHERE owner = %s",
        (now_ms(), node_id),
    )
    await cur.execute(f"DELETE FROM {NODE_TABLE} WHERE node_id = %s", (node_id,))


async def forget_nodes(cur: Any, node_ids: Sequence[str]) -> None:
    """Drop the rows of dead nodes (their buckets were reassigned in the same transaction)."""
    if node_ids:
        await cur.execute(f"DELETE FROM {NODE_TABLE} WHERE node_id IN ({_marks(node_ids)})", tuple(node_ids))
