"""``room-outbox lanes`` and ``lanes retire`` as processes on PostgreSQL and SQLite (MySQL's
run is in test_lane_lifecycle.py): a lane an operator switched off is listed with what it
still owes, and retiring it drops its table and cursor."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lanes.test_lane_lifecycle import cli, write
from support import envelope, insert_events

from room_outbox.store.dialect import table_names
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.store import LaneStore, lane_table, migrate_lanes
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["postgresql", "sqlite"])
def dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        return str(request.getfixturevalue("postgresql_dsn"))
    return f"sqlite:///{tmp_path / 'outbox.db'}"


@pytest.fixture
async def store(dsn: str) -> AsyncIterator[SQLStore]:
    store = await open_store(dsn)
    try:
        yield store
    finally:
        await store.aclose()


async def test_lanes_lists_a_switched_off_lane_and_retire_drops_it(store: SQLStore, dsn: str, tmp_path: Path) -> None:
    config: dict[str, Any] = {
        "database": {"dsn": dsn},
        "sinks": {"tencent_im": {"enabled": False}, "kafka": {"enabled": False, "bootstrap_servers": "127.0.0.1:9"}},
    }
    path = write(tmp_path / "c.yaml", config)
    migrated = cli(path, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    # The kafka lane ran once (fed 3 rows, delivered none), then the operator switched it off.
    await migrate_lanes(store, ["kafka"])
    await insert_events(store, [envelope(f"e{n}") for n in range(3)])
    assert await LaneStore(owner=store, lane="kafka", start="beginning").feed() == 3
    await insert_events(store, [envelope("later")])  # never fed

    listing = cli(path, "lanes")
    assert listing.returncode == 0, listing.stderr
    (kafka_line,) = [line for line in listing.stdout.splitlines() if line.startswith("kafka ")]
    assert "disabled: holds back retention until retired" in kafka_line, listing.stdout
    (kafka_row,) = [row for row in json.loads(cli(path, "lanes", "--json").stdout) if row["lane"] == "kafka"]
    assert (kafka_row["pending"], kafka_row["unfed"]) == (3, 1), kafka_row

    shown = cli(path, "lanes", "retire", "kafka")  # without --yes: shows, drops nothing
    assert shown.returncode == 0 and "would drop lane kafka" in shown.stdout, shown.stderr
    retired = cli(path, "lanes", "retire", "kafka", "--yes")
    assert retired.returncode == 0, retired.stderr
    assert f"dropped table {lane_table('kafka')}" in retired.stdout
    async with store.transaction() as cur:
        assert lane_table("kafka") not in await table_names(cur, store.dialect)
    assert "kafka" not in cli(path, "lanes").stdout
    unknown = cli(path, "lanes", "retire", "kafka", "--yes")
    assert unknown.returncode == 1 and "no lane named 'kafka'" in unknown.stderr
