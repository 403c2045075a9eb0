"""A Kafka lane's first start with ``start: now`` while a producer's transaction holds an id below
the table's highest (it commits after the lane started), with real processes, on MariaDB and
PostgreSQL, tailing and on a lane table, on the real broker. That event is sent, once; none
committed before the start is; an id rolled back long before the start is neither waited for nor
warned about."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lanes.conftest import Broker
from lanes.test_lane_lifecycle import cli, write
from lanes.test_lanes import consume, event_ids
from processes import DispatcherProcess
from support import INSERT_V1, envelope, id_held_open, insert_events, wait_until

from room_outbox.store.factory import open_store
from room_outbox.store.lanes.store import CURSOR_TABLE
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["mariadb", "postgresql"])
async def dsn(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("database_dsn" if request.param == "mariadb" else "postgresql_dsn"))


@pytest.fixture
async def outbox(dsn: str) -> AsyncIterator[SQLStore]:
    """The test's own connections, as room-service's: one of them a producer's transaction held
    open across the lane's start (``id_held_open``)."""
    store = await open_store(dsn, idle_in_transaction=120)
    try:
        yield store
    finally:
        await store.aclose()


class RolledBack(Exception):
    pass


async def rolled_back_insert(store: SQLStore) -> None:
    """An insert that takes an id and rolls back: that id never exists."""
    with pytest.raises(RolledBack):
        async with store.transaction() as cur:
            now = int(time.time() * 1000)
            await cur.execute(INSERT_V1, ("", "never", "RoomUserJoined", "r_1", "{}", now, now))
            raise RolledBack


async def cursor_row(store: SQLStore) -> tuple[int, int]:
    """The Kafka lane's ``fed_through_id`` and room_outbox's highest id."""
    async with store.transaction() as cur:
        await cur.execute(f"SELECT fed_through_id FROM {CURSOR_TABLE} WHERE lane = 'kafka'")
        (fed,) = await cur.fetchone()
        await cur.execute("SELECT MAX(id) FROM room_outbox")
        (top,) = await cur.fetchone()
        return int(fed), int(top)


async def shift_created(store: SQLStore, event_ids: list[str], ms: int) -> None:
    """Make the rows of ``event_ids`` look created ``ms`` earlier (by their keys: no lock waited
    for on a row a transaction holds)."""
    async with store.transaction() as cur:
        await cur.execute(f"SELECT id FROM room_outbox WHERE event_id IN ({', '.join(['%s'] * len(event_ids))})",
                          event_ids)  # fmt: skip
        keys = [int(key) for (key,) in await cur.fetchall()]
        await cur.execute(
            f"UPDATE room_outbox SET created_at_ms = created_at_ms - %s WHERE id IN ({', '.join(['%s'] * len(keys))})",
            [ms, *keys],
        )


@pytest.mark.parametrize(("relay", "producer_behind"), [("tail", False), ("lane_table", False), ("tail", True)])
async def test_an_event_in_flight_at_a_lanes_start_now_is_sent_and_none_committed_before_it(
    outbox: SQLStore, dsn: str, kafka_broker: Broker, tmp_path: Path, relay: str, producer_behind: bool
) -> None:
    """``producer_behind``: room-service's clock, which writes the rows' creation times, an hour
    behind the database's: the rows still in the window are those made just before the start."""
    config = write(tmp_path / "lane.yaml", {
        "database": {"dsn": dsn, "pool_size": 4},
        "outbox_worker": {"poll_interval": "50ms", "batch_size": 10, "publish_timeout": "2s"},
        "sinks": {
            "tencent_im": {"enabled": False},
            "kafka": {"bootstrap_servers": kafka_broker.bootstrap, "start": "now", "relay": relay,
                      "request_timeout": "1s"},
        },
    })  # fmt: skip
    migrated = cli(config, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    # Long ago: an id rolled back between rows made two hours before the start.
    await insert_events(outbox, [envelope(f"old-{n}") for n in range(3)])
    await rolled_back_insert(outbox)
    await insert_events(outbox, [envelope(f"old-{n}") for n in range(3, 5)])
    async with outbox.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET created_at_ms = created_at_ms - 7200000")
    await insert_events(outbox, [envelope(f"before-{n}") for n in range(5)])
    proc = None
    try:
        async with id_held_open(outbox, "held") as commit_held:
            await insert_events(outbox, [envelope("before-last")])  # above "held", committed before the start
            if producer_behind:
                await shift_created(outbox, [f"before-{n}" for n in range(5)] + ["before-last"], 3_600_000)
            proc = DispatcherProcess(config, f"start-{relay}")
            await wait_until(lambda: any(line.get("msg") == "lane started" for line in proc.lines()), timeout=60)
            await insert_events(outbox, [envelope("during")])
            await consume(kafka_broker, {"during"})  # the lane has run while "held" was missing
            commit_held.set()
        await insert_events(outbox, [envelope("after")])
        messages = await consume(kafka_broker, {"held", "after"})

        async def caught_up() -> bool:
            fed, top = await cursor_row(outbox)
            return fed == top

        # Not held back by the id rolled back long ago: the lane never waited for it.
        await wait_until(caught_up, timeout=30)
        inspected = cli(config, "inspect", "held")
        assert inspected.returncode == 0, inspected.stderr
    finally:
        if proc is not None:
            proc.terminate()
    assert sorted(event_ids(messages)) == ["after", "during", "held"]  # each once, nothing from before the start
    assert "not sent" not in inspected.stdout and "not fed" not in inspected.stdout, inspected.stdout
    warned = [line for line in proc.lines() if line.get("level") in ("warning", "error")]
    assert not [line for line in warned if "gap" in str(line.get("msg"))], warned
