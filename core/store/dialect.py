"""What differs between the three databases, in one place: how a claim locks rows, how an
insert skips a duplicate, how the catalogue is read, which column types the DDL uses, and
what each store can and cannot do (its capabilities, checked at start-up).

Every statement of the shared code (claims, lanes, retention, operator queries) is written
once with ``%s`` placeholders and takes these pieces where the databases disagree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from room_outbox.envelope import TOO_LARGE

#: Capabilities a store may declare.
#: ``row_locks``: claimants on several hosts pass each other with ``FOR UPDATE SKIP LOCKED``
#: (SQLite serialises every writer instead: one host, one file).
#: ``plugin_schema``: plugins' ``room_outbox_migrations`` statements run here (they are
#: written in MySQL's dialect).
ROW_LOCKS = "row_locks"
PLUGIN_SCHEMA = "plugin_schema"


@dataclass(frozen=True)
class Dialect:
    name: str
    #: Appended to a claim's SELECT: how it takes rows without waiting for other claimants.
    row_lock: str
    #: Appended to a table name where MySQL needs the primary key forced (retention).
    primary_hint: str
    #: Appended to a table name where MySQL needs an index (``{index}``) forced: a claim
    #: limited to room buckets (its statistics sometimes lead the optimizer to read the
    #: claim's index range without checking the bucket in the index entries).
    index_hint: str
    #: Appended to the outbox table's name in a read of some statuses' rows: the hint that keeps
    #: it on an index starting with ``status`` (``{index}``); "": the dialect takes none. See
    #: room_outbox.store.by_status.
    status_index_hint: str
    #: ORDER BY's columns for a read of some statuses' rows in key order (``{key}``): see
    #: room_outbox.store.by_status.
    status_order: tuple[str, ...]
    #: SQL: the row's status is one of ``{quoted}`` (the statuses quoted, comma-separated) or,
    #: the same, of ``{bare}`` (unquoted), in such a read.
    status_in: str
    #: Run before such reads, for the rest of their transaction ("": nothing).
    status_read_setup: str
    #: Appended to CREATE TABLE.
    table_options: str
    #: Column type of ids taken from ``room_outbox.id``.
    id_type: str
    #: Ends an INSERT whose duplicate key is skipped; ``{key}`` is the conflicting column.
    on_duplicate_skip: str
    #: ``{column}`` contains the text bound to ``%s``, whatever the case of either (``requeue
    #: --error-contains``): both lowered, so the column's collation (case-insensitive or not)
    #: changes nothing. SQLite's ``lower`` folds ASCII letters only.
    contains: str
    #: Names of the tables of the current database.
    tables_sql: str
    #: Names of a table's (``%s``) columns, in their order.
    columns_sql: str
    #: Names of a table's (``%s``) indexes; PostgreSQL leaves out an invalid one (a
    #: ``CREATE INDEX CONCURRENTLY`` that was interrupted), which migrate drops and builds again.
    indexes_sql: str
    #: SQL: the database's clock, in epoch ms (one clock for every process that compares times).
    now_ms: str
    capabilities: frozenset[str]
    #: A locking scan locks each row it reads before checking the rest of its WHERE (InnoDB);
    #: PostgreSQL locks only the rows that pass.
    locks_before_filtering: bool = False
    #: A consistent read through a secondary index is slow on the index pages its own
    #: transaction has changed (InnoDB reads each entry's row there to see which version it
    #: may see): a per-room claim reads before it writes the results it carries, as its
    #: look-back reads the room index pages where those results move rows.
    slow_reads_after_own_writes: bool = False
    #: SQL: a row's room bucket computed on the row (``{app_code}``, ``{room_id}``: the row's
    #: columns or expressions; see room_outbox.store.membership). PostgreSQL's claim index holds
    #: the same expression; on MySQL/MariaDB a table ``migrate`` created holds it in a STORED
    #: column instead, which claims read there (room_outbox.store.schema.buckets.read_row_bucket).
    row_bucket: str = ""
    #: A UNION ALL of ``{first}``, a SELECT with its own ORDER BY … LIMIT, and ``{second}``:
    #: each in parentheses, which MySQL/MariaDB read without copying the first one's rows into
    #: a derived table first; SQLite takes no parentheses there.
    union_after_limit: str = "({first}) UNION ALL ({second})"
    #: Ends an ``ALTER TABLE … ADD COLUMN`` on a table already there: the algorithm that adds
    #: the column without copying the table (the server refuses the statement otherwise).
    online_column: str = ""
    #: Ends an ``ALTER TABLE … ADD INDEX`` on a table already there: built while writes go on.
    online_index: str = ""
    #: SQL: the next id the table ``{table}``'s key ``{key}`` will be given (NULL: unknown), and
    #: the highest id it holds; "": not read here.
    next_id_sql: str = ""
    #: SQL: the size in bytes of the text (or bytes) ``{value}``.
    octet_length: str = "octet_length({value})"
    #: SQL: the text ``{first}`` followed by ``{second}``.
    concat: str = "{first} || {second}"
    #: SQL: the one character of :data:`~room_outbox.envelope.ROW_COLUMNS_SEPARATOR`, as text
    #: (MySQL's CHAR() alone makes bytes).
    unit_separator: str = "chr(31)"

    @property
    def room_buckets(self) -> bool:
        """Whether the processes' membership and the room buckets live in this database: on a
        server (MySQL/MariaDB, PostgreSQL), where processes on several hosts claim side by side;
        not on SQLite (one host, one file)."""
        return ROW_LOCKS in self.capabilities

    def insert_skipping_duplicates(self, insert: str, key: str) -> str:
        return insert + self.on_duplicate_skip.format(key=key)

    def text_contains(self, column: str) -> str:
        return self.contains.format(column=column)

    def room_bucket(self, app_code: str = "app_code", room_id: str = "room_id") -> str:
        """SQL: the room bucket of a row whose app code and room are these columns (or expressions)."""
        return self.row_bucket.format(app_code=app_code, room_id=room_id)

    def joined_text(self, values: Sequence[str]) -> str:
        """SQL: the texts ``values`` joined by :attr:`unit_separator`, a NULL one read as ''
        (MySQL's CONCAT_WS would leave it out, shifting the rest)."""
        sql = f"COALESCE({values[0]}, '')"
        for value in values[1:]:
            sql = self.concat.format(
                first=self.concat.format(first=sql, second=self.unit_separator), second=f"COALESCE({value}, '')"
            )
        return sql

    def bounded_envelope(self, envelope: str, max_bytes: int, marker: str = "{}") -> str:
        """SQL: the envelope ``envelope`` (text or bytes) as read, or, when it is longer than
        ``max_bytes``, :data:`~room_outbox.envelope.TOO_LARGE` followed by its size (in the
        column's type: ``marker`` formats that text). One oversized row never reaches the
        process's memory, where its copies (the driver's, the parser's) would take several
        times its size, and it fails as that row's own error (see
        :func:`~room_outbox.envelope.parse_envelope`)."""
        size = self.octet_length.format(value=envelope)
        too_large = marker.format(self.concat.format(first=f"'{TOO_LARGE}'", second=size))
        return f"CASE WHEN {size} <= {int(max_bytes)} THEN {envelope} ELSE {too_large} END"


MYSQL = Dialect(
    name="mysql",
    row_lock=" FOR UPDATE SKIP LOCKED",
    primary_hint=" FORCE INDEX (PRIMARY)",
    index_hint=" FORCE INDEX ({index})",
    status_index_hint=" FORCE INDEX ({index})",
    status_order=("{key}",),
    status_in="status IN ({quoted})",
    status_read_setup="",
    table_options=" ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",
    id_type="BIGINT UNSIGNED",
    on_duplicate_skip=" ON DUPLICATE KEY UPDATE {key} = {key}",
    contains="INSTR(LOWER({column}), LOWER(%s)) > 0",
    tables_sql="SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()",
    columns_sql="SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE()"
    " AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
    indexes_sql="SELECT DISTINCT INDEX_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE()"
    " AND TABLE_NAME = %s",
    now_ms="CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)",
    capabilities=frozenset({ROW_LOCKS, PLUGIN_SCHEMA}),
    locks_before_filtering=True,
    slow_reads_after_own_writes=True,
    # 256: room_outbox.store.membership.BUCKETS; MOD(), not %, which the driver reads as a placeholder
    row_bucket="MOD(CRC32(CONCAT({app_code}, ':', {room_id})), 256)",
    online_column=", ALGORITHM=INSTANT",
    online_index=", ALGORITHM=INPLACE, LOCK=NONE",
    octet_length="LENGTH({value})",
    concat="CONCAT({first}, {second})",
    unit_separator="CHAR(31 USING utf8mb4)",
    next_id_sql="SELECT (SELECT AUTO_INCREMENT FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()"
    " AND TABLE_NAME = '{table}'), (SELECT MAX({key}) FROM {table})",
)

POSTGRESQL = Dialect(
    name="postgresql",
    row_lock=" FOR UPDATE SKIP LOCKED",
    primary_hint="",
    index_hint="",
    # An order only the (status, key) index holds (the statuses an array, never a constant
    # the planner drops from the order), no whole-table scan and no sort: the planner walks
    # that index's range and stops at the LIMIT, never the primary key's walk nor a scan of
    # every published row.
    status_index_hint="",
    status_order=("status", "{key}"),
    status_in="status = ANY('{{{bare}}}')",
    status_read_setup="SET LOCAL enable_seqscan = off",
    table_options="",
    id_type="BIGINT",
    on_duplicate_skip=" ON CONFLICT ({key}) DO NOTHING",
    contains="strpos(lower({column}), lower(%s)) > 0",
    tables_sql="SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()",
    columns_sql="SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
    " AND table_name = %s ORDER BY ordinal_position",
    indexes_sql="SELECT ix.relname FROM pg_index i JOIN pg_class ix ON ix.oid = i.indexrelid"
    " JOIN pg_class t ON t.oid = i.indrelid JOIN pg_namespace n ON n.oid = t.relnamespace"
    " WHERE n.nspname = current_schema() AND t.relname = %s AND i.indisvalid",
    now_ms="CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS BIGINT)",
    capabilities=frozenset({ROW_LOCKS}),
    # 256: room_outbox.store.membership.BUCKETS; mod(), not %, which psycopg reads as a placeholder
    row_bucket="mod(room_outbox_crc32({app_code} || ':' || {room_id}), 256)",
    next_id_sql="SELECT pg_sequence_last_value(pg_get_serial_sequence('{table}', '{key}')::regclass) + 1,"
    " (SELECT MAX({key}) FROM {table})",
)

SQLITE = Dialect(
    name="sqlite",
    # BEGIN IMMEDIATE already serialises every writer (see room_outbox.store.backends.sqlite).
    row_lock="",
    primary_hint="",
    index_hint="",
    # SQLite's planner, once ANALYZE has counted few statuses, scans the table instead.
    status_index_hint=" INDEXED BY {index}",
    status_order=("{key}",),
    status_in="status IN ({quoted})",
    status_read_setup="",
    table_options="",
    id_type="INTEGER",
    on_duplicate_skip=" ON CONFLICT ({key}) DO NOTHING",
    contains="instr(lower({column}), lower(%s)) > 0",
    tables_sql="SELECT name FROM sqlite_master WHERE type = 'table'",
    columns_sql="SELECT name FROM pragma_table_info(%s) ORDER BY cid",
    indexes_sql="SELECT name FROM pragma_index_list(%s)",
    now_ms="CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)",
    capabilities=frozenset(),
    union_after_limit="SELECT * FROM ({first}) AS first UNION ALL {second}",
    octet_length="length(CAST({value} AS BLOB))",  # length() of text counts characters
    unit_separator="char(31)",
)


async def table_names(cur: Any, dialect: Dialect) -> set[str]:
    await cur.execute(dialect.tables_sql)
    return {str(row[0]).lower() for row in await cur.fetchall()}


async def column_names(cur: Any, dialect: Dialect, table: str) -> list[str]:
    await cur.execute(dialect.columns_sql, (table,))
    return [str(row[0]).lower() for row in await cur.fetchall()]


class IndexNames(frozenset[str]):
    """A table's index names, in lower case, where ``in`` ignores case: the index names
    room-outbox expects carry the table's name as configured (``idx_RoomOutbox_room``), while
    MySQL/MariaDB and SQLite compare index names case-insensitively and PostgreSQL folds the
    unquoted ones to lower case."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())


async def index_names(cur: Any, dialect: Dialect, table: str) -> IndexNames:
    await cur.execute(dialect.indexes_sql, (table,))
    return IndexNames(str(row[0]).lower() for row in await cur.fetchall())


def marks(values: Sequence[object]) -> str:
    return ", ".join(["%s"] * len(values))


#: Row keys one statement's ``IN`` list holds at most. The operator commands change up to
#: 10,000 rows by key: in one statement those keys could pass a MySQL server's
#: ``max_allowed_packet``, and the whole command failed, having changed nothing. A thousand
#: keys, of twenty digits at most, keep a statement well within a 64 kB packet.
KEYS_PER_STATEMENT = 1000

T = TypeVar("T")


def key_chunks(keys: Sequence[T], size: int = KEYS_PER_STATEMENT) -> Iterator[list[T]]:
    """``keys`` in lists of at most ``size``, in order: one statement's ``IN`` list each."""
    for first in range(0, len(keys), size):
        yield list(keys[first : first + size])


def text(value: Any) -> str:
    """A string column's value as ``str``: MySQL drivers return binary strings (a BLOB
    envelope, ``GROUP_CONCAT`` of numbers) as bytes."""
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


def ascii_text(value: str) -> str:
    """``value`` in ASCII, its other characters escaped as Python writes them (``\\u7fa4``):
    what a text column holds whatever its character set (room-service's table may be in
    latin1), and still readable."""
    return value.encode("ascii", "backslashreplace").decode("ascii")
