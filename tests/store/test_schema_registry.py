"""The schema registry on each database: what ``migrate --sql`` prints is what ``migrate``
runs, the start-up check passes after it, and a second migrate has nothing left to do."""

from __future__ import annotations

from typing import Any

import pytest

from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema import registry
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.outbox import Migration
from room_outbox.store.schema.registry import Planner, WantedSchema

pytestmark = pytest.mark.anyio

#: Every part of the registry but the plugins' statements, which run every time (idempotent).
EVERYTHING = WantedSchema(lanes=("audit",), tail_lanes=("kafka",), consumers=True)


@pytest.fixture
def store(bare_store: SQLStore) -> SQLStore:
    """Every test here starts from a database nothing has migrated."""
    return bare_store


class RecordingStore:
    """``store``, recording the last plan its ``run_migration`` read from the catalogue."""

    def __init__(self, store: SQLStore) -> None:
        self.store = store
        self.ran: list[Migration] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def run_migration(self, planner: Planner) -> list[str]:
        async def recording(cur: Any) -> list[Migration]:
            self.ran = await planner(cur)
            return self.ran

        return await self.store.run_migration(recording)


def statements(plan: list[Migration]) -> list[str]:
    return [statement for step in plan for statement in step.statements]


async def test_sql_plan_is_what_migrate_runs_then_check_passes_and_nothing_is_left(store: SQLStore) -> None:
    printed = await registry.migration_plan(store, EVERYTHING)
    assert printed, "a fresh database needs every table"
    recording = RecordingStore(store)
    changes = await registry.migrate(recording, EVERYTHING)  # type: ignore[arg-type]
    assert statements(recording.ran) == statements(printed)
    assert changes == [step.change for step in printed]
    await check_schema(store, lanes=["audit"], tail_lanes=["kafka"])
    assert await registry.migration_plan(store, EVERYTHING) == []
    assert await registry.migrate(store, EVERYTHING) == []
