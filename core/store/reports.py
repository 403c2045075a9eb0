"""Read-only queries over the outbox table (its profile's names) for health checks, metrics,
operators and the demo: what the tables say, never a change. Every statement is one all
stores speak.

Queries that run often stay on an index: :func:`sample_backlog` (the metrics timer) is a range
count on the (status, id) index plus one primary-key lookup."""

from __future__ import annotations

from dataclasses import dataclass

from room_outbox.store.factory import SQLStore
from room_outbox.store.leased import now_ms


async def ping(store: SQLStore) -> None:
    """One round trip: raises when the database does not answer (the readiness check)."""
    async with store.transaction() as cur:
        await cur.execute("SELECT 1")


async def count_by_status(store: SQLStore, event_id_prefix: str) -> dict[str, int]:
    """How many rows whose event_id starts with the prefix are in each status."""
    p = store.profile
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT status, COUNT(*) FROM {p.table} WHERE {p.event_id} LIKE %s GROUP BY status",
            (f"{event_id_prefix}%",),
        )
        return {str(status): int(count) for status, count in await cur.fetchall()}


async def status_by_event(store: SQLStore, event_id_prefix: str) -> dict[str, str]:
    """The status of every row whose event_id starts with the prefix, by event_id."""
    p = store.profile
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT {p.event_id}, status FROM {p.table} WHERE {p.event_id} LIKE %s", (f"{event_id_prefix}%",)
        )
        return {str(event_id): str(status) for event_id, status in await cur.fetchall()}


@dataclass(frozen=True)
class Backlog:
    pending: int
    #: Age of the lowest-id pending row (ids rise with inserts, so it is the oldest but for
    #: transactions that committed late); 0 when nothing is pending.
    oldest_pending_age_ms: int


async def sample_backlog(store: SQLStore) -> Backlog:
    """Pending count and oldest pending age: both read only the index range of pending rows
    and one row by primary key, however many published rows the table holds."""
    table, open_ = store.profile.table, store.profile.is_open()
    async with store.transaction() as cur:
        await cur.execute(f"SELECT COUNT(*) FROM {table} WHERE {open_}")
        (pending,) = await cur.fetchone()
        await cur.execute(
            f"SELECT {store.profile.as_ms(store.profile.created)} FROM {table} WHERE {open_}"
            f" ORDER BY {store.profile.key} LIMIT 1"
        )
        oldest = await cur.fetchone()
    age = max(0, now_ms() - int(oldest[0])) if oldest else 0
    return Backlog(int(pending), age)
