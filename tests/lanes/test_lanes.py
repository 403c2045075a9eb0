"""Lanes of their own: feeding without gaps, start positions, several processes, independence
from the main lane, the Kafka sink on a real broker, seed 003's deployment, a third-party sink."""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiomysql
import anyio
import pytest
import yaml
from aiokafka import AIOKafkaConsumer
from lanes.conftest import Broker
from store.test_silk import silk_publish
from support import INSERT_V1, RecordingSink, envelope, fetch_rows, insert_events, running, wait_until

from bench.drive import run_until_empty
from room_outbox.app import run_service
from room_outbox.attempt.retry import RetryPolicy
from room_outbox.config import Settings, load_settings
from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
from room_outbox.delivery.routing import Router
from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID, serve_fake_im
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.store import CURSOR_TABLE, LaneStore, migrate_lanes
from room_outbox.store.schema.profiles import SILK, V1

pytestmark = pytest.mark.anyio


def lane_dispatcher(store: MySQLStore, sink: RecordingSink, lane: str = "t", node: str = "n1", **kw: Any) -> Dispatcher:
    lane_store = LaneStore(
        owner=store, lane=lane, start=kw.pop("start", "beginning"), gap_timeout=kw.pop("gap_timeout", 30.0)
    )
    router = Router({"t": sink}, {}, catch_all="t", skip_unrouted=True)
    options = LaneOptions(poll_interval=0.05, **{"retry": RetryPolicy(interval=0.05), **kw})
    return Dispatcher(lane_store, router, options, node)


async def lane_rows(store: MySQLStore, lane: str = "t") -> dict[str, dict[str, Any]]:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT * FROM room_outbox_lane_{lane} ORDER BY outbox_id")
        names = [d[0] for d in cur.description]
        return {row[names.index("event_id")]: dict(zip(names, row, strict=True)) for row in await cur.fetchall()}


async def watermark(store: MySQLStore, lane: str = "t") -> int:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT fed_through_id FROM {CURSOR_TABLE} WHERE lane = %s", (lane,))
        return int((await cur.fetchone())[0])


async def max_id(store: MySQLStore) -> int:
    async with store.transaction() as cur:
        await cur.execute("SELECT MAX(id) FROM room_outbox")
        return int((await cur.fetchone())[0])


async def test_migrate_creates_the_lane_tables_idempotently(store: MySQLStore) -> None:
    assert await migrate_lanes(store, ["kafka", "audit"]) == [
        "created table room_outbox_lane_cursor", "created table room_outbox_tail_skipped",
        "created table room_outbox_lane_kafka", "created table room_outbox_lane_audit",
        "added column room_outbox_lane_kafka.room_bucket",
        "added index room_outbox_lane_kafka.idx_room_outbox_lane_kafka_claim",  # with the bucket: after it
        "added column room_outbox_lane_audit.room_bucket",
        "added index room_outbox_lane_audit.idx_room_outbox_lane_audit_claim",
    ]  # fmt: skip
    assert await migrate_lanes(store, ["kafka", "audit"]) == []


async def test_a_row_whose_transaction_commits_late_is_fed_exactly_once(store: MySQLStore, database_dsn: str) -> None:
    await migrate_lanes(store, ["t"])
    sink = RecordingSink()
    dispatcher = lane_dispatcher(store, sink)
    await insert_events(store, [envelope("before")])
    late = await aiomysql.connect(**store.address.connect_kwargs(), db=store.address.database)
    try:
        async with late.cursor() as cur:  # holds the next id, commits later
            await cur.execute(
                INSERT_V1, ("default", "late", "RoomUserJoined", "r_1", json.dumps(envelope("late")), 1, 1)
            )
        await insert_events(store, [envelope("after1"), envelope("after2")])
        for _ in range(4):  # several scan intervals pass while "late" is uncommitted
            await run_until_empty(dispatcher)
        assert sorted(sink.received) == ["after1", "after2", "before"]
        assert await watermark(store) < await max_id(store)  # held below the missing id
        await late.commit()
    finally:
        late.close()
    await wait_until(lambda: _delivered(dispatcher, sink, "late"))
    assert sorted(sink.received) == ["after1", "after2", "before", "late"]  # each exactly once
    await run_until_empty(dispatcher)
    assert await watermark(store) == await max_id(store)
    assert {r["status"] for r in (await lane_rows(store)).values()} == {"published"}


async def _delivered(dispatcher: Dispatcher, sink: RecordingSink, event_id: str) -> bool:
    await run_until_empty(dispatcher)
    return event_id in sink.received


async def test_a_rolled_back_id_is_skipped_after_gap_timeout(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    await migrate_lanes(store, ["t"])
    sink = RecordingSink()
    dispatcher = lane_dispatcher(store, sink, gap_timeout=0.3)
    async with store.transaction() as cur:
        await cur.execute(INSERT_V1, ("default", "first", "RoomUserJoined", "r_1", json.dumps(envelope("first")), 1, 1))
    conn = await aiomysql.connect(**store.address.connect_kwargs(), db=store.address.database)
    async with conn.cursor() as cur:
        await cur.execute(INSERT_V1, ("default", "ghost", "RoomUserJoined", "r_1", "{}", 1, 1))
    await conn.rollback()
    conn.close()
    await insert_events(store, [envelope("last")])

    async def advanced() -> bool:
        await run_until_empty(dispatcher)
        return await watermark(store) == await max_id(store)

    with caplog.at_level(logging.WARNING):
        await wait_until(advanced, timeout=10)
    assert sorted(sink.received) == ["first", "last"]
    assert any("taken as rolled back" in r.message for r in caplog.records)


@pytest.mark.parametrize(
    ("start", "expected"), [("now", ["new"]), ("beginning", ["old1", "old2", "new"]), ("id", ["old2", "new"])]
)
async def test_start_positions(store: MySQLStore, start: str, expected: list[str]) -> None:
    await migrate_lanes(store, ["t"])
    await insert_events(store, [envelope("old1"), envelope("old2")])
    rows = await fetch_rows(store)
    position: str | int = rows["old2"]["id"] if start == "id" else start
    sink = RecordingSink()
    dispatcher = lane_dispatcher(store, sink, start=position)
    await run_until_empty(dispatcher)  # the lane starts here
    await insert_events(store, [envelope("new")])
    await run_until_empty(dispatcher)
    assert sink.received == expected


async def test_two_processes_feed_and_deliver_each_event_once(store: MySQLStore) -> None:
    await migrate_lanes(store, ["t"])
    sinks = [RecordingSink(), RecordingSink()]
    dispatchers = [lane_dispatcher(store, s, node=f"p{n}", batch_size=40) for n, s in enumerate(sinks)]
    async with running(*dispatchers):
        for chunk in range(6):
            await insert_events(store, [envelope(f"e{chunk}-{i}", room_id=f"r_{i % 5}") for i in range(100)])

        async def all_done() -> bool:
            rows = await lane_rows(store)
            return len(rows) == 600 and {r["status"] for r in rows.values()} == {"published"}

        await wait_until(all_done, timeout=60)
    received = sinks[0].received + sinks[1].received
    assert len(received) == 600 and len(set(received)) == 600


# -- Kafka on a real broker --------------------------------------------------------------------


async def consume(broker: Broker, expect: set[str], timeout: float = 30.0) -> list[Any]:
    """Read the topic from the beginning until every event_id in ``expect`` arrived (or fail).
    Counting messages is not enough: a send retried after a lost acknowledgement repeats."""
    consumer = AIOKafkaConsumer(
        broker.topic, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    messages: list[Any] = []
    try:
        deadline = time.monotonic() + timeout
        while not expect <= set(event_ids(messages)) and time.monotonic() < deadline:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                messages.extend(batch)
    finally:
        await consumer.stop()
    missing = expect - set(event_ids(messages))
    assert not missing, f"never arrived: {sorted(missing)}"
    return messages


def event_ids(messages: list[Any]) -> list[str]:
    return [dict(m.headers)["event_id"].decode() for m in messages]


def lane_settings(
    dsn: str, broker: Broker, im_base_url: str | None, relay: str = "lane_table", **worker: Any
) -> Settings:
    """The Kafka sink in its lane table (``relay: lane_table``) unless ``relay`` says ``tail``."""
    sinks: dict[str, Any] = {
        "kafka": {"bootstrap_servers": broker.bootstrap, "start": "beginning", "request_timeout": "2s", "relay": relay}
    }
    if im_base_url:
        sinks["tencent_im"] = {"base_url": im_base_url, "sdkappid": DEV_SDKAPPID, "secret_key": DEV_KEY}
    else:
        sinks["tencent_im"] = {"enabled": False}
    return Settings(
        mysql={"dsn": dsn},
        node_id="lanes",
        outbox_worker={"poll_interval": "50ms", "publish_timeout": "1s", "ordering": "per_room", **worker},
        sinks=sinks,
    )


async def migrate_all(store: MySQLStore, settings: Settings) -> None:
    from room_outbox.delivery.lanes import migrate_plugins
    from room_outbox.plugin_manager import make_plugin_manager

    await migrate_plugins(store, make_plugin_manager(), settings)


async def test_kafka_lane_publishes_one_message_per_event_in_room_order(
    store: MySQLStore, database_dsn: str, kafka_broker: Broker
) -> None:
    async with serve_fake_im() as fake:
        settings = lane_settings(database_dsn, kafka_broker, fake.base_url)
        await migrate_all(store, settings)
        events = [envelope(f"k{v:02}-{room}", room_id=room, room_version=v, traceparent=f"00-{'a' * 32}-{'b' * 16}-01")
                  for v in range(15) for room in ("r_a", "r_b", "r_c")]  # fmt: skip
        await insert_events(store, events)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_service(settings, stop, handle_signals=False))
            messages = await consume(kafka_broker, {e["event_id"] for e in events})
            await wait_until(lambda: len(fake.messages) == 45, timeout=30)  # the main lane ran too
            stop.set()
    ids = event_ids(messages)
    assert sorted(ids) == sorted(e["event_id"] for e in events)  # one message per event_id
    versions: dict[bytes, list[int]] = defaultdict(list)
    for message in messages:
        versions[message.key].append(json.loads(message.value)["room_version"])
        assert dict(message.headers).keys() == {"event_id", "event_type", "traceparent"}
    assert set(versions) == {b"default:r_a", b"default:r_b", b"default:r_c"}
    assert all(v == list(range(15)) for v in versions.values()), versions
    assert {r["status"] for r in (await lane_rows(store, "kafka")).values()} == {"published"}


@pytest.mark.serial
async def test_an_im_outage_does_not_delay_kafka(store: MySQLStore, database_dsn: str, kafka_broker: Broker) -> None:
    async with serve_fake_im() as fake:
        fake.set_faults(hang_rate=1.0)  # IM never answers
        settings = lane_settings(database_dsn, kafka_broker, fake.base_url, publish_timeout="10s")
        await migrate_all(store, settings)
        await insert_events(store, [envelope(f"i{n}", room_id=f"r_{n}") for n in range(30)])
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_service(settings, stop, handle_signals=False))
            await consume(kafka_broker, {f"i{n}" for n in range(30)}, timeout=20)
            # Kafka has every event while IM's first attempts are still waiting for an answer
            # (none has ended: that takes publish_timeout), so the Kafka lane waited for none.
            im_rows = (await fetch_rows(store)).values()
            assert all((r["status"], r["retry_count"], r["last_error"]) == ("pending", 0, None) for r in im_rows)
            stop.set()


async def test_a_kafka_outage_does_not_delay_im_and_loses_nothing(
    store: MySQLStore, database_dsn: str, kafka_broker: Broker
) -> None:
    async with serve_fake_im() as fake:
        settings = lane_settings(database_dsn, kafka_broker, fake.base_url)
        await migrate_all(store, settings)
        await insert_events(store, [envelope(f"a{n}", room_id=f"r_{n % 4}", room_version=n) for n in range(20)])
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_service(settings, stop, handle_signals=False))
            await consume(kafka_broker, {f"a{n}" for n in range(20)})
            kafka_broker.stop()  # the broker goes away mid-run
            await insert_events(
                store, [envelope(f"b{n}", room_id=f"r_{n % 4}", room_version=20 + n) for n in range(20)]
            )

            async def im_done() -> bool:
                return len(fake.messages) == 40

            await wait_until(im_done, timeout=20)  # IM goes on while Kafka is down

            async def kafka_failing() -> bool:
                return any(r["retry_count"] > 0 for r in (await lane_rows(store, "kafka")).values())

            await wait_until(kafka_failing, timeout=30)
            kafka_broker.start()  # back (memory storage: an empty broker)
            await consume(kafka_broker, {f"b{n}" for n in range(20)}, timeout=60)  # nothing lost
            stop.set()
    assert {r["status"] for r in (await lane_rows(store, "kafka")).values()} == {"published"}


async def test_seed_003_deployment_kafka_lane_only(
    store: MySQLStore, database_dsn: str, kafka_broker: Broker, tmp_path: Path
) -> None:
    """room-service pushes IM itself; room-outbox runs only the Kafka lane (config/config.kafka-only.yaml)."""
    config = yaml.safe_load((Path(__file__).parents[2] / "config" / "config.kafka-only.yaml").read_text())
    config["mysql"]["dsn"] = database_dsn
    config["sinks"]["kafka"]["bootstrap_servers"] = kafka_broker.bootstrap
    config["sinks"]["kafka"]["start"] = "beginning"
    config["outbox_worker"]["poll_interval"] = "50ms"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(path)
    await migrate_all(store, settings)
    await insert_events(store, [envelope(f"s{n}") for n in range(10)])
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_service(settings, stop, handle_signals=False))
        await consume(kafka_broker, {f"s{n}" for n in range(10)})
        stop.set()
    assert {r["status"] for r in (await fetch_rows(store)).values()} == {"pending"}  # the main lane is room-service's


async def test_third_party_audit_sink_end_to_end(store: MySQLStore, database_dsn: str, tmp_path: Path) -> None:
    """examples/audit_sink, installed through its entry point: migrate makes its tables, run fills them."""
    from room_outbox.cli.main import main
    from room_outbox.plugin_manager import make_plugin_manager

    assert make_plugin_manager().has_plugin("audit"), (
        "examples/audit_sink is not installed (scripts/install.sh does it)"
    )
    path = tmp_path / "config.yaml"
    sinks = {
        "tencent_im": {"enabled": False},
        "audit_table": {"enabled": True, "dsn": database_dsn, "start": "beginning"},
    }
    path.write_text(
        yaml.safe_dump({"mysql": {"dsn": database_dsn}, "sinks": sinks, "outbox_worker": {"poll_interval": "50ms"}})
    )
    assert await anyio.to_thread.run_sync(main, ["--config", str(path), "migrate"]) == 0
    await insert_events(
        store, [envelope(f"au{n}", "RoomGiftSent") for n in range(5)] + [envelope("au-created", "RoomCreated")]
    )
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_service(load_settings(path), stop, handle_signals=False))

        async def audited() -> bool:
            async with store.transaction() as cur:
                await cur.execute("SELECT COUNT(*) FROM room_outbox_audit_log")
                return int((await cur.fetchone())[0]) == 6

        await wait_until(audited, timeout=20)
        stop.set()
    rows = await fetch_rows(store)
    assert rows["au-created"]["status"] == "published"  # noop ran in the main lane beside it


async def test_retention_keeps_rows_a_lane_still_needs(store: MySQLStore) -> None:
    """Cleanup removes an old published row only once every lane has been fed it and is done
    with it; the lanes' finished rows go with it."""
    from room_outbox.store.operator.retention import RetentionOptions, cleanup

    await migrate_lanes(store, ["t"])
    sink = RecordingSink(fail={"owed"})
    dispatcher = lane_dispatcher(store, sink)
    await insert_events(store, [envelope("done1"), envelope("owed"), envelope("done2")])
    await run_until_empty(dispatcher)  # the lane: done1, done2 published; owed pending
    await insert_events(store, [envelope("unfed")])  # the lane has not read this one yet
    async with store.transaction() as cur:  # all old, all published in the main lane
        await cur.execute("UPDATE room_outbox SET status = 'published', created_at_ms = created_at_ms - 864000000")
    report = await cleanup(store, RetentionOptions(older_than=86400, pause=0))
    assert report.removed == 2
    assert sorted(await fetch_rows(store)) == ["owed", "unfed"]
    assert sorted(await lane_rows(store)) == ["owed"]


async def test_status_shows_each_lane(store: MySQLStore) -> None:
    from room_outbox.cli.status import format_status, status_report

    await migrate_lanes(store, ["t"])
    dispatcher = lane_dispatcher(store, RecordingSink(fail={"stuck"}))
    await insert_events(store, [envelope("ok"), envelope("stuck")])
    await run_until_empty(dispatcher)
    await insert_events(store, [envelope("later")])
    report = await status_report(store)
    (lane,) = report.lanes
    assert (lane.lane, lane.unfed, lane.pending, lane.parked) == ("t", 1, 1, 0)
    assert "fed through id" in format_status(report)


async def test_inspect_shows_the_event_in_each_lane(store: MySQLStore) -> None:
    from room_outbox.cli.inspect import format_inspection, inspect_events

    await migrate_lanes(store, ["t"])
    # "stuck" waits a minute for its retry, so it is still waiting however slow the machine is
    dispatcher = lane_dispatcher(store, RecordingSink(fail={"stuck"}), retry=RetryPolicy(interval=60))
    await insert_events(store, [envelope("ok"), envelope("stuck")])
    await run_until_empty(dispatcher)
    await insert_events(store, [envelope("later")])
    assert (await inspect_events(store, "ok"))[0]["lanes"]["t"].startswith("published")
    assert (await inspect_events(store, "stuck"))[0]["lanes"]["t"].startswith("waiting: failed 1 time(s)")
    (doc,) = await inspect_events(store, "later")
    assert doc["lanes"] == {"t": "not fed to this lane yet"}
    assert "lane t: not fed to this lane yet" in format_inspection(doc, V1.time_columns)


async def test_unfed_rows_beyond_the_counted_ones_are_estimated_from_their_ids(store: MySQLStore) -> None:
    """A lane's unfed rows are counted one by one only up to a bound (a million of them would
    outlast the gauge's query timeout); beyond it they are estimated from the ids, at the density
    of the counted ones: exact for ids of one step, the step 1 here and 3 below."""
    from room_outbox.store.lanes.catalog import own_lane_backlog, stored_lanes

    await migrate_lanes(store, ["t"])
    dispatcher = lane_dispatcher(store, RecordingSink())
    await insert_events(store, [envelope("first")])
    await run_until_empty(dispatcher)  # the lane has run: fed through "first"
    await insert_events(store, [envelope(f"e{n}") for n in range(10)])
    (lane,) = await stored_lanes(store)
    assert (await own_lane_backlog(store, lane)).unfed == 10  # counted
    assert (await own_lane_backlog(store, lane, counted=3)).unfed == 10  # 3 counted, 7 estimated
    async with store.transaction() as cur:  # ids three apart, as with auto_increment_increment = 3
        await cur.execute("UPDATE room_outbox SET id = id * 3 + 1000 WHERE event_id LIKE 'e%%'")
    (lane,) = await stored_lanes(store)
    assert (await own_lane_backlog(store, lane, counted=3)).unfed == 10
    assert (await own_lane_backlog(store, lane, counted=2)).unfed == 10


async def test_rows_fed_in_a_claim_that_rolls_back_are_fed_again(store: MySQLStore) -> None:
    """Feeding is the first step of the claim's transaction: when that transaction fails after
    feeding, its inserts are rolled back, so the feeder must not count those rows as fed."""

    class FailsOnce(LaneStore):
        failed = False

        async def _apply_results(self, cur: Any, results: Any) -> Any:
            if not self.failed:
                self.failed = True
                raise RuntimeError("the claim's transaction fails after feeding")
            return await super()._apply_results(cur, results)

    await migrate_lanes(store, ["t"])
    await insert_events(store, [envelope("a"), envelope("b")])
    lane = FailsOnce(owner=store, lane="t", start="beginning")
    with pytest.raises(RuntimeError):
        await lane.claim("c#1", 10, int(time.time() * 1000) + 30_000)
    assert await lane_rows(store) == {}  # rolled back
    claimed = await lane.claim("c#2", 10, int(time.time() * 1000) + 30_000)
    assert sorted(row.event_id for row in claimed.rows) == ["a", "b"]


async def test_a_fed_row_gone_from_room_outbox_fails_with_a_clear_error_and_blocks_nothing(store: MySQLStore) -> None:
    """The lane reads each row's envelope from room_outbox as it claims it: a row deleted there
    after it was fed has none, and fails saying so instead of vanishing or stopping the lane."""
    await migrate_lanes(store, ["t"])
    await insert_events(store, [envelope("gone"), envelope("kept")])
    lane = LaneStore(owner=store, lane="t", start="beginning")
    assert await lane.feed() == 2
    async with store.transaction() as cur:
        await cur.execute("DELETE FROM room_outbox WHERE event_id = 'gone'")
    sink = RecordingSink()
    retry = RetryPolicy(interval=60.0, base=60.0, cap=60.0, jitter=0.0)  # tried once, however slow the machine
    await run_until_empty(lane_dispatcher(store, sink, retry=retry))
    assert sink.received == ["kept"]
    rows = await lane_rows(store)
    assert rows["kept"]["status"] == "published"
    assert (rows["gone"]["status"], rows["gone"]["retry_count"]) == ("pending", 1)  # as any bad envelope
    assert "no envelope: the column is NULL, or the row is gone from room_outbox" in rows["gone"]["last_error"]


async def test_silks_longest_room_ids_are_fed_and_delivered(postgresql_dsn: str) -> None:
    """silk's aggregate_id (its rooms) holds up to 128 characters, twice V1's room ids: a lane
    keeps them whole (too long for its column, a row would stop the lane's feeding)."""
    store = await open_store(postgresql_dsn, profile=SILK)
    try:
        await store.migrate()
        await migrate_lanes(store, ["t"])
        await silk_publish(store, ("long", "u" * 128, {"n": 1}), ("short", "u2", {"n": 2}))
        sink = RecordingSink()
        await run_until_empty(lane_dispatcher(store, sink))
        assert sorted(sink.received) == ["long", "short"]
        assert (await lane_rows(store))["long"]["room_id"] == "u" * 128
    finally:
        await store.aclose()


@pytest.mark.parametrize("server", ["mariadb", "postgresql"])
async def test_values_wider_than_a_lanes_copies_neither_stop_the_lane_nor_reach_the_sink_cut(
    server: str, request: pytest.FixtureRequest
) -> None:
    """room-service's text columns may be wider than a lane's copies (TEXT on PostgreSQL, a
    widened VARCHAR on MySQL): a room id of 300 characters was refused by the lane's table,
    and feeding stopped at that row for ever. Copies are cut to their width; the sink gets
    the envelope whole, and the rows after it are fed and delivered."""
    store = await open_store(request.getfixturevalue("database_dsn" if server == "mariadb" else "postgresql_dsn"))
    try:
        await store.migrate()
        widen = {"mariadb": "MODIFY room_id VARCHAR(400) NOT NULL", "postgresql": "ALTER COLUMN room_id TYPE TEXT"}
        async with store.transaction() as cur:
            await cur.execute(f"ALTER TABLE room_outbox {widen[server]}")
        await migrate_lanes(store, ["t"])
        await insert_events(store, [envelope("wide", room_id="r" * 300), envelope("after")])
        sink = RecordingSink()
        await run_until_empty(lane_dispatcher(store, sink))
        assert sorted(sink.received) == ["after", "wide"]
        assert sink.envelopes["wide"].room_id == "r" * 300
        assert (await lane_rows(store))["wide"]["room_id"] == "r" * 255
    finally:
        await store.aclose()
