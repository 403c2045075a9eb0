"""The outbox tables in each database's dialect — room-service's V1 ``room_outbox`` and silk's
``outbox_events`` — what room-outbox adds to them, and the one migration plan that creates or
upgrades them on all three databases (``migrate`` runs it, ``migrate --sql`` prints it).

Everything added has a default (:data:`ADDED_COLUMNS`, :data:`ADDED_INDEXES`), so
room-service's own INSERT and ``UPDATE … SET status='published' WHERE event_id=?`` keep
working. On PostgreSQL the plan changes a live table online (no rewrite, no long lock):
indexes are built ``CONCURRENTLY``, silk's key is added and backfilled in batches
(:func:`silk_key_steps`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from room_outbox.errors import SchemaError
from room_outbox.store.dialect import Dialect, IndexNames, column_names, index_names
from room_outbox.store.schema.columns import ADOPTED_COLUMNS, adoption_plan, checked_fixes
from room_outbox.store.schema.partitions import Partition, index_statements, partition_index, partitions_of, quoted

if TYPE_CHECKING:
    from room_outbox.store.schema.profiles import Profile

TABLE = "room_outbox"


@dataclass(frozen=True)
class Migration:
    """One step of a migration: its statements and the line ``migrate`` reports once they ran.

    ``autocommit``: each statement runs on its own, outside any transaction (PostgreSQL's
    ``CREATE INDEX CONCURRENTLY`` cannot run inside one). ``repeat``: each statement is a batch
    of a backfill, run again (each time in its own transaction) until it changes no row, so
    that no lock is held for longer than one small batch."""

    change: str
    statements: tuple[str, ...]
    autocommit: bool = False
    repeat: bool = False
    #: A repeated step's progress: SQL counting the rows it has left to change (read once).
    remaining: str = ""
    #: Whose statements these are when not room-outbox's (a plugin, with its distribution):
    #: a statement the database refuses names it, the one to fix or disable.
    author: str = ""


#: A plan step's first word, as migrate reports the change once made, and as a change still
#: being made (or left unmade) is named. Every step's change starts with one of these (a test
#: reads them all from the planners' source).
IN_PROGRESS = {
    "added": "adding",
    "checked": "checking",
    "created": "creating",
    "dropped": "dropping",
    "fed": "feeding",
    "kept": "keeping",
    "left": "leaving",
    "made": "making",
    "moved": "moving",
    "numbered": "numbering",
    "ran": "running",
    "rebuilt": "rebuilding",
    "replaced": "replacing",
    "set": "setting",
    "skipped": "skipping",
    "started": "starting",
    "took": "taking",
}


def in_progress(change: str) -> str:
    """``change`` ("added column t.c") as the lines about a change not made yet name it
    ("adding column t.c"): progress, retries, and a change given up on."""
    verb, _, rest = change.partition(" ")
    return f"{IN_PROGRESS[verb]} {rest}" if verb in IN_PROGRESS else f"not yet made: {change}"


def concurrent_step(change: str, statements: tuple[str, ...]) -> Migration:
    """A step of ``statements``, run outside a transaction when one of them builds or drops an
    index ``CONCURRENTLY`` (PostgreSQL refuses that inside one)."""
    return Migration(change, statements, autocommit=any(" CONCURRENTLY " in s for s in statements))


#: Templates: ``{table}`` is the outbox table's name.
V1_TABLE_DDL: dict[str, tuple[str, ...]] = {
    "mysql": (
        """CREATE TABLE IF NOT EXISTS {table} (
  id            BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
  app_code      VARCHAR(64)  NOT NULL DEFAULT '',
  event_id      VARCHAR(64)  NOT NULL,
  event_type    VARCHAR(64)  NOT NULL,
  room_id       VARCHAR(64)  NOT NULL,
  envelope      LONGTEXT     NOT NULL,
  status        VARCHAR(16)  NOT NULL DEFAULT 'pending',
  retry_count   INT          NOT NULL DEFAULT 0,
  last_error    VARCHAR(1024) NULL,
  created_at_ms BIGINT       NOT NULL,
  updated_at_ms BIGINT       NOT NULL,
  UNIQUE KEY uk_{table}_event_id (event_id),
  KEY idx_{table}_status_id (status, id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4""",
    ),
    # BIGSERIAL: a sequence, whose values (like InnoDB's auto-increment) commit out of order;
    # lanes feed around that (see room_outbox.store.lanes.store).
    "postgresql": (
        """CREATE TABLE {table} (
  id            BIGSERIAL     PRIMARY KEY,
  app_code      VARCHAR(64)   NOT NULL DEFAULT '',
  event_id      VARCHAR(64)   NOT NULL,
  event_type    VARCHAR(64)   NOT NULL,
  room_id       VARCHAR(64)   NOT NULL,
  envelope      TEXT          NOT NULL,
  status        VARCHAR(16)   NOT NULL DEFAULT 'pending',
  retry_count   INT           NOT NULL DEFAULT 0,
  last_error    VARCHAR(1024) NULL,
  created_at_ms BIGINT        NOT NULL,
  updated_at_ms BIGINT        NOT NULL,
  CONSTRAINT uk_{table}_event_id UNIQUE (event_id)
)""",
        "CREATE INDEX idx_{table}_status_id ON {table} (status, id)",
    ),
    # AUTOINCREMENT because per-room ordering relies on ids that only rise: without it SQLite
    # reuses the ids of deleted rows at the top.
    "sqlite": (
        """CREATE TABLE {table} (
  id            INTEGER PRIMARY KEY AUTOINCREMENT,
  app_code      TEXT    NOT NULL DEFAULT '',
  event_id      TEXT    NOT NULL,
  event_type    TEXT    NOT NULL,
  room_id       TEXT    NOT NULL,
  envelope      TEXT    NOT NULL,
  status        TEXT    NOT NULL DEFAULT 'pending',
  retry_count   INTEGER NOT NULL DEFAULT 0,
  last_error    TEXT    NULL,
  created_at_ms INTEGER NOT NULL,
  updated_at_ms INTEGER NOT NULL
)""",
        "CREATE UNIQUE INDEX uk_{table}_event_id ON {table} (event_id)",
        "CREATE INDEX idx_{table}_status_id ON {table} (status, id)",
    ),
}

#: What room-outbox adds to the V1 table: column name → definition, per dialect.
#: ``worker_id``: the claim holding the row (``<node_id>~<token>#<n>``), NULL when free.
#: ``lock_until_ms``: the row is not claimable before this time; a claim sets it to the end of
#: its lease, a failed attempt to the retry time. One column for both keeps the claim an exact
#: index range scan.
ADDED_COLUMNS: dict[str, dict[str, str]] = {
    "mysql": {"worker_id": "VARCHAR(128) NULL DEFAULT NULL", "lock_until_ms": "BIGINT NOT NULL DEFAULT 0"},
    "postgresql": {"worker_id": "VARCHAR(128) NULL DEFAULT NULL", "lock_until_ms": "BIGINT NOT NULL DEFAULT 0"},
    "sqlite": {"worker_id": "TEXT NULL DEFAULT NULL", "lock_until_ms": "INTEGER NOT NULL DEFAULT 0"},
}
#: room-service's (status, id) index's name template (the V1 DDL above): each status's rows in
#: key order. A table may lack it; the reads of a status's rows then take the claim's index.
STATUS_INDEX = "idx_{table}_status_id"
#: The per-room index's name template: (room, status, key). Per-room ordering reads it for
#: "which earlier rows of these rooms are still open".
ROOM_INDEX = "idx_{table}_room"
#: Index name templates (``{table}``) → columns, besides the claim's (:func:`claim_index`).
ADDED_INDEXES = {
    ROOM_INDEX: "(room_id, status, id)",
}
REQUIRED_V1_COLUMNS = (
    "id", "app_code", "event_id", "event_type", "room_id", "envelope",
    "status", "retry_count", "last_error", "created_at_ms", "updated_at_ms",
)  # fmt: skip


def claim_index(table: str, lock: str = "lock_until_ms", key: str = "id", bucket: str = "") -> tuple[str, str]:
    """The claim's index on ``table``: its name and columns. The claim reads a range of it in
    its order (``status``, then due time ``lock``, then ``key``) and stops after a batch.
    ``bucket``: the room bucket (a STORED column, or PostgreSQL's expression), appended on a
    server where the table has it (:mod:`.buckets`), so that a claim limited to some buckets
    checks them in the index entries it passes over rather than in the rows; being last, it
    leaves the range and its order as they are."""
    return f"idx_{table}_claim", f"(status, {lock}, {key}{', ' + bucket if bucket else ''})"


def producer_columns(profile: Profile) -> tuple[str, ...]:
    """The columns of the profile's table its producer makes: migrate never adds them (it adds
    only room-outbox's own, and the first V1 tables' ``app_code`` and ``updated_at_ms``)."""
    if profile.name == "silk":
        return REQUIRED_SILK_COLUMNS
    adopted = ADOPTED_COLUMNS["mysql"]  # the same names on every database
    return tuple(column for column in REQUIRED_V1_COLUMNS if column not in adopted)


def require_producer_columns(profile: Profile, columns: Iterable[str]) -> None:
    """Refuse an existing table without the columns its profile's producer makes: it is another
    table, or another producer's. migrate refuses to upgrade it and run to start on it with
    this one text, as migrate cannot fix it."""
    have = set(columns)
    missing = [column for column in producer_columns(profile) if column not in have]
    if missing:
        kind = "silk's outbox" if profile.name == "silk" else "the V1"
        raise SchemaError(
            f"table {profile.table} exists but lacks {kind} columns {', '.join(missing)}, which its producer"
            f" writes: it is not an outbox table of profile {profile.name}; check database.table and"
            " database.profile (migrate adds only room-outbox's own columns: it refuses to guess how to"
            " upgrade this table)"
        )


async def plan_v1(cur: Any, dialect: Dialect, profile: Profile) -> list[Migration]:
    """What creates the outbox table, or adds what is missing to room-service's V1 table, read
    from the catalogue in the caller's transaction; nothing when it is up to date."""
    table = profile.table
    columns = set(await column_names(cur, dialect, table))
    indexes = await index_names(cur, dialect, table)
    plan: list[Migration] = []
    if not columns:
        ddl = tuple(statement.format(table=table).strip() for statement in V1_TABLE_DDL[dialect.name])
        plan.append(Migration(f"created table {table}", ddl))
        columns = set(REQUIRED_V1_COLUMNS)
    require_producer_columns(profile, columns)
    plan += [Migration(c, s, repeat=r) for c, s, r in adoption_plan(columns, dialect, table)]  # first V1 tables
    for name, definition in ADDED_COLUMNS[dialect.name].items():
        if name not in columns:
            plan.append(
                Migration(f"added column {table}.{name}", (add_column_sql(dialect, table, f"{name} {definition}"),))
            )
    wanted = [(template.format(table=table), columns_sql) for template, columns_sql in ADDED_INDEXES.items()]
    if not dialect.room_buckets:  # on a server the room buckets' plan creates it, with the bucket where it fits
        wanted.insert(0, claim_index(table))
    partitions = await partitions_of(cur, table) if dialect.name == "postgresql" else None
    for name, columns_sql in wanted:
        if name not in indexes:
            create = add_index_sql(dialect, table, name, columns_sql, partitions=partitions)
            plan.append(concurrent_step(f"added index {table}.{name}", create))
    return plan


async def invalid_index_steps(cur: Any, tables: list[str]) -> list[Migration]:
    """PostgreSQL: the invalid indexes of ``tables`` and of their partitions dropped
    (``CONCURRENTLY``, outside a transaction). A ``CREATE INDEX CONCURRENTLY`` that was
    interrupted leaves one, which ``IF NOT EXISTS`` would take for built: dropped here, it is
    built again later in the plan. A partitioned table's own index is left: it is invalid
    until its partitions' are attached, which the plan does (see :mod:`.partitions`)."""
    await cur.execute(
        "SELECT ix.relname FROM pg_index i JOIN pg_class ix ON ix.oid = i.indexrelid"
        " JOIN pg_class t ON t.oid = i.indrelid JOIN pg_namespace n ON n.oid = t.relnamespace"
        " WHERE n.nspname = current_schema() AND NOT i.indisvalid AND ix.relkind = 'i'"
        " AND NOT EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = ix.oid)"
        " AND (t.relname = ANY(%s) OR EXISTS (SELECT 1 FROM unnest(%s::text[]) AS wanted (name),"
        " pg_partition_tree(to_regclass(wanted.name)) AS tree WHERE tree.relid = t.oid)) ORDER BY 1",
        ([table.lower() for table in tables],) * 2,
    )
    return [
        concurrent_step(
            f"dropped invalid index {name} (an interrupted build)", (f"DROP INDEX CONCURRENTLY {quoted(name)}",)
        )
        for (name,) in await cur.fetchall()
    ]


#: An index a statement builds: its name and its table (``CREATE [UNIQUE] INDEX [CONCURRENTLY]
#: [IF NOT EXISTS] name ON [ONLY] table``), each a plain or a double-quoted identifier.
_BUILDS_INDEX = re.compile(
    r'CREATE\s+(?:UNIQUE\s+)?INDEX\s+(?:CONCURRENTLY\s+)?(?:IF\s+NOT\s+EXISTS\s+)?("(?:[^"]|"")+"|[^\s"]+)'
    r'\s+ON\s+(?:ONLY\s+)?("(?:[^"]|"")+"|[^\s("]+)',
    re.IGNORECASE,
)


def built_indexes(plan: Iterable[Migration]) -> list[tuple[str, str]]:
    """``(index, table)`` of every index the plan's statements build, as PostgreSQL stores
    the names (a plain identifier in lower case). An index on a table named with its schema
    lives in that schema and is left out."""

    def stored(identifier: str) -> str:
        quoted_name = identifier.startswith('"')
        return identifier[1:-1].replace('""', '"') if quoted_name else identifier.lower()

    return [
        (stored(index), stored(table))
        for step in plan
        for statement in step.statements
        for index, table in _BUILDS_INDEX.findall(statement)
        if table.startswith('"') or "." not in table
    ]


async def taken_index_names(cur: Any, dialect: Dialect, wanted: Iterable[tuple[str, str]]) -> dict[str, str]:
    """PostgreSQL: index name → why it cannot be built, for each ``(index, table)`` of
    ``wanted`` whose name another relation of the schema holds, with the fix. PostgreSQL
    names indexes per schema, not per table: a table swapped out for a copy (``RENAME TO``)
    keeps its indexes and their names, and ``CREATE INDEX … IF NOT EXISTS`` on the copy then
    does nothing, quietly. MySQL/MariaDB name them per table."""
    table_of = dict(wanted)
    if dialect.name != "postgresql" or not table_of:
        return {}
    await cur.execute(
        "SELECT c.relname, t.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " LEFT JOIN pg_index i ON i.indexrelid = c.oid LEFT JOIN pg_class t ON t.oid = i.indrelid"
        " WHERE n.nspname = current_schema() AND c.relname = ANY(%s) ORDER BY 1",
        (list(table_of),),
    )
    taken: dict[str, str] = {}
    for name, holder in await cur.fetchall():
        table = table_of[name]
        if holder == table:  # its own index: built already, or an invalid one dropped first
            continue
        if holder is None:
            taken[name] = f"the name {name} is taken by a relation of the schema that is not an index: rename it"
        else:
            taken[name] = (
                f"the name {name} is taken by an index of table {holder} (PostgreSQL names indexes per schema,"
                " and a table swapped out keeps its indexes' names): rename that index (ALTER INDEX"
                f" {quoted(name)} RENAME TO {quoted(partition_index(name, table, holder))}) or drop it"
            )
        taken[name] += ", then run `room-outbox migrate`"
    return taken


def add_column_sql(dialect: Dialect, table: str, column: str) -> str:
    """Adds ``column`` (its name and definition) to a table already there, on MySQL/MariaDB
    without copying the table: the algorithm is named, so the server refuses rather than
    copy it with every write blocked."""
    return f"ALTER TABLE {table} ADD COLUMN {column}{dialect.online_column}"


def add_index_sql(
    dialect: Dialect,
    table: str,
    name: str,
    columns: str,
    unique: bool = False,
    partitions: list[Partition] | None = None,
) -> tuple[str, ...]:
    """The statements that create the index ``name`` on ``columns`` (``(a, b)``) while writes
    go on: on MySQL/MariaDB built in place (the algorithm and lock named, for the same reason),
    on PostgreSQL ``CONCURRENTLY`` (one that was interrupted leaves an invalid index, which a
    rerun drops and builds again: :func:`invalid_index_steps`), partition by partition on a
    partitioned table (``partitions``: see :mod:`.partitions`)."""
    kind = "UNIQUE INDEX" if unique else "INDEX"
    if dialect.name == "mysql":
        return (f"ALTER TABLE {table} ADD {kind} {name} {columns}{dialect.online_index}",)
    if dialect.name == "postgresql":
        return index_statements(table, name, columns, partitions, unique)
    return (f"CREATE {kind} {name} ON {table} {columns}",)


# -- silk's outbox (PostgreSQL) ----------------------------------------------------------------

#: silk's own table as its producer (GORM model OutboxEvent) expects it; created by migrate
#: only where it does not exist yet.
SILK_TABLE_DDL = (
    """CREATE TABLE {table} (
  id              UUID         PRIMARY KEY DEFAULT gen_random_uuid(),
  event_id        VARCHAR(64)  NOT NULL,
  event_type      VARCHAR(64)  NOT NULL,
  aggregate_type  VARCHAR(64)  NULL,
  aggregate_id    VARCHAR(128) NULL,
  payload         JSONB        NOT NULL DEFAULT '{{}}',
  status          VARCHAR(16)  NOT NULL DEFAULT 'pending',
  attempts        INT          NOT NULL DEFAULT 0,
  max_attempts    INT          NOT NULL DEFAULT 5,
  next_attempt_at TIMESTAMPTZ  NOT NULL DEFAULT now(),
  last_error      TEXT         NULL,
  created_at      TIMESTAMPTZ  NOT NULL DEFAULT now(),
  updated_at      TIMESTAMPTZ  NOT NULL DEFAULT now(),
  CONSTRAINT uk_{table}_event_id UNIQUE (event_id)
)""",
)
REQUIRED_SILK_COLUMNS = (
    "id", "event_id", "event_type", "aggregate_type", "aggregate_id", "payload", "status",
    "attempts", "max_attempts", "next_attempt_at", "last_error", "created_at", "updated_at",
)  # fmt: skip
#: What room-outbox adds to silk's table: a key that rises with inserts (silk's id is a UUID;
#: per-room order and lane feeding compare keys) and the claim holding a row. Both with
#: defaults: silk's INSERT names neither. On a table that exists already the key is added
#: online (:func:`silk_key_steps`).
SILK_ADDED_COLUMNS = {
    "outbox_seq": "BIGSERIAL",
    "worker_id": "VARCHAR(128) NULL DEFAULT NULL",
}
#: The claim's index comes with the room buckets (:mod:`.membership`): silk's table lives on
#: PostgreSQL, a server. Name template → (columns, unique).
SILK_ADDED_INDEXES = {
    "uk_{table}_outbox_seq": ("(outbox_seq)", True),
    # per-room order's "aggregate": the same expression the claim reads
    ROOM_INDEX: ("((COALESCE(aggregate_id, '')), status, outbox_seq)", False),
}
#: Rows the key's backfill numbers per transaction: each holds its rows' locks that long.
SILK_BACKFILL_BATCH = 2_000
#: Numbers left free between the rows counted before the key's default is set and the first
#: number the default gives: rows inserted meanwhile are numbered there.
SILK_KEY_HEADROOM = 1_000_000


async def plan_silk(cur: Any, dialect: Dialect, profile: Profile) -> list[Migration]:
    """As :func:`plan_v1`, for silk's table."""
    table = profile.table
    columns = set(await column_names(cur, dialect, table))
    indexes = await index_names(cur, dialect, table)
    plan: list[Migration] = []
    created = not columns
    if created:
        plan.append(Migration(f"created table {table}", tuple(s.format(table=table) for s in SILK_TABLE_DDL)))
        columns = set(REQUIRED_SILK_COLUMNS)
    require_producer_columns(profile, columns)
    if not created and await partitions_of(cur, table) is not None:
        raise SchemaError(
            f"table {table} is partitioned: room-outbox cannot adopt silk's table partitioned (its key,"
            " numbered row by row, needs a unique index, which PostgreSQL allows on a partitioned table only"
            " with the partition key in it); adopt it unpartitioned"
        )
    if not created:
        plan += silk_key_steps(table, await _key_state(cur, table, "outbox_seq" in columns, indexes))
    for name, definition in SILK_ADDED_COLUMNS.items():
        if name not in columns and (created or name != "outbox_seq"):
            plan.append(
                Migration(f"added column {table}.{name}", (f"ALTER TABLE {table} ADD COLUMN {name} {definition}",))
            )
    for template, (columns_sql, unique) in SILK_ADDED_INDEXES.items():
        name = template.format(table=table)
        if name not in indexes:
            create = add_index_sql(dialect, table, name, columns_sql, unique)
            plan.append(concurrent_step(f"added index {table}.{name}", create))
    return plan


#: How far the online addition of silk's key got, in order: no column, column without its
#: default, default set (rows to number), NOT NULL with the backfill's leftovers, done.
KEY_MISSING, KEY_COLUMN, KEY_DEFAULT, KEY_LEFTOVERS, KEY_DONE = range(5)


async def _key_state(cur: Any, table: str, has_column: bool, indexes: IndexNames) -> int:
    if not has_column:
        return KEY_MISSING
    await cur.execute(
        "SELECT a.attnotnull, pg_get_expr(d.adbin, d.adrelid) FROM pg_attribute a"
        " LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum"
        " WHERE a.attrelid = to_regclass(%s) AND a.attname = 'outbox_seq'",
        (table,),
    )
    not_null, default = await cur.fetchone()
    if not_null:
        await cur.execute("SELECT to_regclass(%s) IS NOT NULL", (_backfill_names(table)[0],))
        (sequence_left,) = await cur.fetchone()
        return KEY_LEFTOVERS if sequence_left or _backfill_names(table)[1] in indexes else KEY_DONE
    return KEY_DEFAULT if default and "nextval" in default else KEY_COLUMN


def _backfill_names(table: str) -> tuple[str, str, str]:
    """The backfill's own sequence and index, and the check standing in for NOT NULL."""
    return f"{table}_outbox_seq_backfill", f"idx_{table}_outbox_seq_backfill", f"ck_{table}_outbox_seq_set"


def silk_key_steps(table: str, state: int) -> list[Migration]:
    """``outbox_seq`` added to silk's existing table without rewriting it and without holding
    a lock that blocks its producer for longer than a catalogue change, from ``state`` on.

    A plain nullable column first; then a sequence for the rows to come, started above every
    row there (counted, plus :data:`SILK_KEY_HEADROOM` for rows inserted while they are
    counted), as the column's default. The rows already there, found by a partial index, are
    numbered in small batches below that start, counting down from it newest first: an old
    row keeps a lower key than every row inserted during or after the migration, and the old
    rows keep their order of creation. Rows of one transaction share their ``created_at``
    (``now()``) and silk's ``id`` is a random UUID: among them the physical order (``ctid``)
    stands for the order of insertion, so one command's events keep their order. The count-down sequence stops at 1 with an error rather
    than run into the new rows' numbers. Then NOT NULL through a validated check (the check
    is validated without blocking writes; SET NOT NULL then needs no scan)."""
    sequence = f"{table}_outbox_seq_seq"
    backfill, backfill_index, check = _backfill_names(table)
    steps = [
        Migration(f"added column {table}.outbox_seq", (f"ALTER TABLE {table} ADD COLUMN outbox_seq BIGINT",)),
        Migration(
            f"numbered new rows of {table} above the rows already there",
            (
                f"CREATE SEQUENCE {sequence} OWNED BY {table}.outbox_seq",
                f"SELECT setval('{sequence}', (SELECT count(*) FROM {table}) + {SILK_KEY_HEADROOM})",
                f"CREATE SEQUENCE {backfill} INCREMENT BY -1 MINVALUE 1 MAXVALUE 9223372036854775807",
                f"SELECT setval('{backfill}', (SELECT last_value FROM {sequence}) + 1)",
                f"ALTER TABLE {table} ALTER COLUMN outbox_seq SET DEFAULT nextval('{sequence}')",
            ),
        ),
        concurrent_step(
            f"added index {table}.{backfill_index}",
            (
                f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {backfill_index} ON {table} (created_at)"
                " WHERE outbox_seq IS NULL",
            ),
        ),
        Migration(
            f"numbered the rows already in {table}",
            (
                # by ctid: each row is found again where the batch read it (by id, the planner
                # joined the whole table); a row updated meanwhile is left to a later batch.
                # Ties of created_at by ctid, sorted within each one (an incremental sort on the
                # index's order), newest first as the rest.
                f"UPDATE {table} SET outbox_seq = numbered.seq FROM (SELECT ctid, nextval('{backfill}') AS seq"
                f" FROM (SELECT ctid FROM {table} WHERE outbox_seq IS NULL ORDER BY created_at DESC, ctid DESC"
                f" LIMIT {SILK_BACKFILL_BATCH}) AS batch) AS numbered WHERE {table}.ctid = numbered.ctid",
            ),
            repeat=True,
            remaining=f"SELECT count(*) FROM {table} WHERE outbox_seq IS NULL",
        ),
        Migration(
            f"checked {table}.outbox_seq is set on new rows",
            (
                f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {check}",
                f"ALTER TABLE {table} ADD CONSTRAINT {check} CHECK (outbox_seq IS NOT NULL) NOT VALID",
            ),
        ),
        Migration(
            f"checked {table}.outbox_seq is set on every row", (f"ALTER TABLE {table} VALIDATE CONSTRAINT {check}",)
        ),
        Migration(
            f"made {table}.outbox_seq NOT NULL",
            (
                f"ALTER TABLE {table} ALTER COLUMN outbox_seq SET NOT NULL",
                f"ALTER TABLE {table} DROP CONSTRAINT {check}",
            ),
        ),
        concurrent_step(
            f"dropped the backfill's index and sequence of {table}",
            (f"DROP INDEX CONCURRENTLY IF EXISTS {backfill_index}", f"DROP SEQUENCE IF EXISTS {backfill}"),
        ),
    ]
    first = {KEY_MISSING: 0, KEY_COLUMN: 1, KEY_DEFAULT: 2, KEY_LEFTOVERS: len(steps) - 1}.get(state, len(steps))
    return steps[first:]


async def plan_outbox(cur: Any, dialect: Dialect, profile: Profile) -> list[Migration]:
    """The migration plan of the profile's table (see :mod:`.profiles`)."""
    # refuses what its columns cannot hold, before anything changes
    fixes = [Migration(c, s, repeat=r) for c, s, r in await checked_fixes(cur, dialect, profile)]
    if profile.name == "silk":
        return await plan_silk(cur, dialect, profile) + fixes
    return await plan_v1(cur, dialect, profile) + fixes


async def run_plan(cur: Any, plan: list[Migration]) -> list[str]:
    """Run a plan's statements in the caller's transaction; return its changes."""
    for step in plan:
        for statement in step.statements:
            await cur.execute(statement)
    return [step.change for step in plan]


def required_columns(profile: Profile) -> tuple[str, ...]:
    """Every column room-outbox reads or writes in the profile's table (the start-up check)."""
    if profile.name == "silk":
        return (*REQUIRED_SILK_COLUMNS, *SILK_ADDED_COLUMNS)
    return (*REQUIRED_V1_COLUMNS, "worker_id", "lock_until_ms")
