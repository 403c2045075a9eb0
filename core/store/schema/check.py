"""Is the schema migrated? ``run`` asks once at start, before any worker claims a row.

A table that was never migrated would otherwise let the process start, report ready and fail
every round on a missing column or index. The check reads the catalogue only (the dialect's
catalogue query: ``information_schema`` or SQLite's ``pragma_table_info``) and names the first
thing missing together with the fix, then whether the columns can hold what room-outbox writes.
The outbox table is the profile's (``database.profile``).

A table that loses them later, swapped under a running process for a copy built without them
(gh-ost's or pt-online-schema-change's ``RENAME TABLE``, from room-service's own schema file or
without room-outbox's indexes), fails the rounds where a statement names what is gone: the
store's transactions turn that failure into the same fix
(:func:`~room_outbox.store.backends.errors.named_fix`). An index no statement forces is not
missed by the database, which scans the whole table instead: the running process repeats
:func:`check_indexes` now and then for that (:meth:`~room_outbox.observability.health.Health.watch_schema`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from room_outbox.errors import SchemaError
from room_outbox.store.dialect import IndexNames, column_names, index_names
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.buckets import BUCKET_TABLE, BUCKETS, missing_buckets
from room_outbox.store.schema.columns import check_columns, row_security_notice, sequence_problems
from room_outbox.store.schema.lanes import lane_table
from room_outbox.store.schema.outbox import require_producer_columns, taken_index_names
from room_outbox.store.schema.registry import WantedSchema, required_columns, required_indexes
from room_outbox.store.schema.tail import handed_back_problems

log = logging.getLogger("room_outbox.store")

_FIX = "run `room-outbox migrate`"


async def check_schema(
    store: SQLStore, lanes: Sequence[str] = (), claim_ids: int = 0, tail_lanes: Sequence[str] = ()
) -> None:
    """Raise :class:`SchemaError` unless the outbox table has every column room-outbox uses,
    each able to hold what room-outbox writes there (:mod:`.column_checks`, the check
    ``migrate`` makes too; ``claim_ids``: how long this process's claim ids, which ``worker_id``
    holds, may grow), and each lane in ``lanes`` (enabled sinks with a lane of their own) has
    its table; tailing lanes (``tail_lanes``) need the cursor and parked tables: the registry's
    required columns (:func:`.registry.required_columns`), and no table of their own left from
    before they tailed (``migrate`` hands over from it); lanes back from tailing, no entries left
    in the tailing lanes' parked table (``migrate`` carries them over). The outbox table needs the indexes its
    statements read by name too (:func:`.registry.required_indexes`); on PostgreSQL, one whose
    name another table's index holds is named with that table (``migrate`` refuses to build it)."""
    wanted = WantedSchema(lanes=tuple(lanes) if lanes else None, tail_lanes=tuple(tail_lanes))
    required = required_columns(store.dialect, store.profile, wanted)
    # What the columns can hold comes first: migrate refuses it before adding anything missing
    async with store.transaction() as cur:
        await check_columns(cur, store.dialect, store.profile, claim_ids)
        refused = await sequence_problems(cur, store.dialect, store.profile) if lanes or tail_lanes else []
        # A lane back from tailing whose switch migrate has not made whole: its table would feed
        # and send the events an operator cancelled while it tailed.
        refused += await handed_back_problems(cur, store.dialect, lanes)
        row_security = await row_security_notice(cur, store.dialect, store.profile)
        indexes = await index_names(cur, store.dialect, store.profile.table)
    if row_security:
        log.warning(row_security)
    found = await _columns(store, list(required))
    # Another table, or another producer's: migrate refuses it in these words, so "run migrate"
    # would not do. (A table not there at all is migrate's to create: said below.)
    if found.get(store.profile.table):
        require_producer_columns(store.profile, found[store.profile.table])
    if refused:
        raise SchemaError("\n".join(refused))
    for table, columns in required.items():
        have = found.get(table, set())
        if not have:
            raise SchemaError(f"table {table} does not exist: {_FIX}")
        missing = [column for column in columns if column not in have]
        if missing:
            raise SchemaError(f"table {table} lacks {', '.join(missing)}: {_FIX}")
    await _check_indexes(store, indexes)
    if BUCKET_TABLE in required:
        async with store.transaction() as cur:
            unowned = await missing_buckets(cur)
        if unowned:
            raise SchemaError(
                f"table {BUCKET_TABLE} lacks the rows of {len(unowned)} of its {BUCKETS} room buckets (a migrate"
                f" stopped half-way): no process would ever take those rooms' events; {_FIX}, which adds them"
            )
    # A lane switched to tailing hands over from its old table in migrate, which drops it: run
    # before that, it would go on from a cursor that the table's unsent rows are not behind yet.
    left = await _columns(store, [lane_table(lane) for lane in tail_lanes])
    for lane in tail_lanes:
        if lane_table(lane) in left:
            raise SchemaError(
                f"table {lane_table(lane)} is still there: lane {lane} ran on it before it tailed room_outbox;"
                f" {_FIX} (it moves the lane's cursor back to the table's first row still owed, keeps the rows it"
                " parked, and drops the table)"
            )


async def check_indexes(store: SQLStore) -> None:
    """Raise :class:`SchemaError` unless the outbox table has the indexes its statements read by
    name (:func:`.registry.required_indexes`): :func:`check_schema`'s index part, one catalogue
    query while they are all there, for a running process to repeat."""
    async with store.transaction() as cur:
        indexes = await index_names(cur, store.dialect, store.profile.table)
    await _check_indexes(store, indexes)


async def _check_indexes(store: SQLStore, indexes: IndexNames) -> None:
    """Raise :class:`SchemaError` naming those of the outbox table's required indexes not among
    ``indexes`` (its indexes' names, lower case) and the fix."""
    table = store.profile.table
    missing = [index for index in required_indexes(store.profile) if index not in indexes]
    if not missing:
        return
    # migrate refuses to build one whose name another table's index holds: say that fix now
    async with store.transaction() as cur:
        taken = await taken_index_names(cur, store.dialect, [(index, table.lower()) for index in missing])
    if taken:
        raise SchemaError("\n".join(f"table {table} lacks the index {index}: {why}" for index, why in taken.items()))
    which = "the index" if len(missing) == 1 else "the indexes"
    raise SchemaError(f"table {table} lacks {which} {', '.join(missing)}: {_FIX}")


async def _columns(store: SQLStore, tables: list[str]) -> dict[str, set[str]]:
    """Column names (lower case) of each of ``tables`` that exists."""
    found: dict[str, set[str]] = {}
    async with store.transaction() as cur:
        for table in tables:
            columns = set(await column_names(cur, store.dialect, table))
            if columns:
                found[table] = columns
    return found
