"""Reads of the outbox's rows of some statuses, bounded by those rows however many others the
table holds: the backlog's count and oldest row (the metrics timer, ``status``, ``lanes``), the
status report's samples (retry counts, errors), ``requeue``'s selections.

Left to choose, an optimizer may answer ``WHERE status = 'pending' ORDER BY id LIMIT n`` by
walking the primary key from the lowest id and stopping at the first ``n`` pending rows it
meets: cheap by its estimates, which spread the pending rows evenly over the ids; in fact a
read of every published row below the first pending one, millions of them when the pending
rows are the newest. So these reads are kept on an index that starts with ``status``: named in
the statement where the database takes a hint (MySQL/MariaDB's ``FORCE INDEX``, SQLite's
``INDEXED BY``: room-service's ``(status, id)`` index, which holds each status's rows in key
order, where the table has it, else the claim's, ``migrate``'s, whose range of a status holds
its rows too), and on PostgreSQL, which takes no hint, by ordering on ``(status, key)`` with
the statuses written as an array (an equality would make ``status`` a constant the planner
drops from the order, leaving the primary key's order), with whole-table scans off for the
transaction (a table scan, the planner's choice once the statuses' rows look many, reads every
published row too).

A read of a status's first ``n`` rows in key order (:meth:`StatusRead.first_rows`) then reads ``n`` rows
of the ``(status, id)`` index however many the status has; without that index it reads every
row of the status (the claim's index holds them by due time) and keeps the first ``n``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from room_outbox.store.dialect import index_names
from room_outbox.store.schema.outbox import STATUS_INDEX, claim_index

if TYPE_CHECKING:
    from room_outbox.store.protocol import SQLStore


@dataclass(frozen=True)
class StatusRead:
    """How a statement reads rows of some statuses of the outbox table (its profile's)."""

    #: FROM's table, with the hint that keeps the read on a status index where the database
    #: takes one.
    source: str
    #: ORDER BY's columns for "in key order".
    order_columns: tuple[str, ...]
    #: SQL template: the status is one of ``{quoted}`` / ``{bare}`` (see Dialect.status_in).
    status_in: str

    def order(self, descending: bool = False) -> str:
        """ORDER BY's expression for "in key order" (highest keys first when ``descending``)."""
        return ", ".join(f"{column}{' DESC' if descending else ''}" for column in self.order_columns)

    def of_statuses(self, statuses: Sequence[str]) -> str:
        """SQL: the row is in one of ``statuses`` (constants, never input), written so that the
        read keeps the status index and its order."""
        return self.status_in.format(quoted=", ".join(f"'{status}'" for status in statuses), bare=",".join(statuses))

    def first_rows(self, columns: str, status: str, where: Sequence[str] = (), descending: bool = False) -> str:
        """SQL: ``columns`` of the first rows of ``status`` in key order (the last with
        ``descending``) that also meet ``where``, as many as the one ``%s`` after ``where``'s
        own parameters: a walk of the status index that stops there (see this module's docstring)."""
        conditions = " AND ".join([self.of_statuses((status,)), *where])
        return f"SELECT {columns} FROM {self.source} WHERE {conditions} ORDER BY {self.order(descending)} LIMIT %s"


async def status_read(cur: Any, store: SQLStore) -> StatusRead:
    """:class:`StatusRead` for ``store``'s outbox table, from the indexes it has now; on
    PostgreSQL, the rest of ``cur``'s transaction plans without whole-table scans."""
    p = store.profile
    if store.dialect.status_read_setup:
        await cur.execute(store.dialect.status_read_setup)
    hint = ""
    if store.dialect.status_index_hint:
        indexes = await index_names(cur, store.dialect, p.table)
        for index in (STATUS_INDEX.format(table=p.table), claim_index(p.table)[0]):
            if index.lower() in indexes:
                hint = store.dialect.status_index_hint.format(index=index)
                break
    order = tuple(column.format(key=p.key) for column in store.dialect.status_order)
    return StatusRead(f"{p.table}{hint}", order, store.dialect.status_in)


async def open_rows(cur: Any, store: SQLStore) -> tuple[int, int | None]:
    """How many rows are open (still to deliver) and ``created_at_ms`` of the lowest-key one,
    the oldest (None: none is open). One read of the open rows' index range counts them and
    finds the lowest key at once (with the count, no planner turns the lowest key into an
    ordered walk of the primary key), then that one row is read by key."""
    p = store.profile
    read = await status_read(cur, store)
    await cur.execute(f"SELECT COUNT(*), MIN({p.key}) FROM {read.source} WHERE {p.is_open()}")
    count, lowest = await cur.fetchone()
    if lowest is None:
        return int(count), None
    await cur.execute(f"SELECT {p.as_ms(p.created)} FROM {p.table} WHERE {p.key} = %s", (lowest,))
    found = await cur.fetchone()
    return int(count), None if found is None else int(found[0])
