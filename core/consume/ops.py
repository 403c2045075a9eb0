"""What the operator commands read about the consumers from the database (any host can run
them); their printing is :mod:`room_outbox.cli.consumers`'."""

from __future__ import annotations

from typing import Any

from room_outbox.store.consumers.sql import SQLConsumerStore
from room_outbox.store.factory import consumer_store
from room_outbox.store.protocol import SQLStore


async def migrated_consumer_store(store: SQLStore) -> SQLConsumerStore | None:
    """The consumers' tables, when this database has them (none on SQLite)."""
    consumers = consumer_store(store)
    return consumers if consumers is not None and await consumers.migrated() else None


async def consumer_overview(store: SQLStore) -> list[dict[str, Any]]:
    consumers = await migrated_consumer_store(store)
    return await consumers.overview() if consumers is not None else []


async def consumer_states(store: SQLStore, event_id: str) -> list[dict[str, Any]]:
    consumers = await migrated_consumer_store(store)
    return await consumers.event_states(event_id) if consumers is not None else []
