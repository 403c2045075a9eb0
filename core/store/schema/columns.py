"""Can the outbox table's columns hold what room-outbox writes? ``migrate`` (before it changes
anything) and ``run`` (before any claim) ask the same question here, so they agree.

Tables written from room-service's documents differ from the one ``migrate`` creates
(:func:`column_problems` lists how). Each problem is one line: the column, what is wrong, the
fix; what ``migrate`` can fix online it fixes (:func:`column_fixes`). SQLite is left alone (its
columns hold any value). Steps of a migration are :data:`Step` tuples, which the plan in
:mod:`.tables` turns into its migrations (this module stays below it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from room_outbox.errors import SchemaError
from room_outbox.store.dialect import Dialect, IndexNames, index_names

if TYPE_CHECKING:
    from room_outbox.store.schema.profiles import Profile

#: The longest error text a result writes into ``last_error`` (longer ones are cut).
LAST_ERROR_MAX = 512

#: A migration step: what it changes, its statements, whether it repeats until it changes no
#: row (a backfill in batches).
Step = tuple[str, tuple[str, ...], bool]
#: Rows one batch of a backfill changes: short transactions, short row locks.
BACKFILL_BATCH = 5000

#: Columns room-service's first V1 tables lack, added with constant defaults (no rewrite).
ADOPTED_COLUMNS: dict[str, dict[str, str]] = {
    "mysql": {"app_code": "VARCHAR(64) NOT NULL DEFAULT ''", "updated_at_ms": "BIGINT NOT NULL DEFAULT 0"},
    "postgresql": {"app_code": "VARCHAR(64) NOT NULL DEFAULT ''", "updated_at_ms": "BIGINT NOT NULL DEFAULT 0"},
    "sqlite": {"app_code": "TEXT NOT NULL DEFAULT ''", "updated_at_ms": "INTEGER NOT NULL DEFAULT 0"},
}

_INTEGERS = {"tinyint", "smallint", "mediumint", "int", "integer", "bigint", "int2", "int4", "int8"}
_WIDE_INTEGERS = {"bigint", "int8"}
_TEXTS = {"char", "varchar", "character", "character varying", "bpchar", "text", "tinytext", "mediumtext", "longtext"}


@dataclass(frozen=True)
class Column:
    """One column as the catalogue describes it."""

    name: str
    #: The type's name, lower case: ``varchar``, ``enum``, ``bigint``, ``user-defined``...
    kind: str
    #: The full declaration (MySQL's ``COLUMN_TYPE``, PostgreSQL's type name): for the fixes.
    declared: str
    nullable: bool
    #: Characters a text column holds (None: unbounded or not text).
    length: int | None
    #: An ENUM's members, in order.
    members: tuple[str, ...] = ()
    default: str | None = None
    #: Computed from other columns (MySQL/MariaDB: a table with one is rebuilt by a copy).
    generated: bool = False
    #: What a MySQL/MariaDB ``MODIFY`` must say again to keep them: the character set and
    #: collation of a text column (a change of either copies the table) and the comment.
    charset: str | None = None
    collation: str | None = None
    comment: str = ""
    #: A view's column: whether it can hold NULL, the catalogue does not say (PostgreSQL calls
    #: every one nullable).
    in_view: bool = False
    #: Filled by the server when an INSERT leaves it out, without a default: AUTO_INCREMENT, an
    #: identity or a generated column.
    filled: bool = False


def compares_exactly(column: Column) -> bool:
    """Whether a MySQL/MariaDB text column tells apart values that differ only in letter case:
    a binary collation (``…_bin``, or ``binary`` bytes) or a case-sensitive one (``…_cs``). Not
    text (no collation): yes."""
    collation = (column.collation or "binary").lower()
    return collation == "binary" or collation.endswith(("_bin", "_cs"))


def inexact_note(table: str, columns: Sequence[Column], kept: str, fix: str) -> str:
    """The warning about ``table``'s key ``columns`` that do not compare exactly: events whose
    ids differ only in letter case are taken for one, the second not ``kept``; ``fix``: the
    statement, which copies the table."""
    names = ", ".join(f"{column.name} ({column.collation})" for column in columns)
    return (
        f"{table} compares {names} ignoring letter case: of two events whose ids differ only so, the"
        f" second is taken for the first and not {kept}; to tell them apart run {fix} (MySQL and MariaDB"
        " change a key column's collation only by copying the table, writes blocked meanwhile, so the"
        " consumers wait: on a large table, plan it or use pt-online-schema-change)"
    )


def adoption_plan(columns: set[str], dialect: Dialect, table: str) -> list[Step]:
    """Add what room-service's first V1 tables lack (``app_code``, ``updated_at_ms``) to an
    existing table, with constant defaults (catalogue-only changes): the producer's INSERT,
    which names neither, keeps working. room-outbox only writes ``updated_at_ms`` (nothing
    decides by it); ages are read from ``created_at_ms``, which those tables have."""
    if not columns:
        return []
    return [
        (
            f"added column {table}.{name}",
            (f"ALTER TABLE {table} ADD COLUMN {name} {definition}{dialect.online_column}",),
            False,
        )
        for name, definition in ADOPTED_COLUMNS[dialect.name].items()
        if name not in columns
    ]


async def read_columns(cur: Any, dialect: Dialect, table: str) -> dict[str, Column]:
    """The table's columns with their types (empty on SQLite and for a missing table)."""
    if dialect.name == "mysql":
        await cur.execute(_MYSQL_COLUMNS, (table,))
        return {c.name: c for c in map(_mysql_column, await cur.fetchall())}
    if dialect.name == "postgresql":
        await cur.execute(_POSTGRESQL_COLUMNS, (table,))
        return {c.name: c for c in map(_postgresql_column, await cur.fetchall())}
    return {}


async def printed_name(cur: Any, dialect: Dialect, table: str, name: str = "") -> str:
    """``name`` (``table`` itself by default, or one of its indexes) as a statement printed for
    an operator to run names it. On PostgreSQL with ``table``'s schema (quoted where needed):
    the sessions' search path is the DSN's, and the operator's psql session has its own, where
    an unqualified name finds nothing or another schema's table. Elsewhere as it is."""
    if dialect.name != "postgresql":
        return name or table
    await cur.execute(
        "SELECT quote_ident(COALESCE((SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.oid = to_regclass(%s)), current_schema()))",
        (table,),
    )
    row = await cur.fetchone()
    return f"{row[0]}.{name or table}" if row and row[0] else name or table


_MYSQL_COLUMNS = (
    "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE, IS_NULLABLE, CHARACTER_MAXIMUM_LENGTH, COLUMN_DEFAULT,"
    " GENERATION_EXPRESSION, CHARACTER_SET_NAME, COLLATION_NAME, COLUMN_COMMENT, EXTRA,"
    " (SELECT t.TABLE_TYPE = 'VIEW' FROM information_schema.TABLES t"
    "  WHERE t.TABLE_SCHEMA = c.TABLE_SCHEMA AND t.TABLE_NAME = c.TABLE_NAME)"
    " FROM information_schema.COLUMNS c WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s"
)
_POSTGRESQL_COLUMNS = (
    # A type of the database's own (an ENUM) by its schema too: the fixes name it (printed_name)
    "SELECT c.column_name, c.data_type,"
    " CASE WHEN c.data_type = 'USER-DEFINED' THEN quote_ident(c.udt_schema) || '.' || quote_ident(c.udt_name)"
    " ELSE c.udt_name END, c.is_nullable, c.character_maximum_length, c.column_default,"
    " (SELECT array_agg(e.enumlabel::text ORDER BY e.enumsortorder) FROM pg_enum e"
    "  JOIN pg_type t ON t.oid = e.enumtypid JOIN pg_namespace n ON n.oid = t.typnamespace"
    "  WHERE t.typname = c.udt_name AND n.nspname = c.udt_schema)"
    " , c.is_identity = 'YES' OR c.is_generated = 'ALWAYS'"
    " , (SELECT t.table_type = 'VIEW' FROM information_schema.tables t"
    "  WHERE t.table_schema = c.table_schema AND t.table_name = c.table_name)"
    " FROM information_schema.columns c WHERE c.table_schema = current_schema() AND c.table_name = %s"
)


def _mysql_column(row: Sequence[Any]) -> Column:
    name, kind, declared, nullable, length, default, expression, charset, collation, comment, extra, view = (
        v.decode() if isinstance(v, bytes) else v for v in row
    )
    kind = str(kind).lower()
    members = tuple(m.replace("''", "'") for m in re.findall(r"'((?:[^']|'')*)'", declared)) if kind == "enum" else ()
    column = Column(str(name).lower(), kind, str(declared), nullable == "YES", _int(length), members, default)
    return dataclasses.replace(
        column,
        generated=bool(expression),
        charset=charset,
        collation=collation,
        comment=comment or "",
        in_view=bool(view),
        filled=bool(expression) or "auto_increment" in str(extra).lower(),
    )


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _postgresql_column(row: Sequence[Any]) -> Column:
    name, kind, udt, nullable, length, default, labels, filled, view = row
    declared = f"{udt}({length})" if length else udt
    column = Column(name.lower(), kind.lower(), declared, nullable == "YES", _int(length), tuple(labels or ()), default)
    return dataclasses.replace(column, in_view=bool(view), filled=bool(filled))


def column_problems(
    columns: dict[str, Column], profile: Profile, dialect: Dialect, claim_ids: int = 0, named: str = ""
) -> tuple[list[str], list[str]]:
    """What the profile's table cannot hold: lines refused outright, and lines ``migrate``
    fixes itself (:func:`column_fixes`). Columns that do not exist are the caller's to report.
    ``claim_ids``: how long the process's claim ids, which ``worker_id`` holds, may grow (0:
    unknown, not checked).

    * a ``status`` ENUM of the producer's own words, or a short VARCHAR: a parked or cancelled
      row would be refused by the database. Refused, with the ALTER that makes room;
    * a nullable ``lock_until_ms`` or ``app_code`` that the producer leaves NULL
      (:func:`_nullable_values`): such rows would never be delivered. Fixed online on
      MySQL/MariaDB; on PostgreSQL refused with the statements to run;
    * ``last_error``, ``worker_id`` too short or NOT NULL, times or keys that are not integers
      wide enough (timestamps, for a profile that keeps them so: ``timestamptz``, or ``timestamp``
      taken in the database's zone, :func:`wall_time_columns`), a column the envelope takes as
      JSON that is not json or jsonb: refused, with the fix.

    ``named``: the table as the fixes' statements name it (:func:`printed_name`)."""
    table = profile.table
    target = named or table
    refused: list[str] = []
    fixable: list[str] = []
    status = columns.get("status")
    if status is not None:
        refused += _status_problems(table, status, _statuses(profile), dialect, target)
    last_error = columns.get("last_error")
    if last_error is not None:
        refused += _text_problems(table, last_error, LAST_ERROR_MAX, dialect, "error texts", target)
    worker = columns.get("worker_id")
    if worker is not None:
        refused += _text_problems(
            table, worker, claim_ids, dialect, f"this process's claim ids ({claim_ids} characters)", target
        )
    if profile.ms_columns:
        for name in (profile.lock, profile.updated):
            column = columns.get(name)
            if column is not None and column.kind not in _WIDE_INTEGERS:
                refused.append(
                    f"{table}.{name} is {column.declared}, which cannot hold epoch milliseconds:"
                    f" run ALTER TABLE {target} {_retype(dialect, name, 'BIGINT', not column.nullable)}"
                )
    else:
        for name in (profile.lock, profile.updated, profile.created):
            column = columns.get(name)
            if column is not None and not column.kind.startswith("timestamp"):
                refused.append(
                    f"{table}.{name} is {column.declared}, which room-outbox compares with timestamps: run ALTER"
                    f" TABLE {target} ALTER COLUMN {name} TYPE timestamptz USING (its values as timestamps)"
                )
    for name in profile.json_columns:
        column = columns.get(name)
        if column is not None and column.kind not in ("json", "jsonb"):
            values = f"convert_from({name}, 'UTF8')::jsonb" if column.kind == "bytea" else f"{name}::jsonb"
            refused.append(
                f"{table}.{name} is {column.declared}: the envelope takes it as a JSON value, and from a"
                f" {column.declared} column every row would fail as a malformed envelope: run ALTER TABLE"
                f" {target} ALTER COLUMN {name} TYPE jsonb USING {values} (it rewrites the table under an"
                " exclusive lock: on a live table, plan it)"
            )
    for value in _nullable_values(columns, profile):
        name, empty = value.column.name, value.empty
        line = f"{table}.{name} is nullable, and {value.why}"
        if _fixed_online(columns, dialect):
            fixable.append(f"{line}: run `room-outbox migrate`, which backfills {empty} and makes it NOT NULL online")
        elif dialect.name == "mysql":
            refused.append(
                f"{line}; the table's generated columns make NOT NULL a copy of the table, so migrate leaves it:"
                f" set it to {empty} where NULL (in batches), then ALTER TABLE {target} MODIFY"
                f" {_not_null_declaration(value)} with gh-ost or pt-online-schema-change"
            )
        else:
            # Online on PostgreSQL: the default first (catalogue only), NULLs set in short
            # batches, then NOT NULL through a check validated without blocking writes (SET NOT
            # NULL alone scans the table under an exclusive lock).
            check = f"{name}_not_null"
            refused.append(
                f"{line}: run ALTER TABLE {target} ALTER COLUMN {name} SET DEFAULT {empty}; then, until it changes"
                f" no row, UPDATE {target} SET {name} = {empty} WHERE ctid IN (SELECT ctid FROM {target} WHERE"
                f" {name} IS NULL LIMIT {BACKFILL_BATCH}); then ALTER TABLE {target} ADD CONSTRAINT {check}"
                f" CHECK ({name} IS NOT NULL) NOT VALID; ALTER TABLE {target} VALIDATE CONSTRAINT {check};"
                f" ALTER TABLE {target} ALTER COLUMN {name} SET NOT NULL, DROP CONSTRAINT {check}"
            )
    for name in (profile.key, profile.attempts):
        column = columns.get(name)
        if column is not None and column.kind not in _INTEGERS:
            refused.append(f"{table}.{name} is {column.declared}: room-outbox needs an integer there")
    return refused, fixable


#: PostgreSQL's ``timestamp`` (without time zone), as the catalogue names it.
WALL_TIME = "timestamp without time zone"


def wall_time_columns(columns: dict[str, Column], profile: Profile) -> list[str]:
    """The profile's time columns that are ``timestamp`` without time zone (what GORM makes of a
    ``time.Time`` on some set-ups): wall times, an instant only in the zone their writers take
    them in. They are taken in the database's (see ``PostgresStore.read_column_types``)."""
    if profile.ms_columns:
        return []
    names = (profile.created, profile.updated, profile.lock)
    return [name for name in names if name in columns and columns[name].kind == WALL_TIME]


def _statuses(profile: Profile) -> tuple[str, ...]:
    """Every status word room-outbox writes (or the producer's it compares with)."""
    p = profile
    return tuple(dict.fromkeys((p.fresh, p.retry, p.in_flight, p.delivered, p.parked, p.cancelled)))


def _status_problems(table: str, column: Column, words: tuple[str, ...], dialect: Dialect, target: str) -> list[str]:
    """``target``: the table as the fix names it (:func:`printed_name`); an ENUM's type comes
    named so from :func:`read_columns`."""
    if column.members:
        missing = [w for w in words if w not in column.members]
        if not missing:
            return []
        quoted = ", ".join(f"'{w}'" for w in missing)
        if dialect.name == "postgresql":
            fix = "; ".join(f"ALTER TYPE {column.declared} ADD VALUE '{w}'" for w in missing)
        else:
            members = ",".join(f"'{m}'" for m in (*column.members, *missing))
            fix = f"ALTER TABLE {target} {_retype(dialect, 'status', f'ENUM({members})', not column.nullable, column)}"
        return [f"{table}.status is an ENUM without {quoted}, statuses room-outbox writes: run {fix}"]
    longest = max(words, key=len)
    return _text_problems(table, column, len(longest), dialect, f"its statuses ('{longest}')", target)


#: What a text column the fixes retype becomes (longer where more is needed).
_PREFERRED_LENGTH = {"status": 16, "last_error": 1024, "worker_id": 128}
#: Columns room-outbox sets to NULL: a result clears the error, a released row its claim.
_CLEARED = ("last_error", "worker_id")


def _text_problems(table: str, column: Column, needed: int, dialect: Dialect, what: str, target: str) -> list[str]:
    """A text column room-outbox writes up to ``needed`` characters into (and NULL, for
    :data:`_CLEARED`); ``target``: the table as the fix names it (:func:`printed_name`)."""
    cleared = column.name in _CLEARED
    not_text = column.kind not in _TEXTS
    short = not not_text and column.length is not None and column.length < needed
    if not_text or short:
        problem = f"is {column.declared}, which cannot hold {what}"
        length = max(needed, _PREFERRED_LENGTH.get(column.name, 0))
        fix = _retype(dialect, column.name, f"VARCHAR({length})", not column.nullable and not cleared, column)
    elif cleared and not column.nullable:
        problem = "is NOT NULL, and room-outbox sets it to NULL"
        if dialect.name == "postgresql":
            fix = f"ALTER COLUMN {column.name} DROP NOT NULL"
        else:
            fix = _retype(dialect, column.name, column.declared, False, column)
    else:
        return []
    return [f"{table}.{column.name} {problem}: run ALTER TABLE {target} {fix}"]


def _retype(dialect: Dialect, name: str, new_type: str, not_null: bool, column: Column | None = None) -> str:
    """The ALTER TABLE clause giving column ``name`` a new type, keeping its default."""
    if dialect.name == "postgresql":
        return f"ALTER COLUMN {name} TYPE {new_type}"
    default = _default_sql(column) if column is not None else ""
    return f"MODIFY {name} {new_type}{' NOT NULL' if not_null else ' NULL'}{default}"


def _default_sql(column: Column) -> str:
    """`` DEFAULT …`` as the column has it (MariaDB's catalogue quotes text defaults, MySQL's
    does not)."""
    value = column.default
    if value is None or value == "NULL":
        return ""
    if not value.startswith("'") and (column.kind in _TEXTS or column.kind == "enum"):
        value = "'" + value.replace("'", "''") + "'"
    return f" DEFAULT {value}"


#: The temporary index a backfill of NULLs reads (``{table}``, ``{column}``).
BACKFILL_INDEX = "idx_{table}_{column}_null"


@dataclass(frozen=True)
class _NullableValue:
    """A nullable column room-outbox reads as a value, and what NULL does there."""

    column: Column
    #: What NULL stands for (SQL): the value a backfill writes and the column's default after.
    empty: str
    why: str


def _nullable_values(columns: dict[str, Column], profile: Profile) -> list[_NullableValue]:
    """Nullable columns whose NULL no row can be delivered with, where a producer leaves them
    out: the claim's ``lock <= now`` never matches a NULL lock, whether the lock is epoch ms or
    a timestamp (silk's ``next_attempt_at``, nullable where GORM made it untagged); the value it
    stands for is the profile's cleared lock, due at once. A NULL ``app_code`` puts the row in no
    room bucket (their key is built of it), and its envelope's app cannot be checked against it.
    ``''`` is the app of a row whose producer writes none (the envelope's stands)."""
    found = []
    lock = columns.get(profile.lock)
    if lock is not None and lock.nullable and not lock.in_view:
        found.append(
            _NullableValue(lock, profile.lock_cleared, f"a claim never takes a row whose {profile.lock} is NULL")
        )
    app = columns.get(profile.app_code)
    if app is not None and app.nullable and not app.in_view:
        found.append(_NullableValue(app, "''", f"a row whose {profile.app_code} is NULL is never delivered"))
    return found


def _not_null_declaration(value: _NullableValue) -> str:
    """``name type NOT NULL DEFAULT …`` keeping the column's type, its non-NULL default (else
    the value NULL stands for), character set, collation and comment."""
    column = value.column
    default = _default_sql(column) or f" DEFAULT {value.empty}"
    kept = f" CHARACTER SET {column.charset} COLLATE {column.collation}" if column.charset and column.collation else ""
    if column.comment:
        kept += " COMMENT '" + column.comment.replace("\\", "\\\\").replace("'", "''") + "'"
    return f"{column.name} {column.declared}{kept} NOT NULL{default}"


def column_fixes(columns: dict[str, Column], indexes: IndexNames, profile: Profile, dialect: Dialect) -> list[Step]:
    """What ``migrate`` changes itself (MySQL/MariaDB), for each nullable column of
    :func:`_nullable_values`: a default (metadata only) where it has none; an index on it built
    online, so that each batch of the backfill reads the NULLs left instead of scanning past
    every row done (a cost that grows with the square of the table); the NULLs set in small
    batches, each its own short transaction. Then one online rebuild makes them all NOT NULL
    and drops the indexes, writes going on. A rerun after an interruption finds the indexes
    already there."""
    nullable = _nullable_values(columns, profile)
    if not nullable or not _fixed_online(columns, dialect):
        return []
    table = profile.table
    steps: list[Step] = []
    for value in nullable:
        name, empty = value.column.name, value.empty
        index = BACKFILL_INDEX.format(table=table, column=name)
        if not _default_sql(value.column):
            steps.append(
                (
                    f"set {table}.{name}'s default to {empty}",
                    (f"ALTER TABLE {table} ALTER COLUMN {name} SET DEFAULT {empty}{dialect.online_column}",),
                    False,
                )
            )
        if index not in indexes:
            steps.append(
                (
                    f"added index {table}.{index} (for the backfill)",
                    (f"ALTER TABLE {table} ADD INDEX {index} ({name}){dialect.online_index}",),
                    False,
                )
            )
        steps.append(
            (
                f"set {table}.{name} to {empty} where it was NULL",
                (
                    f"UPDATE {table} FORCE INDEX ({index}) SET {name} = {empty} WHERE {name} IS NULL LIMIT {BACKFILL_BATCH}",
                ),
                True,
            )
        )
    modified = ", ".join(f"MODIFY {_not_null_declaration(value)}" for value in nullable)
    dropped = ", ".join(f"DROP INDEX {BACKFILL_INDEX.format(table=table, column=v.column.name)}" for v in nullable)
    names = ", ".join(f"{table}.{value.column.name}" for value in nullable)
    return [
        *steps,
        (
            f"made {names} NOT NULL",
            (f"ALTER TABLE {table} {modified}, {dropped}, ALGORITHM=INPLACE, LOCK=NONE",),
            False,
        ),
    ]


def _fixed_online(columns: dict[str, Column], dialect: Dialect) -> bool:
    """Whether MySQL/MariaDB can rebuild the table in place, writes going on: not once it has
    a generated column (the room bucket of a table migrated before), which forces a copy."""
    return dialect.name == "mysql" and not any(column.generated for column in columns.values())


async def engine_problems(cur: Any, dialect: Dialect, table: str) -> list[str]:
    """A MySQL/MariaDB table on another engine than InnoDB (MyISAM, room-service's oldest
    tables): without transactions a failed round cannot be undone, and without row locks two
    processes' claims take the same rows. Converting it copies the table."""
    if dialect.name != "mysql":
        return []
    await cur.execute(
        "SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s", (table,)
    )
    row = await cur.fetchone()
    engine = row[0].decode() if row and isinstance(row[0], bytes) else (row[0] if row else None)
    if engine is None or engine.lower() == "innodb":
        return []
    return [
        f"{table} is a {engine} table, and room-outbox needs InnoDB (transactions, and row locks concurrent claims"
        f" skip): run ALTER TABLE {table} ENGINE=InnoDB, a copy of the table (on a live table, with"
        " pt-online-schema-change)"
    ]


async def binlog_problems(cur: Any, dialect: Dialect) -> list[str]:
    """A MySQL/MariaDB server that logs statements to its binary log (``binlog_format`` STATEMENT):
    InnoDB refuses to log a write of a READ COMMITTED transaction there (error 1665), and the
    store's sessions run at READ COMMITTED, which its claims need, so not one event would be
    delivered. Switching the sessions' format is left to the server's owner: a replica logging
    statements itself could not apply the rows."""
    if dialect.name != "mysql":
        return []
    await cur.execute("SELECT @@log_bin, @@SESSION.binlog_format")
    log_bin, binlog_format = await cur.fetchone()
    binlog_format = binlog_format.decode() if isinstance(binlog_format, bytes) else str(binlog_format)
    if not int(log_bin) or binlog_format.upper() != "STATEMENT":
        return []
    return [
        "the server logs statements to its binary log (binlog_format=STATEMENT), and InnoDB refuses to log"
        " the writes of a READ COMMITTED transaction, the isolation room-outbox's claims run at: every"
        " write would fail (error 1665); set binlog_format to MIXED or ROW in the server's configuration"
        " and with SET GLOBAL (the defaults since MariaDB 10.2.4 and MySQL 5.7.7), where its replicas"
        " allow it"
    ]


async def schema_problems(cur: Any, dialect: Dialect, profile: Profile) -> list[str]:
    """A PostgreSQL outbox table found through the search path in another schema than the
    session's first (the default search path starts with a schema named after the role,
    ``"$user"``), or not found through it at all while the database has one in another
    schema and nobody chose this search path (:func:`_outside_the_search_path`). The
    catalogue checks and room-outbox's own tables go by the first schema: ``migrate`` would
    make a second, empty outbox table there, which room-outbox would read while room-service
    writes the other. First, a schema of the search path or the table that PostgreSQL has only
    under a name with capitals (:func:`_schemas_with_capitals`, :func:`_tables_with_capitals`)."""
    if dialect.name != "postgresql":
        return []
    capitals = await _schemas_with_capitals(cur)
    if capitals:  # the session looks in other schemas than those named: nothing else is said right
        return capitals
    await cur.execute(
        "SELECT n.nspname, current_schema() FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.oid = to_regclass(%s)",
        (profile.table,),
    )
    row = await cur.fetchone()
    if row is None:
        return await _tables_with_capitals(cur, profile.table) or await _outside_the_search_path(cur, profile.table)
    if row is not None and row[0] != row[1]:
        found, first = row
        return [
            f"{profile.table} is {found}.{profile.table}, found through the search path, but this session's"
            f" first schema is {first}, where room-outbox keeps its tables and migrate would make a second,"
            f" empty {profile.table}: add ?search_path={found} to database.dsn"
        ]
    # One table of that name in each of several schemas of the search path (a second one made
    # by an earlier migrate, say): which one room-service writes, the catalogue cannot tell.
    await cur.execute(
        "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relname = %s AND c.relkind IN ('r', 'p') AND n.nspname = ANY(current_schemas(false))"
        " ORDER BY array_position(current_schemas(false), n.nspname)",
        (profile.table,),
    )
    schemas = [str(name) for (name,) in await cur.fetchall()]
    if len(schemas) < 2:
        return []
    return [
        f"{profile.table} is in {' and '.join(schemas)}, all in the search path, and room-outbox would read"
        f" {schemas[0]}.{profile.table}: name the schema room-service writes in database.dsn"
        f" (?search_path={schemas[1]}, or ?search_path={schemas[0]} for the first)"
    ]


async def _schemas_with_capitals(cur: Any) -> list[str]:
    """PostgreSQL: a schema the search path names that the catalogue has only under a name with
    capitals (created quoted, as some ORMs do). The sessions set the DSN's search path unquoted,
    which PostgreSQL folds to lower case: they would look in a schema that does not exist, and
    migrate would blame a privilege on no schema. Said up front, with the rename that fixes it."""
    await cur.execute(
        "SELECT s.nspname FROM pg_namespace s WHERE s.nspname <> lower(s.nspname)"
        " AND lower(s.nspname) = ANY(regexp_split_to_array(current_setting('search_path'), '\\s*,\\s*'))"
        " AND NOT EXISTS (SELECT 1 FROM pg_namespace f WHERE f.nspname = lower(s.nspname)) ORDER BY 1",
    )
    return [
        f'schema "{name}" has capitals (it was created quoted): room-outbox sets database.dsn\'s search_path'
        f" unquoted, which PostgreSQL reads as {name.lower()}, a schema that does not exist; rename it in lower"
        f' case (ALTER SCHEMA "{name}" RENAME TO {name.lower()}: statements that quote the name need the new one)'
        for (name,) in await cur.fetchall()
    ]


async def _tables_with_capitals(cur: Any, table: str) -> list[str]:
    """PostgreSQL: the outbox ``table``, not there, in any schema under its name with capitals
    (created quoted). Every statement names it unquoted, which PostgreSQL folds to lower case
    (see :meth:`.postgres.PostgresStore.use_profile`): said with the rename that fixes it,
    rather than as a table outside the search path, missing or lacking columns."""
    await cur.execute(
        "SELECT quote_ident(n.nspname), c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE lower(c.relname) = %s AND c.relname <> %s AND c.relkind IN ('r', 'p') ORDER BY 1",
        (table.lower(), table.lower()),
    )
    return [
        f'table {schema}."{name}" has capitals (it was created quoted): room-outbox names database.table'
        f" unquoted, which PostgreSQL reads as {table.lower()}, a table that does not exist; rename it in lower"
        f' case (ALTER TABLE {schema}."{name}" RENAME TO {table.lower()}: its producer\'s statements that quote'
        " the name need the new one)"
        for schema, name in await cur.fetchall()
    ]


#: Where a session's search path comes from when nobody chose one for this database, role or
#: session (``pg_settings.source``): the server's own default or its configuration.
_SERVER_WIDE = ("default", "configuration file", "command line", "environment variable", "override")


async def _outside_the_search_path(cur: Any, table: str) -> list[str]:
    """A ``table`` the search path does not reach, while the database has one in another schema
    (room-service's, ``app`` say, with a DSN that names no ``search_path``): ``run`` would say it
    does not exist and ``migrate`` would make a second, empty one in the first schema, which
    room-outbox would then read for ever while room-service writes the other. Only where the
    search path is the server's default: one chosen for the DSN, role or database is taken as
    meant (a new schema of its own beside others' tables, say)."""
    await cur.execute(
        "SELECT n.nspname, current_schema(), current_setting('search_path'),"
        " (SELECT s.source FROM pg_settings s WHERE s.name = 'search_path')"
        " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relname = %s AND c.relkind IN ('r', 'p') ORDER BY n.nspname",
        (table,),
    )
    rows = await cur.fetchall()
    if not rows or rows[0][3] not in _SERVER_WIDE:
        return []
    schemas = [str(row[0]) for row in rows]
    first, search_path = rows[0][1], rows[0][2]
    where = f" in {first}" if first else ""
    if len(schemas) == 1:
        fix = f"add ?search_path={schemas[0]} to database.dsn"
    else:
        fix = f"name the schema room-service writes in database.dsn (?search_path={', or ?search_path='.join(schemas)})"
    return [
        f"{table} is not in this session's search path ({search_path}) but in {' and '.join(schemas)}"
        f" ({', '.join(f'{schema}.{table}' for schema in schemas)}), where room-outbox does not look: migrate"
        f" would make a second, empty {table}{where}, which room-outbox would read while room-service writes"
        f" the other; {fix}"
    ]


async def row_security_notice(cur: Any, dialect: Dialect, profile: Profile) -> str | None:
    """What to say where PostgreSQL's row-level security applies to this role on the outbox
    table: its claims, its counts and its backlog see only the rows the table's policies show
    it, and with no policy none at all, so that room-service's rows would pile up unsent while
    every figure reads zero. (One process per tenant may want exactly that: it is said, not
    refused.)"""
    if dialect.name != "postgresql":
        return None
    await cur.execute(
        "SELECT row_security_active(c.oid), current_user, (SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid)"
        " FROM pg_class c WHERE c.oid = to_regclass(%s)",
        (profile.table,),
    )
    row = await cur.fetchone()
    if row is None or not row[0]:
        return None
    _active, user, policies = row
    seen = (
        f"only the rows its policies show {user} ({policies} on the table)"
        if policies
        else f"no row at all (no policy shows {user} any)"
    )
    return (
        f"{profile.table} has row-level security on for {user}: this process claims, delivers and counts {seen};"
        f" if every row is to be delivered, give {user} BYPASSRLS or a policy that shows them"
    )


async def sequence_problems(cur: Any, dialect: Dialect, profile: Profile) -> list[str]:
    """A PostgreSQL sequence behind the outbox's key that caches values (``CACHE`` above 1):
    each producer session takes a block of ids and uses them over its life, long after other
    sessions' later ids have committed. The lanes wait for a missing id only ``lanes.gap_timeout``
    and then take it as rolled back, so those events would never reach them. (MySQL allocates
    an auto-increment id at the insert itself, and MariaDB's sequences share one cache among
    all sessions.)"""
    if dialect.name != "postgresql":
        return []
    # Neither the table nor its key may be there yet (silk's table gets outbox_seq from migrate):
    # migrate makes them with a sequence of its own.
    await cur.execute(
        "SELECT attrelid, attnum, attidentity <> '' FROM pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped",
        (profile.table, profile.key),
    )
    key = await cur.fetchone()
    if key is None:
        return []
    table, column, identity = key
    await cur.execute(
        # by its schema too, as the fix names it
        "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname), seq.seqcache FROM pg_sequence seq"
        " JOIN pg_class c ON c.oid = seq.seqrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
        f" WHERE seq.seqcache > 1 AND seq.seqrelid IN ({_KEY_SEQUENCES}) ORDER BY 1",
        (table, column, identity, table, column),
    )
    return [
        f"{profile.table}.{profile.key} comes from the sequence {sequence}, which caches {cache} values per"
        " session (CACHE): a session uses its cached ids long after other sessions' later ids commit,"
        " and the lanes take an id missing for lanes.gap_timeout as rolled back, so they would never"
        f" send those events; run ALTER SEQUENCE {sequence} CACHE 1, then let room-service's"
        " connections reconnect (each keeps the ids it has cached)"
        for sequence, cache in await cur.fetchall()
    ]


#: The sequences a key column's ids come from (its table's oid, its number, whether it is an
#: identity column, the oid and number again): an identity column's own, or those its default
#: names (``nextval('ids')``: SERIAL's, or one made apart and never OWNED BY the column, which
#: pg_get_serial_sequence does not find). PostgreSQL records a default's dependency on each
#: sequence it names.
_KEY_SEQUENCES = (
    "SELECT d.refobjid FROM pg_attrdef ad JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass"
    " AND d.objid = ad.oid AND d.refclassid = 'pg_class'::regclass"
    " WHERE ad.adrelid = %s AND ad.adnum = %s"
    " UNION SELECT d.objid FROM pg_depend d WHERE %s AND d.classid = 'pg_class'::regclass"
    " AND d.refclassid = 'pg_class'::regclass AND d.refobjid = %s AND d.refobjsubid = %s"
    " AND d.deptype = 'i'"
)


async def check_constraint_problems(
    cur: Any, dialect: Dialect, profile: Profile, columns: dict[str, Column]
) -> list[str]:
    """CHECK constraints on the table's ``status`` that refuse a status room-outbox writes: the
    ENUM's problem in another form (``CHECK (status IN ('pending', 'published'))`` refuses a
    parked row's ``failed``, so the row would be released and tried again for ever instead).
    Each constraint that reads ``status`` alone is evaluated on each word in a SELECT, never
    tried on the table; one that reads other columns too is left to the server."""
    if dialect.name == "mysql":
        checks = await _mysql_status_checks(cur, profile.table)
        literal = "%s"
    elif dialect.name == "postgresql":
        checks, declared = await _postgresql_status_checks(cur, profile.table)
        literal = f"CAST(%s AS {declared})"
    else:
        return []
    table, target, problems = profile.table, "", []
    for name, clause, where in checks:
        refused = []
        for word in _statuses(profile):
            if where.startswith("domain "):  # PostgreSQL checks a domain's constraints on a cast to it
                sql = f"SELECT CAST(%s AS {where.removeprefix('domain ')})"
            else:
                sql = f"SELECT ({clause}) FROM (SELECT {literal} AS status) AS {table}"
            if await _refuses(cur, dialect, sql, word):
                refused.append(f"'{word}'")
        if not refused:
            continue
        target = target or await printed_name(cur, dialect, table)
        if where == "column" and "status" in columns:  # MariaDB: part of the column's definition, unnamed
            status = columns["status"]
            fix = f"ALTER TABLE {target} {_retype(dialect, 'status', status.declared, not status.nullable, status)}"
            fix += " (without its CHECK)"
        elif where.startswith("domain "):
            fix = f"ALTER DOMAIN {where.removeprefix('domain ')} DROP CONSTRAINT {name}"
        else:
            fix = f"ALTER TABLE {target} DROP CONSTRAINT {name}"
        problems.append(
            f"{table}.status: CHECK constraint {name} ({clause}) refuses {', '.join(refused)}, statuses"
            f" room-outbox writes: run {fix}, and add it again with {', '.join(refused)} among its values"
        )
    return problems


async def _mysql_status_checks(cur: Any, table: str) -> list[tuple[str, str, str]]:
    """The table's CHECK constraints whose clause names no column but ``status``: name,
    clause, and where it is: ``column`` when part of the column's definition (MariaDB's
    column-level CHECK), else ``table``."""
    try:  # MariaDB: by table (a column's constraint is named after the column, so not unique)
        await cur.execute(
            "SELECT CONSTRAINT_NAME, CHECK_CLAUSE, LEVEL = 'Column' FROM information_schema.CHECK_CONSTRAINTS"
            " WHERE CONSTRAINT_SCHEMA = DATABASE() AND TABLE_NAME = %s",
            (table,),
        )
    except Exception:  # MySQL: no TABLE_NAME there, and names are unique in a database
        await cur.execute(
            "SELECT cc.CONSTRAINT_NAME, cc.CHECK_CLAUSE, 0 FROM information_schema.TABLE_CONSTRAINTS tc"
            " JOIN information_schema.CHECK_CONSTRAINTS cc ON cc.CONSTRAINT_SCHEMA = tc.CONSTRAINT_SCHEMA"
            " AND cc.CONSTRAINT_NAME = tc.CONSTRAINT_NAME"
            " WHERE tc.TABLE_SCHEMA = DATABASE() AND tc.TABLE_NAME = %s AND tc.CONSTRAINT_TYPE = 'CHECK'",
            (table,),
        )
    checks = []
    for name, clause, of_column in await cur.fetchall():
        name, clause = (v.decode() if isinstance(v, bytes) else str(v) for v in (name, clause))
        without_strings = re.sub(r"'(?:[^'\\]|\\.|'')*'", "''", clause)
        if {column.lower() for column in re.findall(r"`([^`]+)`", without_strings)} == {"status"}:
            checks.append((name, clause, "column" if of_column else "table"))
    return checks


#: The column's type, a domain's base type for a domain: the type a table constraint is judged in
#: (a cast to the domain would apply the domain's own constraints as well).
_PG_PLAIN_TYPE = "CASE WHEN t.typtype = 'd' THEN format_type(t.typbasetype, t.typtypmod) ELSE format_type(a.atttypid, a.atttypmod) END"


async def _postgresql_status_checks(cur: Any, table: str) -> tuple[list[tuple[str, str, str]], str]:
    """The CHECK constraints that judge ``status`` alone: the table's (``table``) and, where the
    column's type is a domain, the domain's (``domain <its name>``, with its schema, as the fix
    names it); and the column's type. Names quoted where needed, as the fix names them."""
    await cur.execute(
        "SELECT quote_ident(c.conname), pg_get_expr(c.conbin, c.conrelid), 'table', " + _PG_PLAIN_TYPE + ", t.typtype"
        " FROM pg_constraint c JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attname = 'status'"
        " JOIN pg_type t ON t.oid = a.atttypid"
        " WHERE c.conrelid = to_regclass(%s) AND c.contype = 'c' AND c.conkey = ARRAY[a.attnum]"
        " UNION ALL SELECT quote_ident(c.conname), pg_get_constraintdef(c.oid),"
        " 'domain ' || quote_ident(tn.nspname) || '.' || quote_ident(t.typname), " + _PG_PLAIN_TYPE + ", t.typtype"
        " FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid JOIN pg_constraint c ON c.contypid = t.oid"
        " JOIN pg_namespace tn ON tn.oid = t.typnamespace"
        " WHERE a.attrelid = to_regclass(%s) AND a.attname = 'status' AND c.contype = 'c'",
        (table, table),
    )
    rows = await cur.fetchall()
    # An ENUM's own members are checked apart (a word outside them cannot even be cast).
    checks = [(str(name), str(clause), str(where)) for name, clause, where, _declared, kind in rows if kind != "e"]
    return checks, (str(rows[0][3]) if rows else "text")


#: The column's type, a domain's base type for a domain: the type a table constraint is judged in
#: (a cast to the domain would apply the domain's own constraints as well).
_PG_PLAIN_TYPE = "CASE WHEN t.typtype = 'd' THEN format_type(t.typbasetype, t.typtypmod) ELSE format_type(a.atttypid, a.atttypmod) END"


async def _refuses(cur: Any, dialect: Dialect, sql: str, word: str) -> bool:
    """Whether ``sql`` refuses ``word``: it answers false, or (a cast to a domain) fails with a
    check violation. Any other error counts as no refusal (the constraint is then the server's
    to judge) and leaves the transaction usable."""
    if dialect.name == "postgresql":
        await cur.execute("SAVEPOINT status_check")
    try:
        await cur.execute(sql, (word,))
        row = await cur.fetchone()
    except Exception as exc:
        if dialect.name == "postgresql":
            await cur.execute("ROLLBACK TO SAVEPOINT status_check")
        return getattr(exc, "sqlstate", None) == CHECK_VIOLATION
    if dialect.name == "postgresql":
        await cur.execute("RELEASE SAVEPOINT status_check")
    return row is not None and row[0] is not None and not row[0]  # NULL passes, as in a CHECK


#: PostgreSQL's SQLSTATE for a value a CHECK constraint refuses.
CHECK_VIOLATION = "23514"


async def checked_fixes(cur: Any, dialect: Dialect, profile: Profile) -> list[Step]:
    """``migrate``'s side: refuse (:class:`SchemaError`, one line per problem) what it cannot
    fix; return the steps that fix the rest."""
    columns = await read_columns(cur, dialect, profile.table)
    refused, _fixable = column_problems(
        columns, profile, dialect, named=await printed_name(cur, dialect, profile.table)
    )
    refused = await binlog_problems(cur, dialect) + await engine_problems(cur, dialect, profile.table) + refused
    refused += await check_constraint_problems(cur, dialect, profile, columns)
    if refused:
        raise SchemaError("\n".join(refused))
    return column_fixes(columns, await index_names(cur, dialect, profile.table), profile, dialect)


async def check_columns(cur: Any, dialect: Dialect, profile: Profile, claim_ids: int = 0) -> None:
    """``run``'s side: refuse every problem, those ``migrate`` fixes included."""
    wrong_schema = await schema_problems(cur, dialect, profile)
    if wrong_schema:  # its columns would be looked for in the first schema, where it is not
        raise SchemaError("\n".join(wrong_schema))
    columns = await read_columns(cur, dialect, profile.table)
    refused, fixable = column_problems(
        columns, profile, dialect, claim_ids, named=await printed_name(cur, dialect, profile.table)
    )
    refused = await binlog_problems(cur, dialect) + await engine_problems(cur, dialect, profile.table) + refused
    refused += await check_constraint_problems(cur, dialect, profile, columns)
    refused += await sqlite_problems(cur, dialect, profile)
    if refused or fixable:
        raise SchemaError("\n".join(refused + fixable))


async def sqlite_problems(cur: Any, dialect: Dialect, profile: Profile) -> list[str]:
    """SQLite's columns hold any value, so only what leaves rows unreachable is refused:

    * a key declared other than ``INTEGER PRIMARY KEY`` is no alias of the row id: a row the
      producer inserts without one gets a NULL key, which no lease or result can name (sent,
      never marked, and sent again at every start);
    * a time column declared without a type (or as BLOB) has no numeric affinity: a time the
      producer binds as text compares above every number, never due, never old enough."""
    if dialect.name != "sqlite":
        return []
    await cur.execute(f"SELECT name, type, pk FROM pragma_table_info('{profile.table}')")
    declared = {str(name).lower(): (str(kind).upper(), int(pk)) for name, kind, pk in await cur.fetchall()}
    problems = []
    key = declared.get(profile.key.lower())
    keys = sum(1 for _, pk in declared.values() if pk)
    if key is not None and (key != ("INTEGER", 1) or keys > 1):
        problems.append(
            f"{profile.table}.{profile.key} is declared {key[0] or 'without a type'}"
            f"{' PRIMARY KEY' if key[1] else ''}{' (of several columns)' if keys > 1 else ''}: on SQLite only"
            f" {profile.key} INTEGER PRIMARY KEY is the row's id, and a row inserted without one gets a NULL"
            f" {profile.key} that no lease can name; make the table again with {profile.key} INTEGER PRIMARY KEY"
            " AUTOINCREMENT and copy its rows"
        )
    if profile.ms_columns:
        for column in (profile.created, profile.lock):
            kind = declared.get(column.lower(), ("INTEGER", 0))[0]
            if kind == "" or "BLOB" in kind:
                problems.append(
                    f"{profile.table}.{column} is declared {kind or 'without a type'}: SQLite compares a time"
                    " stored as text above every number, so such a row is never due; declare it INTEGER"
                )
    return problems
