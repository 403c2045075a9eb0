"""Can this user read what ``migrate`` plans from? A plan is read from the catalogue, and the
catalogue shows a table's columns only to a user with a privilege on them (SELECT, INSERT,
UPDATE: MySQL/MariaDB's CREATE, ALTER, INDEX and DROP are not among them, and PostgreSQL's
``information_schema`` hides the table whole). A plan made from what such a user sees takes a
table already there for missing (``would create table room_outbox``) and a column already
there for one to add, and fails half-way on ``Duplicate column name``. So such a user is
refused before the plan is made, naming the privilege (:func:`check_readable`).

A plan also writes rows (the room buckets, the lanes' hand-overs): on MySQL/MariaDB each of
those statements on room-outbox's own tables is first tried on no row, so a user who may not
run one is refused before the plan's first change rather than after it (:func:`check_writable`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from room_outbox.errors import StoreUnavailable
from room_outbox.store.dialect import Dialect, column_names, table_names

if TYPE_CHECKING:
    from room_outbox.store.schema.outbox import Migration

#: MySQL/MariaDB's refusals of a privilege on a table (1142) or a column (1143).
_DENIED = (1142, 1143)
_NO_SUCH_TABLE = 1146
#: The names of room-outbox's own tables (besides the profile's outbox table).
_OURS = ("room_outbox", "room_consumer")

#: What ``migrate`` needs, per database: said in every refusal of this module.
MIGRATE_NEEDS = {
    "mysql": "migrate needs SELECT, INSERT, UPDATE and DELETE on the outbox table and room-outbox's own,"
    " besides CREATE, ALTER, INDEX and DROP on the database: it reads the tables and the catalogue, fills"
    " the room bucket table in, backfills NULLs and carries lanes' rows over",
    "postgresql": "migrate needs CREATE on the schema, to own the outbox table, and SELECT, INSERT, UPDATE and"
    " DELETE on room-outbox's own tables where another role made them",
}


async def check_readable(cur: Any, dialect: Dialect, outbox: str) -> None:
    """Raise :class:`StoreUnavailable` naming each of room-outbox's tables (``outbox``, the
    profile's outbox table, among them) that exists and that this user may not read, before
    any plan is read from the catalogue. SQLite has no privileges."""
    if dialect.name == "mysql":
        unreadable = await _mysql_unreadable(cur, dialect, outbox)
    elif dialect.name == "postgresql":
        unreadable = await _postgresql_unreadable(cur, outbox)
    else:
        return
    if unreadable:
        them, hold = ("it", "it holds") if len(unreadable) == 1 else ("them", "they hold")
        raise StoreUnavailable(
            f"this user may not read {', '.join(unreadable)}, and the catalogue hides from it what {hold},"
            f" so migrate cannot tell what to change: grant SELECT on {them} to the user in database.dsn, or run"
            f" migrate as one who has it ({MIGRATE_NEEDS[dialect.name]}); nothing was changed"
        )


#: A plan's statement that writes rows: its kind, its table and the first column it names.
_WRITES = re.compile(
    r"^\s*(?:(INSERT)\s+INTO\s+`?(\w+)`?\s*\(\s*`?(\w+)"
    r"|(UPDATE)\s+`?(\w+)`?(?:\s+FORCE\s+INDEX\s*\([^)]*\))?\s+SET\s+`?(\w+)"
    r"|(DELETE)\s+FROM\s+`?(\w+)`?())",
    re.I,
)


async def check_writable(cur: Any, dialect: Dialect, outbox: str, plan: Sequence[Migration]) -> None:
    """Raise :class:`StoreUnavailable` naming each write of ``plan`` (MySQL/MariaDB) to
    room-outbox's own tables the user may not make, found by the same statement on no row: the
    server checks the privilege first, also on a table an earlier step creates. Any other answer
    (a table or column still to be made, a read-only server) leaves the statement to the plan.
    The outbox table (``outbox``), room-service's, is left out: a statement on it would wait
    behind whatever holds that table, in the plan's transaction."""
    if dialect.name != "mysql":
        return
    tried: set[tuple[str, str]] = set()
    denied: list[str] = []
    for step in plan:
        for statement in step.statements:
            match = _WRITES.match(statement)
            if match is None:
                continue
            kind, table, column = (part for part in match.groups() if part is not None)
            kind = kind.upper()
            if (kind, table.lower()) in tried or table.lower() == outbox.lower() or not table.startswith(_OURS):
                continue
            tried.add((kind, table.lower()))
            probe = {
                "INSERT": f"INSERT INTO {table} ({column}) SELECT NULL FROM DUAL WHERE 1 = 0",
                "UPDATE": f"UPDATE {table} SET {column} = {column} WHERE 1 = 0",
                "DELETE": f"DELETE FROM {table} WHERE 1 = 0",
            }[kind]
            try:
                await cur.execute(probe)
            except Exception as exc:  # the driver's error: its number says whether it is a privilege
                if exc.args and exc.args[0] in _DENIED:
                    denied.append(f"{kind} on {table}")
    if denied:
        raise StoreUnavailable(
            f"this user may not run {', '.join(denied)}, which migrate needs for the changes it would make:"
            f" grant it to the user in database.dsn, or run migrate as one who has it"
            f" ({MIGRATE_NEEDS[dialect.name]}); nothing was changed"
        )


async def _mysql_unreadable(cur: Any, dialect: Dialect, outbox: str) -> list[str]:
    """The outbox table and room-outbox's own that the catalogue lists without a column (a user
    whose privileges on them are CREATE, ALTER, INDEX or DROP alone), and the outbox table when
    the catalogue does not list it and a read of no row is refused (the server checks the
    privilege before it looks for the table). Nothing is read from a table the user may read:
    room-service's table is never locked by the plan, even for a moment."""
    listed = await table_names(cur, dialect)
    ours = sorted(t for t in listed if t.startswith(_OURS) and t != outbox.lower())
    unreadable = [t for t in [outbox, *ours] if t.lower() in listed and not await column_names(cur, dialect, t)]
    if outbox.lower() not in listed:
        try:
            await cur.execute(f"SELECT * FROM {outbox} LIMIT 0")
            await cur.fetchall()
        except Exception as exc:  # the driver's error: its number says whether it is a privilege
            code = exc.args[0] if exc.args else None
            if code in _DENIED:
                unreadable.insert(0, outbox)
            elif code != _NO_SUCH_TABLE:  # not there: the plan creates it
                raise
    return unreadable


async def _postgresql_unreadable(cur: Any, outbox: str) -> list[str]:
    """The tables of the session's first schema, room-outbox's or ``outbox``, that the role may
    not read (``pg_class`` lists every table to every role)."""
    await cur.execute(
        "SELECT c.relname FROM pg_class c WHERE c.relnamespace = current_schema()::regnamespace"
        " AND c.relkind IN ('r', 'p') AND (c.relname = %s OR c.relname LIKE 'room\\_outbox%%'"
        " OR c.relname LIKE 'room\\_consumer%%') AND NOT has_table_privilege(c.oid, 'SELECT') ORDER BY c.relname",
        (outbox,),
    )
    names = [str(row[0]) for row in await cur.fetchall()]
    return sorted(names, key=lambda name: name != outbox)
