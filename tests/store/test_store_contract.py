"""The store contract: every :class:`~room_outbox.store.OutboxStore` (MySQL, PostgreSQL,
SQLite) behaves alike — schema migration, claims and leases, fencing, takeover, renewal, per-room hold-back,
parking, claims shared by several processes on one database, lanes of their own with
gap-safe feeding, retention, and the operator commands (requeue, cancel, status, inspect).

Each test runs once per backend. MySQL-only properties (the claim's index plan, PyMySQL's
bytes parameters) stay in ``test_mysql_migrate.py``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from processes import FakeIMProcess, dispatchers, write_config
from support import (
    INSERT_V1,
    V1_DDL,
    RecordingSink,
    envelope,
    fetch_rows,
    insert_events,
    key_event_ids_per_app,
    make_dispatcher,
    running,
    statuses_by_app,
    wait_until,
)

from bench.drive import run_until_empty
from room_outbox.cli.cancel import cancel_command
from room_outbox.cli.cleanup import cleanup_command
from room_outbox.cli.inspect import inspect_events
from room_outbox.cli.requeue import requeue_command
from room_outbox.cli.status import format_status, status_report
from room_outbox.errors import SchemaError
from room_outbox.producer import append_event
from room_outbox.sink import RetryableSinkError
from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import ROW_LOCKS, table_names
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.store import LaneStore, migrate_lanes
from room_outbox.store.operator.changes import SEVERAL_APPS, RequeueFilter, cancel, find_requeue_candidates, requeue
from room_outbox.store.operator.reports import event_apps, event_rows
from room_outbox.store.operator.retention import RetentionOptions, cleanup
from room_outbox.store.protocol import Claimed, DeliveryResult, Outcome, SQLStore
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.columns import LAST_ERROR_MAX
from room_outbox.store.schema.outbox import V1_TABLE_DDL
from room_outbox.store.schema.profiles import ROOM_CELL, profile_named

pytestmark = pytest.mark.anyio

MIGRATION = {
    "added column room_outbox.worker_id",
    "added column room_outbox.lock_until_ms",
    "added index room_outbox.idx_room_outbox_claim",
    "added index room_outbox.idx_room_outbox_room",
}
#: On a server: the membership of processes and the room buckets (SQLite runs without).
SERVER_MIGRATION = {
    "created table room_outbox_node",
    "created table room_outbox_bucket",
}
#: MySQL/MariaDB keep the bucket in a STORED column of a table migrate creates (none in a table
#: already there); PostgreSQL computes it with a function of its own, in the claim's index.
MYSQL_MIGRATION = {"added column room_outbox.room_bucket"}
POSTGRESQL_MIGRATION = {"created function room_outbox_crc32"}


def migration(store: SQLStore, created: bool = True) -> set[str]:
    if store.dialect.name == "mysql":
        return MIGRATION | SERVER_MIGRATION | (MYSQL_MIGRATION if created else set())
    if store.dialect.name == "postgresql":
        return MIGRATION | SERVER_MIGRATION | POSTGRESQL_MIGRATION
    return MIGRATION


@pytest.fixture
async def any_store(bare_store: SQLStore) -> SQLStore:
    await bare_store.migrate()
    return bare_store


@pytest.fixture
async def other_store(store_dsn: str, any_store: SQLStore) -> AsyncIterator[SQLStore]:
    """A second connection to the same database: what another process would hold."""
    store = await open_store(store_dsn)
    try:
        yield store
    finally:
        await store.aclose()


async def all_published(store: SQLStore) -> bool:
    return {r["status"] for r in (await fetch_rows(store)).values()} == {"published"}


# -- schema ----------------------------------------------------------------------------------


async def test_migrate_creates_the_table_and_is_idempotent(bare_store: SQLStore) -> None:
    assert set(await bare_store.migrate()) == {"created table room_outbox", *migration(bare_store)}
    assert await bare_store.migrate() == []


async def test_migrate_upgrades_a_v1_table_in_place_keeping_its_rows(bare_store: SQLStore) -> None:
    async with bare_store.transaction() as cur:
        for statement in (
            (V1_DDL,)
            if bare_store.dialect.name == "mysql"
            else (s.format(table="room_outbox") for s in V1_TABLE_DDL[bare_store.dialect.name])
        ):
            await cur.execute(statement)
        await cur.execute(INSERT_V1, ("default", "e_old", "RoomUserJoined", "r_1", '{"x":1}', 1, 1))
    assert set(await bare_store.migrate()) == migration(bare_store, created=False)
    assert await bare_store.migrate() == []
    row = (await fetch_rows(bare_store))["e_old"]
    assert (row["status"], row["worker_id"], row["lock_until_ms"], row["envelope"]) == ("pending", None, 0, '{"x":1}')


async def test_migrate_and_run_refuse_a_table_that_is_not_v1_alike(bare_store: SQLStore) -> None:
    """A table without the producer's columns (another table named as database.table) is no
    work for migrate: it refuses it, and run's start-up check says the same, not "run migrate"."""
    async with bare_store.transaction() as cur:
        await cur.execute("CREATE TABLE room_outbox (id INTEGER PRIMARY KEY, event_id VARCHAR(64), status VARCHAR(16))")
    with pytest.raises(SchemaError) as refused:
        await bare_store.migrate()
    with pytest.raises(SchemaError) as checked:
        await check_schema(bare_store)
    assert str(checked.value) == str(refused.value)
    assert str(refused.value).startswith(
        "table room_outbox exists but lacks the V1 columns event_type, room_id, envelope, retry_count, last_error,"
        " created_at_ms, which its producer writes: it is not an outbox table of profile v1; check database.table"
        " and database.profile"
    )
    assert "run `room-outbox migrate`" not in str(checked.value)


async def test_run_advises_migrate_for_room_outbox_columns_only(bare_store: SQLStore) -> None:
    """A V1 table as room-service's first releases made it: migrate adds what run misses."""
    async with bare_store.transaction() as cur:
        await cur.execute(
            "CREATE TABLE room_outbox (id INTEGER PRIMARY KEY, event_id VARCHAR(64), event_type VARCHAR(64),"
            " room_id VARCHAR(64), envelope TEXT, status VARCHAR(16), retry_count INT, last_error TEXT,"
            " created_at_ms BIGINT)"
        )
    with pytest.raises(
        SchemaError,
        match=r"^table room_outbox lacks app_code, updated_at_ms, worker_id, lock_until_ms: run `room-outbox migrate`$",
    ):
        await check_schema(bare_store)


async def test_room_service_statements_work_on_the_migrated_table(any_store: SQLStore) -> None:
    async with any_store.transaction() as cur:
        await cur.execute(INSERT_V1, ("default", "e_rs", "RoomGiftSent", "r_9", "{}", 5, 5))
        assert await cur.execute("UPDATE room_outbox SET status='published' WHERE event_id=%s", ("e_rs",)) == 1
    row = (await fetch_rows(any_store))["e_rs"]
    assert (row["status"], row["retry_count"], row["lock_until_ms"], row["worker_id"]) == ("published", 0, 0, None)


# -- claims, leases, fencing -------------------------------------------------------------------


async def test_a_claim_leases_rows_in_id_order_to_its_claimant(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope(f"e{i}") for i in range(5)])
    until = now_ms() + 60_000
    claimed = await any_store.claim("a#1", 3, until)
    assert [r.event_id for r in claimed.rows] == ["e0", "e1", "e2"] and not claimed.exhausted
    assert {r.claim for r in claimed.rows} == {"a#1"} and claimed.stale == []
    leased = await fetch_rows(any_store)
    assert [(leased[f"e{i}"]["worker_id"], leased[f"e{i}"]["lock_until_ms"]) for i in range(3)] == [("a#1", until)] * 3
    others = await any_store.claim("b#1", 10, now_ms() + 60_000)
    assert [r.event_id for r in others.rows] == ["e3", "e4"] and others.exhausted  # leased rows are not claimable


async def test_concurrent_claims_from_two_connections_never_overlap(any_store: SQLStore, other_store: SQLStore) -> None:
    await insert_events(any_store, [envelope(f"e{i}") for i in range(200)])
    results: dict[str, list[str]] = {}

    async def claim(store: SQLStore, name: str) -> None:
        for n in range(3):
            rows = (await store.claim(f"{name}#{n}", 20, now_ms() + 60_000)).rows
            results[f"{name}#{n}"] = [r.event_id for r in rows]

    async with anyio.create_task_group() as tg:
        tg.start_soon(claim, any_store, "a")
        tg.start_soon(claim, other_store, "b")
    claimed = [e for ids in results.values() for e in ids]
    assert len(claimed) == 120 and len(set(claimed)) == 120


async def test_results_are_recorded_per_outcome(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope(f"e{i}") for i in range(4)])
    rows = {r.event_id: r for r in (await any_store.claim("a#1", 10, now_ms() + 60_000)).rows}
    retry_at = now_ms() + 5_000
    stale = await any_store.record(
        [
            DeliveryResult(rows["e0"].id, "e0", "a#1", Outcome.PUBLISHED),
            DeliveryResult(rows["e1"].id, "e1", "a#1", Outcome.FAILED, "x" * 2000, retry_at),
            DeliveryResult(rows["e2"].id, "e2", "a#1", Outcome.PARKED, "permanent: group gone"),
            DeliveryResult(rows["e3"].id, "e3", "a#1", Outcome.RELEASED),
        ]
    )
    assert stale == []
    got = await fetch_rows(any_store)
    state = {e: (r["status"], r["retry_count"], r["worker_id"], r["lock_until_ms"]) for e, r in got.items()}
    assert state == {
        "e0": ("published", 0, None, 0),
        "e1": ("pending", 1, None, retry_at),
        "e2": ("failed", 1, None, 0),
        "e3": ("pending", 0, None, 0),  # released: no attempt counted, claimable at once
    }
    assert got["e1"]["last_error"] == "x" * LAST_ERROR_MAX and got["e0"]["last_error"] is None
    again = await any_store.claim("b#1", 10, now_ms() + 60_000)
    assert [r.event_id for r in again.rows] == ["e3"]  # e1 waits for its retry time, e2 is parked


async def test_a_throttled_row_is_released_unattempted_until_its_slot(any_store: SQLStore) -> None:
    """Held back by the process's own rate limit: no attempt counted, no error, the lease
    dropped, claimable again at the given time (0: at once); a stale one is reported."""
    await insert_events(any_store, [envelope(f"e{i}") for i in range(3)])
    rows = {r.event_id: r for r in (await any_store.claim("a#1", 10, now_ms() + 60_000)).rows}
    slot = now_ms() + 60_000
    async with any_store.transaction() as cur:  # e2's lease was taken over meanwhile
        await cur.execute("UPDATE room_outbox SET worker_id = 'b#9' WHERE event_id = 'e2'")
    throttled = [
        DeliveryResult(rows["e0"].id, "e0", "a#1", Outcome.THROTTLED, retry_at_ms=slot),
        DeliveryResult(rows["e2"].id, "e2", "a#1", Outcome.THROTTLED, retry_at_ms=slot),
    ]
    assert await any_store.record(throttled) == [throttled[1]]
    assert await any_store.record([DeliveryResult(rows["e1"].id, "e1", "a#1", Outcome.THROTTLED)]) == []
    got = await fetch_rows(any_store)
    state = {e: (r["status"], r["retry_count"], r["worker_id"], r["last_error"]) for e, r in got.items()}
    assert state["e0"] == state["e1"] == ("pending", 0, None, None)
    assert got["e0"]["lock_until_ms"] == slot
    again = await any_store.claim("c#1", 10, now_ms() + 60_000)
    assert [r.event_id for r in again.rows] == ["e1"]  # e0 waits for its slot


async def test_a_throttled_row_the_destination_refused_records_why(any_store: SQLStore) -> None:
    """Refused by the destination for its rate: still no attempt and the lease dropped, but
    its error written to last_error by the release itself, each row its own; a throttled row
    without an error keeps its last_error, a released one too."""
    await insert_events(any_store, [envelope(f"e{i}") for i in range(4)])
    async with any_store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET last_error = 'earlier' WHERE event_id IN ('e2', 'e3')")
    rows = {r.event_id: r for r in (await any_store.claim("a#1", 10, now_ms() + 60_000)).rows}
    slot = now_ms() + 60_000
    long_error = "refused for rate: GroupId r_1 " + "y" * LAST_ERROR_MAX
    results = [
        DeliveryResult(rows["e0"].id, "e0", "a#1", Outcome.THROTTLED, "refused for rate: GroupId r_0", slot),
        DeliveryResult(rows["e1"].id, "e1", "a#1", Outcome.THROTTLED, long_error, slot),
        DeliveryResult(rows["e2"].id, "e2", "a#1", Outcome.THROTTLED, retry_at_ms=slot),  # this process's limit
        DeliveryResult(rows["e3"].id, "e3", "a#1", Outcome.RELEASED),
    ]
    assert await any_store.record(results) == []
    got = await fetch_rows(any_store)
    state = {e: (r["status"], r["retry_count"], r["worker_id"], r["last_error"]) for e, r in got.items()}
    assert state == {
        "e0": ("pending", 0, None, "refused for rate: GroupId r_0"),
        "e1": ("pending", 0, None, long_error[:LAST_ERROR_MAX]),
        "e2": ("pending", 0, None, "earlier"),
        "e3": ("pending", 0, None, "earlier"),
    }
    assert got["e0"]["lock_until_ms"] == got["e2"]["lock_until_ms"] == slot


async def test_a_stale_claimant_changes_nothing_and_is_reported(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope("e1")])
    (row,) = (await any_store.claim("a#1", 10, now_ms() - 1)).rows  # a lease that has already run out
    (taken,) = (await any_store.claim("b#1", 10, now_ms() + 60_000)).rows  # another process takes over
    assert taken.event_id == "e1"
    late = DeliveryResult(row.id, row.event_id, "a#1", Outcome.FAILED, "late failure", 0)
    assert await any_store.record([late]) == [late]
    assert await any_store.renew("a#1", [row.id], now_ms() + 60_000) == 0
    current = (await fetch_rows(any_store))["e1"]
    assert (current["worker_id"], current["retry_count"], current["last_error"]) == ("b#1", 0, None)
    # The stale result comes back from the claim that carries it, too.
    claimed = await any_store.claim("a#2", 10, now_ms() + 60_000, [late])
    assert claimed.stale == [late] and claimed.rows == []
    assert await any_store.record([DeliveryResult(taken.id, "e1", "b#1", Outcome.PUBLISHED)]) == []
    assert (await fetch_rows(any_store))["e1"]["status"] == "published"


async def test_a_result_for_a_row_the_producer_published_is_stale(any_store: SQLStore) -> None:
    """Stale, and told apart from a takeover: the producer's push won, no other claim holds
    the row; a renewal counts it as still held (not lost to another process)."""
    await insert_events(any_store, [envelope("e1")])
    (row,) = (await any_store.claim("a#1", 10, now_ms() + 60_000)).rows
    async with any_store.transaction() as cur:  # room-service's synchronous push succeeded meanwhile
        await cur.execute("UPDATE room_outbox SET status='published' WHERE event_id=%s", ("e1",))
    assert await any_store.renew("a#1", [row.id], now_ms() + 60_000) == 1
    failure = DeliveryResult(row.id, "e1", "a#1", Outcome.FAILED, "boom", 0)
    assert await any_store.record([failure]) == [dataclasses.replace(failure, published_by_producer=True)]
    assert (await fetch_rows(any_store))["e1"]["retry_count"] == 0


async def test_in_a_batch_only_the_rows_lost_meanwhile_are_stale(any_store: SQLStore) -> None:
    """One fenced write per outcome: the rows the claim still holds are written, and exactly
    those it lost (published by the producer, cancelled, taken over) come back as stale."""
    await insert_events(any_store, [envelope(f"e{i}") for i in range(6)])
    rows = (await any_store.claim("a#1", 10, now_ms() + 60_000)).rows
    by_event = {row.event_id: row for row in rows}
    async with any_store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status='published' WHERE event_id=%s", ("e1",))
        await cur.execute("UPDATE room_outbox SET status='cancelled', worker_id=NULL WHERE event_id=%s", ("e2",))
        await cur.execute("UPDATE room_outbox SET worker_id='b#9' WHERE event_id IN ('e3', 'e5')")
    results = [DeliveryResult(by_event[e].id, e, "a#1", Outcome.PUBLISHED) for e in ("e0", "e1", "e2", "e3")]
    results += [DeliveryResult(by_event["e4"].id, "e4", "a#1", Outcome.RELEASED)]
    results += [DeliveryResult(by_event["e5"].id, "e5", "a#1", Outcome.FAILED, "boom", 0)]
    stale = await any_store.record(results)
    assert sorted(r.event_id for r in stale) == ["e1", "e2", "e3", "e5"]
    assert [r.event_id for r in stale if r.published_by_producer] == ["e1"]  # the others are no producer's doing
    after = await fetch_rows(any_store)
    assert (after["e0"]["status"], after["e0"]["worker_id"]) == ("published", None)
    assert (after["e4"]["status"], after["e4"]["worker_id"], after["e4"]["lock_until_ms"]) == ("pending", None, 0)
    assert (after["e2"]["status"], after["e3"]["worker_id"], after["e5"]["retry_count"]) == ("cancelled", "b#9", 0)


async def test_renew_extends_only_rows_the_claim_still_holds(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope(f"e{i}") for i in range(3)])
    rows = (await any_store.claim("a#1", 10, now_ms() + 1_000)).rows
    await any_store.record([DeliveryResult(rows[0].id, "e0", "a#1", Outcome.PUBLISHED)])
    later = now_ms() + 120_000
    assert await any_store.renew("a#1", [r.id for r in rows], later) == 2
    assert await any_store.renew("a#1", [], later) == 0
    got = await fetch_rows(any_store)
    assert [got[e]["lock_until_ms"] for e in ("e0", "e1", "e2")] == [0, later, later]


async def test_a_crashed_processs_rows_are_taken_over_after_the_lease(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope(f"e{i}") for i in range(3)])
    crashed = (await any_store.claim("crashed#1", 10, now_ms() + 300)).rows  # claimed, then the process died
    assert len(crashed) == 3
    sink = RecordingSink()
    survivor = make_dispatcher(any_store, sink, node_id="survivor")
    assert await run_until_empty(survivor) == 0  # the lease still holds

    async def taken_over() -> bool:
        await run_until_empty(survivor)
        return sorted(sink.received) == ["e0", "e1", "e2"]

    await wait_until(taken_over, timeout=5.0)
    assert await all_published(any_store)


@pytest.mark.serial  # a 0.3 s lease: renewals late on a busy machine would lapse it
async def test_a_live_lease_never_expires_under_a_slow_sink(
    any_store: SQLStore, other_store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Lease 0.3 s, deliveries 1 s: renewal keeps the rows, so the rival never delivers them."""
    await insert_events(any_store, [envelope(f"e{i}") for i in range(4)])
    slow, fast = RecordingSink(delay=1.0), RecordingSink()
    holder = make_dispatcher(any_store, slow, node_id="holder", lease=0.3, publish_timeout=5.0)
    rival = make_dispatcher(other_store, fast, node_id="rival", poll_interval=0.02)
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_until_empty, holder)
        await wait_until(lambda: len(slow.received) == 4)
        async with running(rival):
            await wait_until(lambda: all_published(any_store), timeout=10.0)
    assert fast.received == []
    assert not [r for r in caplog.records if "lease lost" in r.message or "not recorded" in r.message]


class WaitsForPeer(RecordingSink):
    """Records, then waits (with a deadline) until ``peer`` has received something."""

    peer: RecordingSink

    async def deliver(self, envelope: Any) -> None:
        await super().deliver(envelope)
        await wait_until(lambda: bool(self.peer.received), timeout=20.0)


async def test_two_dispatchers_on_two_connections_deliver_each_event_exactly_once(
    any_store: SQLStore, other_store: SQLStore
) -> None:
    await insert_events(any_store, [envelope(f"e{i}", room_id=f"r_{i % 7}") for i in range(600)])
    # Each sink holds its first delivery until the other dispatcher has delivered too, so the
    # two really compete for rows however the machine schedules them (one could otherwise
    # drain the table before the other's first claim).
    sinks = [WaitsForPeer(), WaitsForPeer()]
    sinks[0].peer, sinks[1].peer = sinks[1], sinks[0]
    dispatchers_ = [
        make_dispatcher(store, sink, node_id=f"d{n}", batch_size=30, publish_timeout=30.0)
        for n, (store, sink) in enumerate(zip((any_store, other_store), sinks, strict=True))
    ]
    async with running(*dispatchers_):
        await wait_until(lambda: all_published(any_store), timeout=30.0)
    counts = Counter(sinks[0].received + sinks[1].received)
    assert len(counts) == 600 and set(counts.values()) == {1}
    assert sinks[0].received and sinks[1].received  # both took part


async def test_stop_finishes_in_flight_releases_the_rest_and_leaves_no_lease(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope(f"e{i}") for i in range(10)])
    sink = RecordingSink(delay=0.3)
    dispatcher = make_dispatcher(any_store, sink, concurrency=2, publish_timeout=2.0)
    async with running(dispatcher):
        await wait_until(lambda: len(sink.received) == 2)
    rows = await fetch_rows(any_store)
    published = sorted(e for e, r in rows.items() if r["status"] == "published")
    assert published == sorted(sink.received) and len(published) == 2
    assert all(r["worker_id"] is None and r["lock_until_ms"] == 0 for r in rows.values() if r["status"] == "pending")
    assert all(r["retry_count"] == 0 for r in rows.values())


# -- per-room ordering and parking ------------------------------------------------------------


async def test_per_room_claims_only_heads_and_holds_the_rest_back(any_store: SQLStore) -> None:
    await insert_events(
        any_store,
        [envelope("a1", room_id="A"), envelope("b1", room_id="B"), envelope("a2", room_id="A")],
    )
    (a1,) = (await any_store.claim("x#1", 1, now_ms() + 60_000)).rows  # a1 is now leased elsewhere
    assert a1.event_id == "a1"
    claimed = await any_store.claim("y#1", 10, now_ms() + 60_000, per_room=True, hold_back_ms=5_000)
    assert [r.event_id for r in claimed.rows] == ["b1"]  # a2 waits behind a1
    a2 = (await fetch_rows(any_store))["a2"]
    assert a2["worker_id"] is None and a2["lock_until_ms"] > now_ms() + 3_000  # held back, not looked at again
    # Once a1 is published, a2 comes up (after its hold-back) as the head of its room.
    await any_store.record([DeliveryResult(a1.id, "a1", "x#1", Outcome.PUBLISHED)])
    async with any_store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET lock_until_ms = 0 WHERE event_id = %s", ("a2",))
    assert [r.event_id for r in (await any_store.claim("y#2", 10, now_ms() + 60_000, per_room=True)).rows] == ["a2"]


async def test_per_room_a_room_of_another_app_with_the_same_id_holds_nothing_back(any_store: SQLStore) -> None:
    """A room is per app: another app's open row of the same room id is no earlier row of it."""
    await insert_events(
        any_store,
        [
            envelope("x1", room_id="A", app_code="x"),
            envelope("d1", room_id="A"),
            envelope("x2", room_id="A", app_code="x"),
        ],
    )
    (x1,) = (await any_store.claim("x#1", 1, now_ms() + 60_000)).rows  # leased elsewhere
    assert x1.event_id == "x1"
    claimed = await any_store.claim("y#1", 10, now_ms() + 60_000, per_room=True, hold_back_ms=5_000)
    assert [r.event_id for r in claimed.rows] == ["d1"]  # x2 waits behind x1, d1 behind nothing


async def test_per_room_rows_the_caller_has_in_flight_do_not_hold_their_rooms_back(any_store: SQLStore) -> None:
    await insert_events(
        any_store,
        [envelope("a1", room_id="A"), envelope("b1", room_id="B"), envelope("a2", room_id="A")],
    )
    (a1,) = (await any_store.claim("x#1", 1, now_ms() + 60_000)).rows  # in flight in this process
    in_flight = {a1.id: ("default", "A")}
    claimed = await any_store.claim(
        "x#2", 10, now_ms() + 60_000, per_room=True, hold_back_ms=60_000, in_flight=in_flight
    )
    assert [r.event_id for r in claimed.rows] == ["b1", "a2"]  # the caller delivers a2 after a1


async def test_per_room_a_row_in_flight_whose_lease_ran_out_is_not_taken_again(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope("a1", room_id="A"), envelope("a2", room_id="A")])
    (a1, a2) = (await any_store.claim("x#1", 2, now_ms() - 1)).rows  # leases already over
    in_flight = {a1.id: ("default", "A"), a2.id: ("default", "A")}
    claimed = await any_store.claim("x#2", 10, now_ms() + 60_000, per_room=True, in_flight=in_flight)
    assert claimed.rows == []  # their results decide what becomes of them


class ShakySink:
    """Answers after 0–2 ms and fails (retryably) about one delivery in eight, from a seeded
    generator; records each room's successful deliveries in order."""

    def __init__(self) -> None:
        self._random = random.Random(11)
        self.delivered: dict[str, list[int]] = {}

    async def deliver(self, env: Any) -> None:
        await anyio.sleep(self._random.uniform(0, 0.002))
        if self._random.random() < 0.125:
            raise RetryableSinkError("the sink failed")
        self.delivered.setdefault(env.room_id, []).append(env.room_version)

    async def aclose(self) -> None:
        pass


async def test_per_room_order_holds_over_a_few_hot_rooms_with_a_slow_failing_sink(any_store: SQLStore) -> None:
    """Claims made ahead take the rooms still in flight: their rows wait behind those in the
    process, and are released when one before them fails."""
    rooms, per_room = 5, 40
    await insert_events(
        any_store,
        [
            envelope(f"r{room}-{v:02}", room_id=f"r{room}", room_version=v)
            for v in range(per_room)
            for room in range(rooms)
        ],
    )
    sink = ShakySink()
    dispatcher = make_dispatcher(any_store, sink, batch_size=20, concurrency=8, per_room=True, poll_interval=0.01)
    with anyio.fail_after(60):
        while any(r["status"] != "published" for r in (await fetch_rows(any_store)).values()):
            await run_until_empty(dispatcher)
    # Every event once, each room's in order: a row behind one that failed waited for its retry.
    assert sink.delivered == {f"r{room}": list(range(per_room)) for room in range(rooms)}


async def test_per_room_takes_a_whole_room_when_every_earlier_row_is_in_the_claim(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope(f"a{i}", room_id="A") for i in range(5)])
    claimed = await any_store.claim("y#1", 10, now_ms() + 60_000, per_room=True)
    assert [r.event_id for r in claimed.rows] == [f"a{i}" for i in range(5)]


async def test_a_parked_event_no_longer_holds_its_room_back(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope("a1", room_id="A"), envelope("a2", room_id="A")])
    (a1,) = (await any_store.claim("x#1", 1, now_ms() + 60_000)).rows
    await any_store.record([DeliveryResult(a1.id, "a1", "x#1", Outcome.PARKED, "permanent")])
    claimed = await any_store.claim("y#1", 10, now_ms() + 60_000, per_room=True)
    assert [r.event_id for r in claimed.rows] == ["a2"]


async def test_per_room_order_holds_across_two_dispatchers_with_failures(
    any_store: SQLStore, other_store: SQLStore
) -> None:
    events = [envelope(f"e{i:03d}", room_id=f"r_{i % 3}") for i in range(60)]
    await insert_events(any_store, events)
    delivered: list[tuple[str, str]] = []  # (room, event_id) in delivery order, successes only

    class OrderSink(RecordingSink):
        def __init__(self) -> None:
            super().__init__()
            self.failed_once: set[str] = set()

        async def deliver(self, envelope: Any) -> None:
            await super().deliver(envelope)
            if envelope.event_id.endswith("7") and envelope.event_id not in self.failed_once:
                self.failed_once.add(envelope.event_id)  # every event ending in 7 fails once
                from room_outbox.sink import RetryableSinkError

                raise RetryableSinkError("first attempt fails")
            delivered.append((envelope.room_id, envelope.event_id))

    sink = OrderSink()
    lanes = [
        make_dispatcher(store, sink, node_id=f"d{n}", batch_size=7, per_room=True, poll_interval=0.02)
        for n, store in enumerate((any_store, other_store))
    ]
    async with running(*lanes):
        await wait_until(lambda: all_published(any_store), timeout=30.0)
    for room in ("r_0", "r_1", "r_2"):
        order = [e for r, e in delivered if r == room]
        assert order == sorted(order), room
        assert len(order) == 20


# -- several processes on one database --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.serial
async def test_three_processes_share_one_database_and_send_each_event_once(store_dsn: str, tmp_path: Path) -> None:
    """Three `room-outbox run` processes on one database (for SQLite: one file), all competing
    from the first event on: every event reaches IM exactly once and ends published."""
    store = await open_store(store_dsn)
    try:
        await store.migrate()
        fake = FakeIMProcess(tmp_path)
        try:
            config = write_config(tmp_path / "config.yaml", store_dsn, fake, batch_size=20)
            settings = yaml.safe_load(config.read_text())
            settings["log"]["level"] = "DEBUG"  # a line per published event names its node
            config.write_text(yaml.safe_dump(settings))
            with dispatchers(config, count=3) as procs:

                def all_started() -> bool:
                    assert all(p.alive() for p in procs), [p.log.read_text()[-2000:] for p in procs]
                    return all(any(line.get("lifecycle") == "worker_started" for line in p.lines()) for p in procs)

                await wait_until(all_started, timeout=60)
                await insert_events(store, [envelope(f"p{i:04d}", room_id=f"r_{i % 11}") for i in range(400)])
                await wait_until(lambda: all_published(store), timeout=60.0, interval=0.1)
                for proc in procs:
                    proc.terminate()
                nodes = {line["node_id"] for p in procs for line in p.lines() if line.get("status") == "published"}
            received = Counter(m["event_id"] for m in fake.messages())
            assert len(received) == 400 and set(received.values()) == {1}
            assert fake.stats()["duplicates"] == 0 and fake.stats()["requests"] == 400  # none sent twice
            assert len(nodes) >= 2, "the processes did not share the work"
        finally:
            fake.close()
    finally:
        await store.aclose()


# -- lanes of their own ------------------------------------------------------------------------


async def lane_of(store: SQLStore, name: str = "audit", start: str | int = "beginning") -> LaneStore:
    await migrate_lanes(store, [name])
    return LaneStore(owner=store, lane=name, start=start, gap_timeout=60.0)


async def test_a_lane_is_fed_claimed_and_recorded_apart_from_the_im_lane(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope(f"e{i}") for i in range(3)])
    lane = await lane_of(any_store)
    claimed = await lane.claim("l#1", 10, now_ms() + 60_000)
    assert [r.event_id for r in claimed.rows] == ["e0", "e1", "e2"]
    assert all(json.loads(r.envelope)["event_id"] == r.event_id for r in claimed.rows)  # read from room_outbox
    assert await lane.record([DeliveryResult(r.id, r.event_id, "l#1", Outcome.PUBLISHED) for r in claimed.rows]) == []
    assert {r["status"] for r in (await fetch_rows(any_store)).values()} == {"pending"}  # the main lane's own
    await insert_events(any_store, [envelope("e3")])
    assert [r.event_id for r in (await lane.claim("l#2", 10, now_ms() + 60_000)).rows] == ["e3"]  # each row once
    assert await lane.feed() == 0


async def test_a_lane_started_now_skips_the_rows_before_it(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope("old")])
    lane = await lane_of(any_store, start="now")
    assert await lane.feed() == 0
    await insert_events(any_store, [envelope("new")])
    assert [r.event_id for r in (await lane.claim("l#1", 10, now_ms() + 60_000)).rows] == ["new"]


@pytest.fixture(params=["mysql", "postgresql"])
async def server_stores(request: pytest.FixtureRequest) -> AsyncIterator[tuple[SQLStore, SQLStore]]:
    """Two connections to a migrated database on a server. (SQLite has one writer at a time:
    there a second producer cannot take an id while the first one's transaction is open.)"""
    dsn = str(request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn"))
    first, second = await open_store(dsn), await open_store(dsn)
    try:
        assert ROW_LOCKS in first.dialect.capabilities
        await first.migrate()
        yield first, second
    finally:
        await first.aclose()
        await second.aclose()


async def test_a_lane_feeds_an_id_that_commits_after_a_higher_one(server_stores: tuple[SQLStore, SQLStore]) -> None:
    """Ids commit out of order on the servers: the lane waits for the missing id instead of
    passing it by."""
    any_store, other_store = server_stores
    lane = await lane_of(any_store)
    now = now_ms()
    async with other_store.transaction() as late:  # a producer transaction that takes its id first...
        await late.execute(
            INSERT_V1, ("default", "late", "RoomUserJoined", "r_1", json.dumps(envelope("late")), now, now)
        )
        await insert_events(any_store, [envelope("early")])  # ...and commits after a later one
        assert await lane.feed() == 1
    assert await lane.feed() == 1
    claimed = await lane.claim("l#1", 10, now_ms() + 60_000)
    assert sorted(r.event_id for r in claimed.rows) == ["early", "late"]


# -- retention -----------------------------------------------------------------------------------


async def age_and_publish(store: SQLStore, event_ids: list[str], created_at_ms: int) -> None:
    async with store.transaction() as cur:
        for event_id in event_ids:
            await cur.execute(
                "UPDATE room_outbox SET status = 'published', created_at_ms = %s WHERE event_id = %s",
                (created_at_ms, event_id),
            )


@pytest.mark.parametrize("archive", [False, True])
async def test_retention_removes_only_old_published_rows_in_batches(any_store: SQLStore, archive: bool) -> None:
    await insert_events(any_store, [envelope(f"e{i}") for i in range(7)])
    await age_and_publish(any_store, [f"e{i}" for i in range(5)], now_ms() - 86_400_000)
    await age_and_publish(any_store, ["e5"], now_ms())  # published but young
    report = await cleanup(any_store, RetentionOptions(older_than=3600, batch_size=2, pause=0, archive=archive))
    assert (report.removed, report.largest_batch) == (5, 2)
    assert sorted(await fetch_rows(any_store)) == ["e5", "e6"]
    if archive:
        async with any_store.transaction() as cur:
            await cur.execute("SELECT event_id, status FROM room_outbox_archive ORDER BY id")
            assert [tuple(row) for row in await cur.fetchall()] == [(f"e{i}", "published") for i in range(5)]
    assert (await cleanup(any_store, RetentionOptions(older_than=3600, pause=0, archive=archive))).removed == 0


async def test_retention_keeps_rows_a_lane_still_owes(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope("owed"), envelope("done")])
    lane = await lane_of(any_store)
    rows = {r.event_id: r for r in (await lane.claim("l#1", 10, now_ms() + 60_000)).rows}
    await lane.record([DeliveryResult(rows["done"].id, "done", "l#1", Outcome.PUBLISHED)])
    await age_and_publish(any_store, ["owed", "done"], now_ms() - 86_400_000)
    assert (await cleanup(any_store, RetentionOptions(older_than=3600, pause=0))).removed == 1
    assert sorted(await fetch_rows(any_store)) == ["owed"]


# -- operator commands ---------------------------------------------------------------------------


async def test_requeue_sends_parked_and_failing_rows_round_again(any_store: SQLStore) -> None:
    await insert_events(
        any_store, [envelope(f"e{i}", event_type="RoomGiftSent" if i else "RoomUserJoined") for i in range(4)]
    )
    rows = {r.event_id: r for r in (await any_store.claim("a#1", 10, now_ms() + 60_000)).rows}
    await any_store.record(
        [
            DeliveryResult(rows["e0"].id, "e0", "a#1", Outcome.PARKED, "permanent: group gone"),
            DeliveryResult(rows["e1"].id, "e1", "a#1", Outcome.FAILED, "timeout talking to IM", now_ms() + 600_000),
            DeliveryResult(rows["e2"].id, "e2", "a#1", Outcome.PUBLISHED),
        ]
    )
    found = await find_requeue_candidates(any_store, RequeueFilter(error_contains="group gone"))
    assert [r["event_id"] for r in found] == ["e0"]
    shouted = await find_requeue_candidates(any_store, RequeueFilter(error_contains="GROUP Gone"))
    assert [r["event_id"] for r in shouted] == ["e0"]  # whatever the case, on every database
    by_type = await find_requeue_candidates(any_store, RequeueFilter(event_type="RoomGiftSent"))
    assert [r["event_id"] for r in by_type] == ["e1"]  # e2 published, e3 leased right now
    assert await requeue(any_store, [found[0]["id"], by_type[0]["id"]]) == 2
    after = await fetch_rows(any_store)
    assert [(after[e]["status"], after[e]["retry_count"], after[e]["lock_until_ms"]) for e in ("e0", "e1")] == [
        ("pending", 0, 0)
    ] * 2
    assert sorted(r.event_id for r in (await any_store.claim("b#1", 10, now_ms() + 60_000)).rows) == ["e0", "e1"]


async def test_cancel_marks_a_pending_event_and_refuses_a_published_one(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope("e1"), envelope("e2")])
    await age_and_publish(any_store, ["e2"], now_ms())
    assert await cancel(any_store, "e1") == (True, "cancelled")
    assert await cancel(any_store, "e2") == (False, "published")
    assert await cancel(any_store, "nope") == (False, None)
    assert await any_store.claim("a#1", 10, now_ms() + 60_000) == Claimed([], [], exhausted=True)


async def test_status_and_inspect_report_the_im_lane_and_the_lanes(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope(f"e{i}") for i in range(3)])
    lane = await lane_of(any_store)
    (row, *_) = (await lane.claim("l#1", 10, now_ms() + 60_000)).rows
    await lane.record([DeliveryResult(row.id, row.event_id, "l#1", Outcome.PARKED, "bad")])
    (im_row, *_) = (await any_store.claim("node-a#1", 1, now_ms() + 60_000)).rows
    report = await status_report(any_store)
    assert (report.pending, report.leased, [h.node for h in report.holders]) == (3, 1, ["node-a"])
    assert [(x.lane, x.pending, x.parked, x.unfed, x.top_parked_errors) for x in report.lanes] == [
        ("audit", 2, 1, 0, [("bad", 1)])
    ]
    (doc,) = await inspect_events(any_store, im_row.event_id)
    assert doc["state"].startswith("in flight: leased by node-a#1")
    assert doc["lanes"] == {
        "audit": "parked after 1 attempt(s): never retried until `room-outbox requeue --lane audit`"
    }
    assert doc["envelope"]["event_id"] == im_row.event_id


async def test_status_lists_the_statuses_in_the_order_of_a_rows_life(any_store: SQLStore) -> None:
    """Pending, waiting for a retry, leased, then parked (``failed``), then cancelled last, in the
    table and in JSON; a lane's rows not fed yet, then pending, then parked."""
    await insert_events(any_store, [envelope(f"e{i}") for i in range(5)])
    lane = await lane_of(any_store)
    (row, *_) = (await lane.claim("l#1", 10, now_ms() + 60_000)).rows
    await lane.record([DeliveryResult(row.id, row.event_id, "l#1", Outcome.PARKED, "bad")])
    await any_store.claim("node-a#1", 1, now_ms() + 60_000)
    async with any_store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status = 'failed' WHERE event_id = 'e3'")
        await cur.execute("UPDATE room_outbox SET status = 'cancelled' WHERE event_id = 'e4'")
    await insert_events(any_store, [envelope("unfed")])
    report = await status_report(any_store)
    assert list(report.to_json()["other_statuses"].items()) == [("failed", 1), ("cancelled", 1)]
    lines = format_status(report).splitlines()
    counts = [line.split("  ")[0] for line in lines[: lines.index("")]]
    assert counts == ["pending", "oldest pending", "waiting for retry", "leased now", "failed", "cancelled"]
    header = next(line for line in lines if line.split()[:1] == ["lane"])
    assert header.split() == ["lane", "fed", "through", "id", "unfed", "pending", "parked"]
    assert list(report.to_json()["lanes"][0]) == [
        "lane",
        "fed_through_id",
        "unfed",
        "pending",
        "parked",
        "skipped",
        "top_parked_errors",
    ]


# -- table profile room_cell ---------------------------------------------------------------------


@pytest.fixture
async def room_cell(any_store: SQLStore) -> SQLStore:
    any_store.use_profile(ROOM_CELL)  # type: ignore[attr-defined]
    return any_store


def states(rows: dict[str, dict[str, Any]]) -> dict[str, tuple[str, int, str | None]]:
    return {e: (r["status"], r["retry_count"], r["worker_id"]) for e, r in rows.items()}


async def test_room_cell_claims_deliver_fail_and_park_in_its_own_words(room_cell: SQLStore) -> None:
    await insert_events(room_cell, [envelope(f"e{i}") for i in range(5)])
    rows = {r.event_id: r for r in (await room_cell.claim("a#1", 10, now_ms() + 60_000)).rows}
    assert states(await fetch_rows(room_cell)) == {f"e{i}": ("delivering", 0, "a#1") for i in range(5)}
    retry_at = now_ms() + 60_000
    stale = await room_cell.record(
        [
            DeliveryResult(rows["e0"].id, "e0", "a#1", Outcome.PUBLISHED),
            DeliveryResult(rows["e1"].id, "e1", "a#1", Outcome.FAILED, "timeout", retry_at),
            DeliveryResult(rows["e2"].id, "e2", "a#1", Outcome.PARKED, "permanent"),
            DeliveryResult(rows["e3"].id, "e3", "a#1", Outcome.RELEASED),
        ]
    )
    assert stale == []
    assert await room_cell.renew("a#1", [rows["e4"].id, rows["e0"].id], now_ms() + 90_000) == 1
    got = await fetch_rows(room_cell)
    assert states(got) == {
        "e0": ("delivered", 0, None),
        "e1": ("retryable", 1, None),
        "e2": ("failed", 1, None),
        "e3": ("pending", 0, None),  # released unattempted: back to what it was
        "e4": ("delivering", 0, "a#1"),
    }
    assert got["e1"]["lock_until_ms"] == retry_at
    # retryable is claimable once due; released after an attempt, a row stays retryable
    async with room_cell.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET lock_until_ms = 0 WHERE event_id = 'e1'")
    again = {r.event_id: r for r in (await room_cell.claim("b#1", 10, now_ms() + 60_000)).rows}
    assert sorted(again) == ["e1", "e3"]
    await room_cell.record(
        [
            DeliveryResult(again["e1"].id, "e1", "b#1", Outcome.RELEASED),
            DeliveryResult(again["e3"].id, "e3", "b#1", Outcome.THROTTLED, retry_at_ms=now_ms() + 60_000),
        ]
    )
    got = await fetch_rows(room_cell)
    assert (got["e1"]["status"], got["e3"]["status"], got["e3"]["retry_count"]) == ("retryable", "pending", 0)


async def test_room_cell_takes_over_a_delivering_row_whose_lock_ran_out(room_cell: SQLStore) -> None:
    """A row a crashed worker left ``delivering`` is claimable once ``lock_until_ms`` passes;
    the late result of the first worker is stale."""
    await insert_events(room_cell, [envelope("e1")])
    (first,) = (await room_cell.claim("dead#1", 10, now_ms() - 1)).rows
    (taken,) = (await room_cell.claim("live#1", 10, now_ms() + 60_000)).rows
    assert taken.event_id == "e1"
    late = DeliveryResult(first.id, "e1", "dead#1", Outcome.PUBLISHED)
    assert await room_cell.record([late]) == [late]
    assert await room_cell.record([DeliveryResult(taken.id, "e1", "live#1", Outcome.PUBLISHED)]) == []
    assert states(await fetch_rows(room_cell)) == {"e1": ("delivered", 0, None)}


async def test_room_cell_rows_room_service_marked_retryable_are_delivered(room_cell: SQLStore) -> None:
    """A room-service that writes the Room Cell words itself (``retryable`` after its own
    failed push) has those rows claimed too, once due, and holding back later rows of their room."""
    await insert_events(
        room_cell, [envelope("a1", room_id="A"), envelope("a2", room_id="A"), envelope("b1", room_id="B")]
    )
    async with room_cell.transaction() as cur:
        await cur.execute(
            "UPDATE room_outbox SET status = 'retryable', lock_until_ms = %s WHERE event_id = 'a1'",
            (now_ms() + 60_000,),
        )
    claimed = await room_cell.claim("x#1", 10, now_ms() + 60_000, per_room=True, hold_back_ms=0)
    assert [r.event_id for r in claimed.rows] == ["b1"]  # a2 waits behind the retryable a1
    async with room_cell.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET lock_until_ms = 0 WHERE event_id IN ('a1', 'a2')")
    claimed = await room_cell.claim("x#2", 10, now_ms() + 60_000, per_room=True)
    assert [r.event_id for r in claimed.rows] == ["a1", "a2"]


async def test_room_cell_operator_commands_and_retention_speak_its_words(room_cell: SQLStore) -> None:
    await insert_events(room_cell, [envelope(f"e{i}") for i in range(4)])
    rows = {r.event_id: r for r in (await room_cell.claim("a#1", 10, now_ms() + 60_000)).rows}
    await room_cell.record(
        [
            DeliveryResult(rows["e0"].id, "e0", "a#1", Outcome.PUBLISHED),
            DeliveryResult(rows["e1"].id, "e1", "a#1", Outcome.PARKED, "group gone"),
            DeliveryResult(rows["e2"].id, "e2", "a#1", Outcome.FAILED, "timeout", now_ms() + 60_000),
        ]
    )
    report = await status_report(room_cell)
    assert (report.pending, report.leased, report.waiting_for_retry, report.other_statuses) == (2, 1, 1, {"failed": 1})
    (doc,) = await inspect_events(room_cell, "e0")
    assert doc["state"].startswith("delivered: delivered")
    found = await find_requeue_candidates(room_cell, RequeueFilter(event_ids=("e1", "e2", "e3")))
    assert [r["event_id"] for r in found] == ["e1", "e2"]  # e3 is delivering under a live lock
    assert await requeue(room_cell, [r["id"] for r in found]) == 2
    assert await cancel(room_cell, "e2") == (True, "cancelled")
    assert await cancel(room_cell, "e0") == (False, "delivered")
    out = io.StringIO()
    assert await cancel_command(room_cell, "e0", out, out) == 1
    assert await requeue_command(room_cell, RequeueFilter(event_ids=("e0", "e2")), True, out) == 0
    assert out.getvalue().splitlines() == [
        "room-outbox cancel: e0 is delivered: only pending, retryable, delivering or failed events can be cancelled",
        "no rows match (delivered, cancelled and currently leased rows are never requeued)",
    ]
    async with room_cell.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET created_at_ms = 1 WHERE event_id = 'e0'")
    out = io.StringIO()
    assert await cleanup_command(room_cell, RetentionOptions(older_than=3600, pause=0), True, out, out, False) == 0
    assert out.getvalue().startswith("1 delivered row(s) older than 1h deleted in 1 batch(es)")
    assert states(await fetch_rows(room_cell)) == {
        "e1": ("pending", 0, None),
        "e2": ("cancelled", 0, None),  # requeued (a fresh count), then cancelled
        "e3": ("delivering", 0, "a#1"),
    }


async def test_an_event_id_several_apps_have_changes_no_row_until_the_app_is_named(room_cell: SQLStore) -> None:
    """Event ids unique per app only: ``cancel`` refuses an id that names rows of several apps
    (never another app's event unasked); named, only that app's row changes; requeue's filter
    takes the app too."""
    await key_event_ids_per_app(room_cell)
    await insert_events(room_cell, [envelope("x0", app_code="appa"), envelope("x0", app_code="appb")])
    assert [seen["app_code"] for _row, seen in await event_rows(room_cell, "x0")] == ["appa", "appb"]
    assert (await event_apps(room_cell, "x0"), await event_apps(room_cell, "nosuch")) == (["appa", "appb"], [])
    assert await cancel(room_cell, "x0") == (False, SEVERAL_APPS)
    assert await statuses_by_app(room_cell, "x0") == {"appa": "pending", "appb": "pending"}
    assert await cancel(room_cell, "x0", "appb") == (True, "cancelled")
    assert await cancel(room_cell, "x0", "appc") == (False, None)
    assert await statuses_by_app(room_cell, "x0") == {"appa": "pending", "appb": "cancelled"}
    found = await find_requeue_candidates(room_cell, RequeueFilter(event_ids=("x0",), app_code="appa"))
    assert [(r["app_code"], r["status"]) for r in found] == [("appa", "pending")]


# -- the producer ---------------------------------------------------------------------------------


async def test_a_duplicate_event_id_is_skipped_inside_the_callers_transaction(any_store: SQLStore) -> None:
    """The Python producer's append: a retried command re-appends its event; the first row
    stays as it was and the rest of the caller's transaction commits."""
    first = envelope("e1", payload={"n": 1})
    async with any_store.transaction() as cur:
        await append_event(cur, first, any_store.dialect)
    async with any_store.transaction() as cur:
        await append_event(cur, envelope("e1", payload={"n": 2}), any_store.dialect)  # the retry
        await append_event(cur, envelope("e2"), any_store.dialect)  # the same transaction's other work
    rows = await fetch_rows(any_store)
    assert sorted(rows) == ["e1", "e2"]
    assert json.loads(rows["e1"]["envelope"])["payload"] == {"n": 1}


async def test_database_table_names_another_outbox_table(store_dsn: str) -> None:
    """``database.table``: the same V1 layout under another name, migrated, claimed and
    reported there; room_outbox is never created."""
    store = await open_store(store_dsn, profile=profile_named("v1", "events_outbox"))
    try:
        changes = await store.migrate()
        assert (
            "created table events_outbox" in changes and "added index events_outbox.idx_events_outbox_claim" in changes
        )
        now = now_ms()
        async with store.transaction() as cur:
            await cur.execute(
                INSERT_V1.replace("room_outbox", "events_outbox"),
                ("default", "e1", "RoomUserJoined", "r_1", json.dumps(envelope("e1")), now, now),
            )
            assert "room_outbox" not in await table_names(cur, store.dialect)
        (row,) = (await store.claim("a#1", 10, now_ms() + 60_000)).rows
        assert await store.record([DeliveryResult(row.id, "e1", "a#1", Outcome.PUBLISHED)]) == []
        assert (await inspect_events(store, "e1"))[0]["row"]["status"] == "published"
    finally:
        await store.aclose()
