"""Indexes on a PostgreSQL partitioned table (``PARTITION BY``), built online.

PostgreSQL refuses ``CREATE INDEX CONCURRENTLY`` on a partitioned table, and a plain
``CREATE INDEX`` there blocks every write while it reads all the partitions. The online way,
one statement at a time:

1. the index on the partitioned table alone (``ON ONLY``): nothing to read, so its lock that
   blocks writes lasts a moment; the index stays invalid (unused) for now;
2. each partition's own index, built ``CONCURRENTLY`` (on a partition that is itself
   partitioned, ``ON ONLY`` again);
3. each partition's index attached to its parent's, from the leaves up: no lock that stops
   writes. With the last one the parent's index becomes valid; partitions created later get
   theirs as they are created.

Every statement is idempotent, so a rerun takes up where an interrupted one stopped: an
interrupted ``CONCURRENTLY`` build leaves an invalid index on its partition, which
:func:`~room_outbox.store.schema.outbox.invalid_index_steps` drops first.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Any

from room_outbox.errors import SchemaError

#: PostgreSQL's longest identifier, in bytes (NAMEDATALEN - 1).
MAX_IDENTIFIER = 63


@dataclass(frozen=True)
class Partition:
    name: str
    #: The partitioned table (or partition) it belongs to.
    parent: str
    #: Holds rows (not partitioned itself).
    leaf: bool


async def partitions_of(cur: Any, table: str) -> list[Partition] | None:
    """``table``'s partitions, all levels, parents before their own; None when ``table`` is
    not partitioned (or not there)."""
    await cur.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", (table,))
    kind = await cur.fetchone()
    if kind is None or kind[0] != "p":
        return None
    await cur.execute(
        "SELECT c.relname, p.relname, t.isleaf, c.relnamespace = p.relnamespace"
        " FROM pg_partition_tree(to_regclass(%s)) t"
        " JOIN pg_class c ON c.oid = t.relid JOIN pg_class p ON p.oid = t.parentrelid"
        " WHERE t.level > 0 ORDER BY t.level, c.relname",
        (table,),
    )
    partitions = []
    for name, parent, leaf, same_schema in await cur.fetchall():
        if not same_schema:  # the statements name partitions and their indexes unqualified
            raise SchemaError(
                f"partition {name} of table {table} is in a schema of its own; migrate builds indexes on"
                " partitions in their table's schema only"
            )
        partitions.append(Partition(str(name), str(parent), bool(leaf)))
    return partitions


def index_statements(
    table: str, name: str, columns: str, partitions: list[Partition] | None, unique: bool = False
) -> tuple[str, ...]:
    """The statements that build index ``name`` on ``columns`` (``(a, b)``) of ``table``
    while writes go on: one ``CREATE INDEX CONCURRENTLY`` on a plain table (``partitions``
    None); on a partitioned one, the three stages of this module's rule."""
    kind = "UNIQUE INDEX" if unique else "INDEX"
    if partitions is None:
        return (f"CREATE {kind} CONCURRENTLY IF NOT EXISTS {name} ON {table} {columns}",)
    index_of = {table: name} | {p.name: partition_index(name, table, p.name) for p in partitions}
    builds = [f"CREATE {kind} IF NOT EXISTS {name} ON ONLY {table} {columns}"]
    for p in partitions:
        how = "CONCURRENTLY IF NOT EXISTS" if p.leaf else "IF NOT EXISTS"
        only = "" if p.leaf else "ONLY "
        builds.append(f"CREATE {kind} {how} {quoted(index_of[p.name])} ON {only}{quoted(p.name)} {columns}")
    attaches = [
        f"ALTER INDEX {quoted(index_of[p.parent])} ATTACH PARTITION {quoted(index_of[p.name])}"
        for p in reversed(partitions)
    ]
    return (*builds, *attaches)


def partition_index(name: str, table: str, partition: str) -> str:
    """The name of index ``name``'s part on ``partition``: the table's name in it replaced by
    the partition's (``idx_room_outbox_claim`` → ``idx_room_outbox_2026_claim``), or a
    checksum in place of what goes beyond PostgreSQL's longest name (which it would cut,
    making two partitions' names one)."""
    wanted = name.replace(table, partition, 1) if table in name else f"{name}_{partition}"
    if len(wanted.encode()) <= MAX_IDENTIFIER:
        return wanted
    suffix = f"_{zlib.crc32(wanted.encode()):08x}"
    return wanted.encode()[: MAX_IDENTIFIER - len(suffix)].decode(errors="ignore") + suffix


def quoted(name: str) -> str:
    """``name`` as an SQL identifier: as it is when PostgreSQL would read it unchanged, else
    in double quotes (capitals, spaces, a leading digit)."""
    if re.fullmatch(r"[a-z_][a-z0-9_$]*", name):
        return name
    return '"' + name.replace('"', '""') + '"'
