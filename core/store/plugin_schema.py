"""Plugins' own schema statements (``room_outbox_migrations``), run by ``migrate`` on a store
whose dialect has the ``plugin_schema`` capability."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from room_outbox.store.factory import SQLStore


async def run_plugin_statements(store: SQLStore, statements: Sequence[str]) -> None:
    """Every statement, in one transaction. They are idempotent (``IF NOT EXISTS``), so all of
    them run every time."""
    async with store.transaction() as cur:
        with warnings.catch_warnings():  # "table already exists" notes are the point of IF NOT EXISTS
            warnings.simplefilter("ignore")
            for ddl in statements:
                await cur.execute(ddl)
