"""Read-only queries over the outbox table (its profile's names) for health checks and the
demo: what the table says, never a change. Every statement is one all stores speak."""

from __future__ import annotations

from room_outbox.store.factory import SQLStore


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
