"""Switching the Kafka lane between its relays with real processes, on MariaDB and PostgreSQL
and the real broker: `room-outbox run` on its lane table, then tailing, then on a lane table
again, with `migrate --sql` and `migrate` between, events parked and cancelled in each mode and
each switch made while events are still owed and an id below them is missing. Nothing
cancelled is ever sent, nothing parked is sent without a requeue, nothing owed is lost, and
nothing is sent twice."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lanes.conftest import Broker
from lanes.test_lane_lifecycle import cli, write
from lanes.test_lanes import consume, event_ids
from processes import DispatcherProcess
from support import envelope, id_held_open, insert_events, wait_until

from room_outbox.store.factory import open_store
from room_outbox.store.lanes.store import LaneStore
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.tail import PARKED_TABLE

pytestmark = pytest.mark.anyio

LANE_TABLE = "room_outbox_lane_kafka"


@pytest.fixture(params=["mariadb", "postgresql"])
async def dsn(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("database_dsn" if request.param == "mariadb" else "postgresql_dsn"))


@pytest.fixture
async def outbox(dsn: str) -> AsyncIterator[SQLStore]:
    """The test's own connections, as room-service's and an operator's; one of them a producer's
    transaction held open across the switches (``id_held_open``)."""
    store = await open_store(dsn, idle_in_transaction=120)
    try:
        yield store
    finally:
        await store.aclose()


def config(tmp_path: Path, dsn: str, broker: Broker, relay: str) -> Path:
    return write(tmp_path / f"{relay}.yaml", {
        "database": {"dsn": dsn, "pool_size": 4},
        "outbox_worker": {"poll_interval": "50ms", "batch_size": 10, "publish_timeout": "2s",
                          "lanes": {"kafka": {"parking": True, "retry": {"base": "100ms", "cap": "200ms"}}}},
        "sinks": {
            "tencent_im": {"enabled": False},
            "kafka": {"bootstrap_servers": broker.bootstrap, "start": "beginning", "relay": relay,
                      "request_timeout": "1s", "max_message_bytes": 2048},
        },
    })  # fmt: skip


def huge(event_id: str) -> dict[str, Any]:
    return envelope(event_id, room_id="r_big", payload={"blob": "x" * 4000})


async def rows(store: SQLStore, query: str) -> dict[str, str]:
    async with store.transaction() as cur:
        await cur.execute(query)
        return {str(key): str(value) for key, value in await cur.fetchall()}


def ran(config: Path, *args: str) -> str:
    done = cli(config, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_switching_the_relay_both_ways_keeps_every_operators_decision(
    outbox: SQLStore, dsn: str, kafka_broker: Broker, tmp_path: Path
) -> None:
    lane_table, tail = config(tmp_path, dsn, kafka_broker, "lane_table"), config(tmp_path, dsn, kafka_broker, "tail")
    ran(lane_table, "migrate")

    # On its lane table: one event parked (too large); then, the lane stopped, an id goes
    # missing (a producer's transaction still open) and three events above it are fed (the
    # lane table's own feeding) and still owed; the operator cancels one of them in the table.
    first = DispatcherProcess(lane_table, "lane-table-1")
    try:
        await insert_events(outbox, [envelope("a1"), huge("huge-1"), envelope("a2")])
        await consume(kafka_broker, {"a1", "a2"})

        async def parked_in_table() -> bool:
            return (await rows(outbox, f"SELECT event_id, status FROM {LANE_TABLE}")).get("huge-1") == "failed"

        await wait_until(parked_in_table, timeout=30)
    finally:
        first.terminate()
    async with id_held_open(outbox, "late") as commit_late:
        await insert_events(outbox, [envelope("b1"), envelope("b2"), envelope("b3")])
        await LaneStore(owner=outbox, lane="kafka").feed()
        async with outbox.transaction() as cur:  # the operator's word, in the lane's own table
            await cur.execute(f"UPDATE {LANE_TABLE} SET status = 'cancelled' WHERE event_id = 'b2'")
        assert await rows(outbox, f"SELECT event_id, status FROM {LANE_TABLE} WHERE event_id LIKE 'b%'") == {
            "b1": "pending",
            "b2": "cancelled",
            "b3": "pending",
        }

        # To tailing: previewed, then made; the events the table owed are sent, what it parked
        # or cancelled is not. Above the id still missing, it parks one more and sends two.
        preview = ran(tail, "migrate", "--sql")
        assert f"INSERT INTO {PARKED_TABLE}" in preview and f"DROP TABLE IF EXISTS {LANE_TABLE}" in preview
        ran(tail, "migrate")
        second = DispatcherProcess(tail, "tail")
        try:
            await insert_events(outbox, [envelope("t1"), huge("huge-2"), envelope("t2")])
            await consume(kafka_broker, {"b1", "b3", "t1", "t2"})

            async def parked_tailing() -> bool:
                held = await rows(outbox, f"SELECT event_id, status FROM {PARKED_TABLE}")
                return held == {"huge-1": "parked", "b2": "cancelled", "huge-2": "parked"}

            await wait_until(parked_tailing, timeout=30)
            second.terminate()
        finally:
            if second.alive():
                second.kill()
        ran(tail, "cancel", "huge-2", "--lane", "kafka", "--yes")
        await insert_events(outbox, [envelope("t3")])  # owed: the lane is stopped

        # Back to a lane table while "late" is still missing: refused while an event the lane
        # holds parked waits (the table would never send it), then, that one cancelled too,
        # previewed and made.
        refused = cli(lane_table, "migrate")
        assert refused.returncode != 0 and "has 1 event(s) it parked" in refused.stderr, refused.stderr
        ran(tail, "cancel", "huge-1", "--lane", "kafka", "--yes")
        preview = ran(lane_table, "migrate", "--sql")
        assert f"DELETE FROM {PARKED_TABLE}" in preview, preview
        ran(lane_table, "migrate")
        third = DispatcherProcess(lane_table, "lane-table-2")
        try:
            await consume(kafka_broker, {"t3"})
            commit_late.set()
            await consume(kafka_broker, {"late"})
            await insert_events(outbox, [envelope("z1")])
            messages = await consume(kafka_broker, {"z1"})

            async def settled() -> bool:
                return "pending" not in (await rows(outbox, f"SELECT event_id, status FROM {LANE_TABLE}")).values()

            await wait_until(settled, timeout=30)
        finally:
            third.terminate()

    sent = Counter(event_ids(messages))
    assert not {"b2", "huge-1", "huge-2"} & set(sent), sent  # cancelled or parked: never sent
    assert sent == Counter(["a1", "a2", "b1", "b3", "t1", "t2", "t3", "late", "z1"])  # each once
    statuses = await rows(outbox, f"SELECT event_id, status FROM {LANE_TABLE}")
    assert {e: statuses.get(e) for e in ("b2", "huge-1", "huge-2")} == dict.fromkeys(
        ("b2", "huge-1", "huge-2"), "cancelled"
    )
    assert await rows(outbox, f"SELECT event_id, status FROM {PARKED_TABLE}") == {}
