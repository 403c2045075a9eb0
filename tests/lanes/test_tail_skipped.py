"""What a tailing lane skipped: an id missing longer than ``gap_timeout`` is taken as a
rolled-back insert and passed over. When that insert commits after all, its event was never
sent; the lane records the ranges it gave up on, one row a range, so that ``inspect`` says so,
``status`` counts it, ``requeue --lane`` sends it and ``cancel --lane`` drops it, while retention
keeps its row and forgets old ranges that hold none. On MariaDB and PostgreSQL, in-process and
with real ``room-outbox`` processes on the real broker."""

from __future__ import annotations

import io
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lanes.conftest import Broker
from lanes.test_lane_lifecycle import cli, write
from lanes.test_lanes import consume, event_ids
from lanes.test_tail import OrderedLog
from processes import DispatcherProcess
from support import envelope, fetch_rows, id_held_open, insert_events, wait_until

from room_outbox.cli.cancel import cancel_lane_command
from room_outbox.cli.inspect import inspect_command, inspect_events
from room_outbox.cli.requeue import requeue_lane_command
from room_outbox.config import LanePlan
from room_outbox.delivery.routing import Router
from room_outbox.delivery.tail import TailRelay
from room_outbox.errors import SchemaError
from room_outbox.observability.redaction import Redactor
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.catalog import retire_lane
from room_outbox.store.lanes.store import CURSOR_TABLE, migrate_lanes
from room_outbox.store.lanes.tail import TailStore, migrate_tail
from room_outbox.store.operator.changes import RequeueFilter
from room_outbox.store.operator.reports import lane_statuses
from room_outbox.store.operator.retention import RetentionOptions, cleanup
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.tail import SKIPPED_TABLE

pytestmark = pytest.mark.anyio

#: The lanes' gap_timeout here: short, so that a test waits for it.
GAP_TIMEOUT = 0.5
SKIPPED_STATE = "skipped by the tailing lane, never sent"
SENT_STATE = "sent by the tailing lane (or before the lane's start)"


@pytest.fixture(params=["mariadb", "postgresql"])
async def any_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    store = await open_store(
        request.getfixturevalue("database_dsn" if request.param == "mariadb" else "postgresql_dsn")
    )
    await store.migrate()
    await migrate_tail(store, ["kafka"])
    try:
        yield store
    finally:
        await store.aclose()


def log_relay(store: SQLStore, sink: OrderedLog) -> TailRelay:
    tail = TailStore(owner=store, lane="kafka", start="beginning", feed_batch=25, gap_timeout=GAP_TIMEOUT)
    router = Router({"kafka": sink}, {}, catch_all="kafka", skip_unrouted=True)
    return TailRelay(tail, router, poll_interval=0.05, publish_timeout=5.0, redactor=Redactor())


async def cursor(store: SQLStore) -> int:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT fed_through_id FROM {CURSOR_TABLE} WHERE lane = 'kafka'")
        return int((await cur.fetchone())[0])


async def highest_id(store: SQLStore) -> int:
    async with store.transaction() as cur:
        await cur.execute("SELECT MAX(id) FROM room_outbox")
        return int((await cur.fetchone())[0])


async def skipped_ranges(store: SQLStore) -> list[tuple[int, int]]:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT low_id, high_id FROM {SKIPPED_TABLE} WHERE lane = 'kafka' ORDER BY low_id")
        return [(int(low), int(high)) for low, high in await cur.fetchall()]


async def rounds_until_past_everything(relay: TailRelay, store: SQLStore) -> None:
    """Rounds until the cursor is at the highest id: every id still missing given up on."""
    target = await highest_id(store)

    async def past() -> bool:
        await relay.run_once()
        return await cursor(store) >= target

    await wait_until(past, timeout=GAP_TIMEOUT + 10)


async def skip_late(store: SQLStore, sink: OrderedLog, event_id: str = "late") -> TailRelay:
    """``event_id`` inserted in a transaction held past gap_timeout while ``after`` commits and
    is sent, then committed: the lane has skipped it."""
    relay = log_relay(store, sink)
    await insert_events(store, [envelope("before")])
    async with id_held_open(store, event_id):
        await insert_events(store, [envelope("after")])
        await rounds_until_past_everything(relay, store)
    await relay.run_once()
    return relay


async def lane_state(store: SQLStore, event_id: str) -> str:
    (doc,) = await inspect_events(store, event_id)
    return str(doc["lanes"]["kafka"])


async def skipped_count(store: SQLStore) -> int:
    (kafka,) = [lane for lane in await lane_statuses(store) if lane.lane == "kafka"]
    return kafka.skipped


async def test_an_event_committed_after_the_lane_skipped_its_id_is_shown_counted_kept_and_sent_on_requeue(
    any_store: SQLStore,
) -> None:
    sink = OrderedLog()
    relay = await skip_late(any_store, sink)
    assert sink.sent == ["before", "after"]  # the lane went on without it, and never reads it again

    assert (await lane_state(any_store, "late")).startswith(SKIPPED_STATE), await lane_state(any_store, "late")
    assert await lane_state(any_store, "after") == SENT_STATE
    assert await skipped_count(any_store) == 1

    # Retention keeps the row the lane owes, however old, delivered by IM or not.
    async with any_store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status = 'published', created_at_ms = created_at_ms - 864000000")
    options, plan = RetentionOptions(older_than=86400, pause=0), LanePlan(main=True, own=("kafka",))
    assert (await cleanup(any_store, options, plan)).removed == 2
    assert list(await fetch_rows(any_store)) == ["late"]

    out, err = io.StringIO(), io.StringIO()
    assert await requeue_lane_command(any_store, "kafka", RequeueFilter(event_ids=("late",)), True, out, err) == 0
    assert "requeued 1 event(s) in lane kafka" in out.getvalue(), out.getvalue() + err.getvalue()
    await relay.run_once()
    assert sink.sent == ["before", "after", "late"]
    assert await lane_state(any_store, "late") == SENT_STATE
    assert await skipped_count(any_store) == 0
    assert await skipped_ranges(any_store) == []  # its one id left the range


async def test_requeue_lane_selects_skipped_events_with_its_filters_and_cancel_drops_one(any_store: SQLStore) -> None:
    sink = OrderedLog()
    relay = log_relay(any_store, sink)
    await insert_events(any_store, [envelope("before")])
    async with id_held_open(any_store, "late-1", room_id="r1"), id_held_open(any_store, "late-2", room_id="r2"):
        await insert_events(any_store, [envelope("after")])
        await rounds_until_past_everything(relay, any_store)
    assert await skipped_count(any_store) == 2

    async def requeue(where: RequeueFilter, apply: bool = False) -> str:
        out, err = io.StringIO(), io.StringIO()
        assert await requeue_lane_command(any_store, "kafka", where, apply, out, err) == 0, err.getvalue()
        return out.getvalue()

    assert "2 event(s) would be requeued" in await requeue(RequeueFilter())  # no filter: all of them
    assert "1 event(s) would be requeued" in await requeue(RequeueFilter(event_ids=("late-2",)))
    assert "2 event(s) would be requeued" in await requeue(RequeueFilter(error_contains="GAP_TIMEOUT"))
    assert "no parked or skipped events" in await requeue(RequeueFilter(error_contains="too large"))
    assert "no parked or skipped events" in await requeue(RequeueFilter(event_type="NoSuchType"))

    out, err = io.StringIO(), io.StringIO()
    assert await cancel_lane_command(any_store, "kafka", "late-1", out, err) == 0, err.getvalue()
    assert "cancelled late-1 in lane kafka" in out.getvalue()
    assert (await lane_state(any_store, "late-1")).startswith("cancelled by an operator")
    assert "requeued 1 event(s) in lane kafka" in await requeue(RequeueFilter(), apply=True)
    await relay.run_once()
    assert "late-1" not in sink.sent and sink.sent[-1] == "late-2"
    assert await skipped_count(any_store) == 0


async def test_a_rolled_back_batch_of_inserts_is_recorded_as_one_range_that_retention_forgets(
    any_store: SQLStore,
) -> None:
    """However many ids a rolled-back transaction held, the lane keeps one row for them; once
    older than retention.older_than with no row in it, cleanup drops it, and keeps a range
    that still holds an event owed."""

    class RolledBack(Exception):
        pass

    sink = OrderedLog()
    relay = log_relay(any_store, sink)
    await insert_events(any_store, [envelope("before")])
    with pytest.raises(RolledBack):
        async with any_store.transaction() as cur:
            for n in range(200):
                await cur.execute(
                    "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, created_at_ms,"
                    " updated_at_ms) VALUES ('', %s, 'RoomUserJoined', 'gone', '{}', 0, 0)",
                    (f"gone{n}",),
                )
            raise RolledBack
    await insert_events(any_store, [envelope("after")])
    await rounds_until_past_everything(relay, any_store)
    (rolled_back,) = await skipped_ranges(any_store)
    assert rolled_back[1] - rolled_back[0] + 1 >= 200

    async with id_held_open(any_store, "late"):
        await insert_events(any_store, [envelope("after-late")])
        await rounds_until_past_everything(relay, any_store)
    assert len(await skipped_ranges(any_store)) == 2

    options, plan = RetentionOptions(older_than=3600, pause=0), LanePlan(main=False, own=("kafka",))
    assert (await cleanup(any_store, options, plan)).skipped_ranges_removed == 0  # recent: kept
    later = await cleanup(any_store, options, plan, now=now_ms() + 2 * 3600 * 1000)
    assert later.skipped_ranges_removed == 1
    assert (await skipped_ranges(any_store))[0][0] > rolled_back[1]  # the one holding "late" stays
    assert "late" in await fetch_rows(any_store)
    assert (await lane_state(any_store, "late")).startswith(SKIPPED_STATE)
    assert "deleted 1 skipped id range(s) of lane kafka" in await retire_lane(any_store, "kafka")


async def test_inspect_says_no_scan_claims_a_row_when_the_main_lane_is_off(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope("e1")])
    out, err = io.StringIO(), io.StringIO()
    assert await inspect_command(any_store, "e1", False, out, err, main_lane=False) == 0, err.getvalue()
    (state,) = [line for line in out.getvalue().splitlines() if line.startswith("state:")]
    assert "due" not in state and "the main lane is disabled here" in state, state


@pytest.fixture(params=["mariadb", "postgresql"])
def dsn(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("database_dsn" if request.param == "mariadb" else "postgresql_dsn"))


async def test_a_kafka_only_deployment_shows_counts_and_sends_an_event_committed_after_gap_timeout(
    dsn: str, kafka_broker: Broker, tmp_path: Path
) -> None:
    """The operator's view with real processes: Kafka alone (IM pushed by room-service), an
    insert held past gap_timeout while later events are sent, then committed. ``inspect`` says
    it was skipped (and that no scan claims the row), ``status`` counts it, and ``requeue --lane
    kafka --event-id`` gets it onto the topic."""
    config = write(tmp_path / "kafka-only.yaml", {
        "database": {"dsn": dsn},
        "outbox_worker": {"poll_interval": "50ms", "batch_size": 20},
        "lanes": {"gap_timeout": "2s"},
        "sinks": {"tencent_im": {"enabled": False}, "noop": {"enabled": False},
                  "kafka": {"enabled": True, "bootstrap_servers": kafka_broker.bootstrap, "start": "beginning"}},
    })  # fmt: skip
    migrated = cli(config, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    store = await open_store(dsn)
    proc = DispatcherProcess(config, "tail-skipped")
    try:
        await insert_events(store, [envelope("before")])
        await consume(kafka_broker, {"before"}, timeout=60)
        async with id_held_open(store, "late", room_id="r_late"):
            await insert_events(store, [envelope("after")])
            await consume(kafka_broker, {"after"}, timeout=60)
            await wait_until(lambda: any(line.get("msg", "").startswith("ids never committed within gap_timeout")
                                         for line in proc.lines()), timeout=30)  # fmt: skip

        async def counted() -> bool:
            return "lane kafka: 1 event(s) skipped and never sent" in cli(config, "status").stdout

        await wait_until(counted, timeout=30)
        inspected = cli(config, "inspect", "late")
        assert f"lane kafka: {SKIPPED_STATE}" in inspected.stdout, inspected.stdout + inspected.stderr
        (state,) = [line for line in inspected.stdout.splitlines() if line.startswith("state:")]
        assert "due" not in state, state
        requeued = cli(config, "requeue", "--lane", "kafka", "--event-id", "late", "--yes")
        assert "requeued 1 event(s) in lane kafka" in requeued.stdout, requeued.stdout + requeued.stderr
        messages = await consume(kafka_broker, {"before", "after", "late"}, timeout=60)
        assert event_ids(messages).count("late") == 1
        status = cli(config, "status")
        assert "skipped and never sent" not in status.stdout, status.stdout
        assert f"lane kafka: {SENT_STATE}" in cli(config, "inspect", "late").stdout
    finally:
        proc.terminate()
        await store.aclose()


async def test_a_lane_is_not_switched_back_to_a_lane_table_while_an_event_it_skipped_waits(any_store: SQLStore) -> None:
    """A lane table goes on from the cursor and would never send an event the tailing lane
    skipped: migrate refuses, naming it, until it is sent or cancelled; then its ranges go."""
    await skip_late(any_store, OrderedLog())
    with pytest.raises(SchemaError, match=re.escape("lane kafka has 1 event(s) it parked or skipped while it tailed")):
        await migrate_lanes(any_store, ["kafka"])
    assert await cancel_lane_command(any_store, "kafka", "late", io.StringIO(), io.StringIO()) == 0
    assert (await migrate_lanes(any_store, ["kafka"]))[0] == "created table room_outbox_lane_kafka"
    assert await skipped_ranges(any_store) == []
