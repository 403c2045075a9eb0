"""Is the schema migrated? ``run`` asks once at start, before any worker claims a row.

A table that was never migrated would otherwise let the process start, report ready and fail
every round on a missing column. The check reads the catalogue only (the dialect's catalogue
query: ``information_schema`` or SQLite's ``pragma_table_info``) and names the first thing
missing together with the fix, then whether the columns can hold what room-outbox writes. The
outbox table is the profile's (``database.profile``).
"""

from __future__ import annotations

from collections.abc import Sequence

from room_outbox.errors import SchemaError
from room_outbox.store.dialect import column_names
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.buckets import BUCKET_COLUMN, BUCKET_TABLE, NODE_TABLE
from room_outbox.store.schema.columns import check_columns
from room_outbox.store.schema.lanes import CURSOR_TABLE, lane_table
from room_outbox.store.schema.outbox import required_columns
from room_outbox.store.schema.tail import PARKED_TABLE

#: Columns of a lane's own table that its statements read or write.
LANE_COLUMNS = ("outbox_id", "status", "retry_count", "last_error", "worker_id", "lock_until_ms")

_FIX = "run `room-outbox migrate`"


async def check_schema(
    store: SQLStore, lanes: Sequence[str] = (), claim_ids: int = 0, tail_lanes: Sequence[str] = ()
) -> None:
    """Raise :class:`SchemaError` unless the outbox table has every column room-outbox uses,
    each able to hold what room-outbox writes there (:mod:`.column_checks`, the check
    ``migrate`` makes too; ``claim_ids``: how long this process's claim ids, which ``worker_id``
    holds, may grow), and each lane in ``lanes`` (enabled sinks with a lane of their own) has
    its table; tailing lanes (``tail_lanes``) need the cursor and parked tables."""
    # On a server: the processes' membership and the room buckets (SQLite runs without them)
    server = store.dialect.room_buckets
    # The bucket column where the dialect reads one (PostgreSQL computes the bucket instead)
    bucket = (BUCKET_COLUMN,) if server and store.dialect.row_bucket == BUCKET_COLUMN else ()
    required = {store.profile.table: (*required_columns(store.profile), *bucket)}
    if lanes:
        required[CURSOR_TABLE] = ("lane", "fed_through_id")
        required.update({lane_table(lane): (*LANE_COLUMNS, *bucket) for lane in lanes})
    if tail_lanes:
        required[CURSOR_TABLE] = ("lane", "fed_through_id")
        required[PARKED_TABLE] = ("lane", "outbox_id", "status", "last_error")
    if server:
        required[NODE_TABLE] = ("node_id", "heartbeat_ms", "view", "view_since_ms")
        required[BUCKET_TABLE] = ("bucket", "owner", "handing_over", "claimable_from_ms")
    # What the columns can hold comes first: migrate refuses it before adding anything missing
    async with store.transaction() as cur:
        await check_columns(cur, store.dialect, store.profile, claim_ids)
    found = await _columns(store, list(required))
    for table, columns in required.items():
        have = found.get(table, set())
        if not have:
            raise SchemaError(f"table {table} does not exist: {_FIX}")
        missing = [column for column in columns if column not in have]
        if missing:
            raise SchemaError(f"table {table} lacks {', '.join(missing)}: {_FIX}")


async def _columns(store: SQLStore, tables: list[str]) -> dict[str, set[str]]:
    """Column names (lower case) of each of ``tables`` that exists."""
    found: dict[str, set[str]] = {}
    async with store.transaction() as cur:
        for table in tables:
            columns = set(await column_names(cur, store.dialect, table))
            if columns:
                found[table] = columns
    return found
