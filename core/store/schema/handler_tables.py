"""Can a handler's tables hold what it writes? ``migrate`` (before it changes anything) and
``consume`` (at start) ask the same question here, of the tables the enabled handlers declare
(:class:`~room_outbox.handler.HandlerTable`).

A handler's ``CREATE TABLE IF NOT EXISTS`` keeps a table made beforehand as it is; a column
missing, narrower, of another type or character set, or a NOT NULL column the handler does not
write would fail events one at a time instead (PostgreSQL's errors name no column, and are
retried before they become dead letters). Each problem is one line naming the table, the column
and the fix. One is only warned about: a document column (an envelope, a payload) found with a
bound (the TEXT of ``room_activity`` tables made before it was LONGTEXT). MySQL/MariaDB widen a
TEXT only by copying the table, writes blocked meanwhile; only events bigger than the column
fail, each a dead letter at once naming the column and that statement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from room_outbox.handler import EXACT_COLLATION, HandlerColumn, HandlerTable
from room_outbox.store.dialect import Dialect
from room_outbox.store.schema.columns import Column, compares_exactly, inexact_note, printed_name, read_columns

#: Bytes of each integer type (MySQL's names and PostgreSQL's).
_INTEGER_BYTES = {"tinyint": 1, "smallint": 2, "mediumint": 3, "int": 4, "integer": 4, "bigint": 8}
_TEXTS = {"char", "varchar", "character", "character varying", "text", "tinytext", "mediumtext", "longtext"}
#: MySQL's TEXT types count bytes, and a character takes up to this many in the sets below.
_BYTES_PER_CHARACTER = 4
#: MySQL character sets that hold every character events carry (CJK, emoji): not latin1, not
#: utf8 (utf8mb3, three bytes at most).
_FULL_UNICODE = {"utf8mb4", "utf16", "utf16le", "utf32"}
#: A document column on MySQL holds at least MEDIUMTEXT's 16 MB: more than any envelope.
_DOCUMENT_BYTES = (1 << 24) - 1


@dataclass
class CheckedTables:
    """What the check found: problems that refuse the tables, warnings, the tables that do not
    exist yet (``migrate`` creates them), and each existing table as found (its text columns'
    bounds, for :meth:`HandlerTable.row`)."""

    refused: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    found: dict[str, HandlerTable] = field(default_factory=dict)


async def check_handler_tables(cur: Any, dialect: Dialect, tables: Sequence[HandlerTable]) -> CheckedTables:
    """Check each of ``tables`` that exists against the columns its handler writes, in the
    caller's transaction (SQLite: nothing, consumers do not run there)."""
    checked = CheckedTables()
    for table in tables:
        found = await read_columns(cur, dialect, table.name)
        if not found:
            if dialect.name in ("mysql", "postgresql"):
                checked.missing.append(table.name)
            continue
        columns, widen = {}, {}
        named = await printed_name(cur, dialect, table.name)  # as the fixes name it
        for name, wanted in table.columns.items():
            column = found.get(name)
            if column is None:
                checked.refused.append(
                    f"{table.name} lacks the column {name}, which its handler writes: run ALTER TABLE {named}"
                    f" ADD COLUMN {name} {_definition(wanted, dialect)}{_filler(wanted)}"
                )
                continue
            problem = _column_problem(table.name, wanted, column, dialect, named)
            if problem:
                checked.refused.append(problem)
            columns[name] = _as_found(wanted, column, dialect)
            if wanted.type == "text" and wanted.length is None and _bounded(columns[name]):
                widen[name] = _retype(named, wanted, column, dialect)
                bound = columns[name].max_bytes or columns[name].length
                unit = "bytes" if columns[name].max_bytes else "characters"
                checked.warnings.append(
                    f"{table.name}.{name} is {column.declared} ({bound} {unit}), and its handler writes documents"
                    f" up to an envelope's size there: an event whose {name} is longer becomes a dead letter;"
                    f" to hold every one, run {widen[name]}" + _COPY_NOTE.get(dialect.name, "")
                )
        checked.refused += _unwritten(table, found, dialect, named) + _narrow_charset(table, found, dialect)
        checked.warnings += _inexact(table, found, dialect, named)
        checked.found[table.name] = HandlerTable(table.name, columns, widen)
    return checked


_COPY_NOTE = {
    "mysql": " (MySQL and MariaDB change a TEXT type only by copying the table, writes blocked meanwhile:"
    " on a large table, plan it or use pt-online-schema-change)"
}


def _column_problem(table: str, wanted: HandlerColumn, column: Column, dialect: Dialect, named: str) -> str:
    """Why ``column`` cannot hold what the handler writes as ``wanted`` (its type, else its
    nullability), with the fix (naming the table ``named``), or ``""``."""
    where, fix = f"{table}.{column.name}", _retype(named, wanted, column, dialect)
    if wanted.type != "text":
        if _INTEGER_BYTES.get(column.kind, 0) < _INTEGER_BYTES[wanted.type]:
            return f"{where} is {column.declared}, and its handler writes {wanted.type.upper()} values there: run {fix}"
    elif column.kind not in _TEXTS:
        return f"{where} is {column.declared}, and its handler writes text there: run {fix}"
    elif wanted.length is not None:
        holds = _characters(column, dialect)
        if holds is not None and holds < wanted.length:
            return f"{where} holds {holds} characters, and its handler writes up to {wanted.length}: run {fix}"
    if wanted.nullable and not column.nullable:
        fix = _nullable(named, column, dialect)
        return f"{where} is NOT NULL, and its handler writes NULL there (an event without it): run {fix}"
    return ""


def _characters(column: Column, dialect: Dialect) -> int | None:
    """The characters a text column holds whatever they are (None: no bound)."""
    if dialect.name == "mysql" and column.kind.endswith("text") and column.length is not None:
        return column.length // _BYTES_PER_CHARACTER  # a TEXT type's length counts bytes
    return column.length


def _as_found(wanted: HandlerColumn, column: Column, dialect: Dialect) -> HandlerColumn:
    """``wanted`` with the bounds of the column found: what :meth:`HandlerTable.row` checks."""
    if wanted.type != "text":
        return dataclasses.replace(wanted, type="bigint" if _INTEGER_BYTES.get(column.kind) == 8 else wanted.type)
    if dialect.name == "mysql" and column.kind.endswith("text"):
        return dataclasses.replace(wanted, length=None, max_bytes=column.length)
    return dataclasses.replace(wanted, length=column.length if column.kind in _TEXTS else wanted.length)


def _bounded(found: HandlerColumn) -> bool:
    """Whether a document column, as found, holds less than any envelope."""
    return found.length is not None or (found.max_bytes is not None and found.max_bytes < _DOCUMENT_BYTES)


def _definition(wanted: HandlerColumn, dialect: Dialect) -> str:
    """``VARCHAR(64) NOT NULL``: the column's type and nullability as its handler makes it."""
    return " ".join(wanted.declaration(dialect.name).split())


def _filler(wanted: HandlerColumn) -> str:
    """The constant default of a NOT NULL column added to a table with rows (the rows have to
    hold something; a constant default changes the catalogue only)."""
    if wanted.nullable or (wanted.type == "text" and wanted.length is None):
        return ""  # a document: MySQL takes no literal default for a TEXT type
    return " DEFAULT ''" if wanted.type == "text" else " DEFAULT 0"


def _retype(table: str, wanted: HandlerColumn, column: Column, dialect: Dialect) -> str:
    """The statement that gives ``column`` the handler's type, and its nullability where the
    handler writes NULL."""
    if dialect.name == "mysql":
        return f"ALTER TABLE {table} MODIFY {column.name} {_definition(wanted, dialect)}"
    retype = f"ALTER TABLE {table} ALTER COLUMN {column.name} TYPE {_definition(wanted, dialect).split()[0]}"
    return f"{retype}, ALTER COLUMN {column.name} DROP NOT NULL" if wanted.nullable and not column.nullable else retype


def _nullable(table: str, column: Column, dialect: Dialect) -> str:
    """The statement that lets ``column`` hold NULL."""
    if dialect.name == "mysql":
        return f"ALTER TABLE {table} MODIFY {column.name} {column.declared} NULL"
    return f"ALTER TABLE {table} ALTER COLUMN {column.name} DROP NOT NULL"


def _unwritten(table: HandlerTable, found: dict[str, Column], dialect: Dialect, named: str) -> list[str]:
    """Columns the handler does not write that an INSERT cannot leave out (the fix naming the
    table ``named``)."""
    return [
        f"{table.name}.{column.name} is NOT NULL without a default, and its handler does not write it: every"
        f" event would fail; run {_nullable(named, column, dialect)} (or give it a default)"
        for column in found.values()
        if column.name not in table.columns and not column.nullable and column.default is None and not column.filled
    ]


def _narrow_charset(table: HandlerTable, found: dict[str, Column], dialect: Dialect) -> list[str]:
    """MySQL text columns in a character set that cannot hold every character, as one line."""
    narrow = [
        column
        for name, column in found.items()
        if name in table.columns and column.charset is not None and column.charset.lower() not in _FULL_UNICODE
    ]
    if dialect.name != "mysql" or not narrow:
        return []
    names = ", ".join(f"{column.name} ({column.charset})" for column in narrow)
    return [
        f"{table.name}'s columns {names} cannot hold every character events carry (CJK, emoji): run ALTER TABLE"
        f" {table.name} CONVERT TO CHARACTER SET utf8mb4 (a copy of the table)"
    ]


def _inexact(table: HandlerTable, found: dict[str, Column], dialect: Dialect, named: str) -> list[str]:
    """MySQL text columns the handler keys on (``exact``) in a collation that takes ids differing
    only in letter case for one, as one warning line: the change copies the table, so it is the
    operator's to plan (migrate makes changes online only)."""
    inexact = [
        found[name]
        for name, wanted in table.columns.items()
        if wanted.exact and name in found and not compares_exactly(found[name])
    ]
    if dialect.name != "mysql" or not inexact:
        return []
    modify = ", ".join(
        f"MODIFY {column.name} {column.declared} CHARACTER SET utf8mb4 COLLATE {EXACT_COLLATION}"
        f" {'NULL' if column.nullable else 'NOT NULL'}"
        for column in inexact
    )
    return [inexact_note(table.name, inexact, "written", f"ALTER TABLE {named} {modify}")]
