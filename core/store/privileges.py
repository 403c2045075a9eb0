"""May this process's database user do what it will do there? ``run`` asks once at start, with
the schema check (``status`` and ``lanes`` too, to say that ``run`` would refuse).

A user with fewer privileges than ``run`` needs (SELECT alone, a grant on the outbox table but
not on room-outbox's own tables) would otherwise let the process start and report nothing
wrong but a failed round, every round, delivering nothing. A server that takes no writes (a
standby, a database set read-only) the same. So both are refused before any worker starts,
naming each table and the privileges it lacks there, or why the server takes no writes.

A table that is not there is left to the schema check, which names the fix (``migrate``). On
PostgreSQL the catalogue shows every table whatever the user's privileges, and says which it
holds (``has_table_privilege``; a grant on columns counts, as the statements name theirs). On
MySQL/MariaDB the catalogue shows only the tables the user holds a privilege on, so each
privilege is tried instead, with a statement that matches no row (``WHERE 1 = 0``): the server
checks the privilege, and refuses a write on a read-only server, before it looks for rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from room_outbox.errors import PrivilegeError
from room_outbox.store.backends.errors import mysql_error, privileges_needed, refuses_writes
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.registry import WantedSchema, required_columns

#: The privileges on a table of room-outbox's own that a process claiming rows needs.
READ_WRITE = ("SELECT", "INSERT", "UPDATE", "DELETE")

#: MySQL/MariaDB: a privilege refused (on the table, on a column), a table not there, and a
#: write refused by a read-only server or transaction.
_DENIED = (1142, 1143)
_NO_SUCH_TABLE = 1146
_NO_SUCH_COLUMN = 1054
#: A column without a default left out of an INSERT: said after the privilege passed.
_NO_DEFAULT = 1364
_READ_ONLY = (1290, 1792, 1836)


def needed_by_run(
    store: SQLStore, lane_tables: Sequence[str], tail_lanes: Sequence[str], main_lane: bool, claims: bool
) -> dict[str, tuple[str, tuple[str, ...]]]:
    """What ``run`` needs on each table the schema check requires (lanes of their own in
    ``lane_tables``, tailing ones in ``tail_lanes``), with a column of it for MySQL's tries:
    where it claims rows (``claims``), SELECT and UPDATE on the outbox table where the main lane
    runs (its claims and results update the rows; retention's DELETE, a job that survives
    failed passes, is left to it) and SELECT alone where it does not (the lanes read it), and
    SELECT, INSERT, UPDATE and DELETE on room-outbox's own; without claims, SELECT."""
    wanted = WantedSchema(lanes=tuple(lane_tables) if lane_tables else None, tail_lanes=tuple(tail_lanes))
    needed: dict[str, tuple[str, tuple[str, ...]]] = {}
    for table, columns in required_columns(store.dialect, store.profile, wanted).items():
        column = "worker_id" if "worker_id" in columns else columns[-1]
        if not claims:
            needed[table] = (column, ("SELECT",))
        elif table == store.profile.table:
            needed[table] = (column, ("SELECT", "UPDATE") if main_lane else ("SELECT",))
        else:
            needed[table] = (column, READ_WRITE)
    return needed


async def check_privileges(
    store: SQLStore, needed: Mapping[str, tuple[str, Sequence[str]]], where: str, command: str = "run"
) -> None:
    """Raise :class:`PrivilegeError` naming every table of ``needed`` (table → a column of it
    and the privileges needed there) whose privileges the user lacks, or, where a write is
    needed, that the server takes none. ``where`` names the store as messages do, ``command``
    the command that needs them."""
    if store.dialect.name == "sqlite":
        return
    writes = any(privilege != "SELECT" for _, privileges in needed.values() for privilege in privileges)
    async with store.transaction() as cur:
        if store.dialect.name == "postgresql":
            read_only = await _postgres_read_only(cur) if writes else None
            missing = {
                table: await _postgres_missing(cur, table, privileges) for table, (_, privileges) in needed.items()
            }
        else:
            read_only = None
            missing = {}
            for table, (column, privileges) in needed.items():
                missing[table], read_only_reason = await _mysql_missing(cur, table, column, privileges)
                read_only = read_only or read_only_reason
    if read_only:
        raise PrivilegeError(str(refuses_writes(where, read_only)))
    lacks = {table: privileges for table, privileges in missing.items() if privileges}
    if lacks:
        what = "; ".join(f"{', '.join(privileges)} on {table}" for table, privileges in lacks.items())
        them = "it" if sum(len(privileges) for privileges in lacks.values()) == 1 else "them"
        raise PrivilegeError(
            f"{where} lacks privileges `{command}` needs: {what}; {privileges_needed(store.dialect.name, them)}"
        )


async def _postgres_missing(cur: Any, table: str, privileges: Sequence[str]) -> list[str]:
    """Those of ``privileges`` the user holds neither on ``table`` nor on any of its columns
    (none when the search path finds no such table)."""
    await cur.execute(
        "SELECT p FROM (SELECT to_regclass(%s) AS t) AS found, unnest(%s::text[]) WITH ORDINALITY AS wanted (p, n)"
        " WHERE t IS NOT NULL AND NOT has_table_privilege(t, p)"
        " AND (p = 'DELETE' OR NOT has_any_column_privilege(t, p)) ORDER BY n",
        (table, list(privileges)),
    )
    return [str(row[0]) for row in await cur.fetchall()]


async def _postgres_read_only(cur: Any) -> str | None:
    """Why the server takes no writes in this session's transactions, or None. Its sessions
    override the role's own read-only default (:func:`.backends.postgres.role_read_only`), not a
    database's or the server's."""
    await cur.execute(
        "SELECT current_setting('transaction_read_only') = 'on', pg_is_in_recovery(), source"
        " FROM pg_settings WHERE name = 'default_transaction_read_only'"
    )
    read_only, in_recovery, source = await cur.fetchone()
    if not read_only:
        return None
    if in_recovery:
        return "the server is a standby (in recovery)"
    return f"default_transaction_read_only is on for the {'database' if source == 'database' else 'server'} ({source})"


async def _mysql_missing(cur: Any, table: str, column: str, privileges: Sequence[str]) -> tuple[list[str], str | None]:
    """Those of ``privileges`` the server refuses on ``table`` (none when there is no such table,
    or it lacks ``column``), and the server's words where it refuses a write as read-only."""
    tries = {
        "SELECT": f"SELECT 1 FROM {table} WHERE 1 = 0",
        "INSERT": f"INSERT INTO {table} ({column}) SELECT NULL FROM DUAL WHERE 1 = 0",
        "UPDATE": f"UPDATE {table} SET {column} = NULL WHERE 1 = 0",
        "DELETE": f"DELETE FROM {table} WHERE 1 = 0",
    }
    lacking: list[str] = []
    for privilege in privileges:
        try:
            await cur.execute(tries[privilege])
        except Exception as exc:
            if mysql_error(exc, _NO_SUCH_TABLE, _NO_SUCH_COLUMN):  # the schema check names the fix
                return [], None
            if mysql_error(exc, _NO_DEFAULT):
                continue
            if mysql_error(exc, *_READ_ONLY) and "read" in str(exc.args[1]).lower():
                return lacking, str(exc.args[1])
            if not mysql_error(exc, *_DENIED):
                raise
            lacking.append(privilege)
    return lacking, None
