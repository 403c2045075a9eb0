"""Delivery under faults, with real processes: `room-outbox run` dispatchers, the fake Tencent
IM as its own process, and the real MariaDB. Every test ends with every event published (or
parked where configured) and none lost."""

from __future__ import annotations

import json
import random
import time
from collections import Counter, defaultdict
from pathlib import Path

import anyio
import pytest
from faults.tcp_proxy import TcpProxy
from processes import DispatcherProcess, FakeIMProcess, dispatchers, write_config
from support import envelope, fetch_rows, insert_events, insert_rows, wait_until

from room_outbox.plugins.tencent_im.fake import DEV_SDKAPPID
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def fake_im(tmp_path: Path):  # type: ignore[no-untyped-def]
    fake = FakeIMProcess(tmp_path)
    yield fake
    fake.close()


async def all_published(store: MySQLStore, count: int) -> bool:
    rows = await fetch_rows(store)
    return len(rows) == count and all(r["status"] == "published" for r in rows.values())


def received_ids(fake: FakeIMProcess) -> list[str]:
    return [m["event_id"] for m in fake.messages()]


async def test_thirty_percent_mixed_im_failures_lose_nothing(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    fake_im.set_faults(
        error_rate=0.12, error_codes=[10002, 60008, 10006, 70001], http_error_rate=0.08, http_status=503,
        hang_rate=0.03, drop_rate=0.07,
    )  # fmt: skip
    events = [envelope(f"e{i:04}", room_id=f"r_{i % 20}") for i in range(400)]
    await insert_events(store, events)
    with dispatchers(write_config(tmp_path / "c.yaml", database_dsn, fake_im, concurrency=32), 2):
        await wait_until(lambda: all_published(store, 400), timeout=120)
    rows = await fetch_rows(store)
    assert set(received_ids(fake_im)) == {e["event_id"] for e in events}
    assert sum(r["retry_count"] for r in rows.values()) > 60  # the faults really happened
    assert all(r["last_error"] is None and r["worker_id"] is None for r in rows.values())


@pytest.mark.serial
async def test_kill_9_mid_batch_five_times(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    fake_im.set_faults(latency=0.02)
    batch = 20
    config = write_config(tmp_path / "c.yaml", database_dsn, fake_im, batch_size=batch, concurrency=4, lease="1s")
    total = 0
    kills = 0
    proc = DispatcherProcess(config, "victim-0")
    try:
        while kills < 5:
            chunk = [envelope(f"k{total + i:05}", room_id=f"r_{i % 9}") for i in range(150)]
            await insert_events(store, chunk)
            total += len(chunk)
            target = len(fake_im.messages()) + random.randint(10, 60)
            await wait_until(lambda target=target: len(fake_im.messages()) >= target, timeout=60)
            proc.kill()  # mid-batch: deliveries are in flight all the time at this rate
            kills += 1
            proc = DispatcherProcess(config, f"victim-{kills}")
        await wait_until(lambda: all_published(store, total), timeout=120)
    finally:
        proc.kill()
    ids = received_ids(fake_im)
    assert set(ids) == {f"k{i:05}" for i in range(total)}  # nothing lost
    duplicates = fake_im.stats()["duplicates"]  # copies Tencent would de-duplicate by Random
    # A kill can only repeat what was delivered and not yet recorded: at most one batch.
    assert duplicates <= kills * batch, duplicates


async def test_database_unreachable_for_ten_seconds(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    real = MySQLAddress.from_dsn(database_dsn)
    async with TcpProxy(real.host, real.port) as proxy:
        via_proxy = f"mysql://{real.user}:{real.password}@127.0.0.1:{proxy.port}/{real.database}"
        config = write_config(tmp_path / "c.yaml", via_proxy, fake_im)
        await insert_events(store, [envelope(f"a{i}") for i in range(50)])
        with dispatchers(config) as (proc,):
            await wait_until(lambda: all_published(store, 50), timeout=60)
            await proxy.cut()
            outage_started = time.monotonic()
            await insert_events(store, [envelope(f"b{i}") for i in range(50)])  # room-service keeps writing

            def reported() -> bool:
                return any(line["msg"].startswith("outbox round failed") for line in proc.lines())

            await wait_until(reported, timeout=20)
            await anyio.sleep(max(0.0, 10 - (time.monotonic() - outage_started)))  # the outage itself, not a sync
            assert proc.alive()
            await proxy.restore()
            await wait_until(lambda: all_published(store, 100), timeout=60)
            assert proc.alive()
    assert not proxy.links  # no proxied session outlives the test (it would hold locks on the database)
    assert set(received_ids(fake_im)) >= {f"b{i}" for i in range(50)}


@pytest.mark.serial
async def test_three_processes_deliver_each_event_exactly_once(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    # The quota is not what this test is about: limits high enough never to make a delivery wait.
    im = {"base_url": fake_im.base_url, "sdkappid": DEV_SDKAPPID, "app_rate_limit": 100_000}
    config = write_config(tmp_path / "c.yaml", database_dsn, fake_im, {"sinks": {"tencent_im": im}}, batch_size=30)
    with dispatchers(config, 3) as procs:

        def all_started() -> bool:
            return all(any(line.get("lifecycle") == "worker_started" for line in p.lines()) for p in procs)

        await wait_until(all_started, timeout=60)  # all three compete from the first event on
        await insert_events(store, [envelope(f"x{i:04}", room_id=f"r_{i % 13}") for i in range(900)])
        await wait_until(lambda: all_published(store, 900), timeout=120)
    counts = Counter(received_ids(fake_im))
    assert len(counts) == 900 and set(counts.values()) == {1}
    assert fake_im.stats()["duplicates"] == 0 and fake_im.stats()["requests"] == 900


@pytest.mark.serial
async def test_sigterm_under_load_exits_within_publish_timeout_and_leaves_no_lease(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    fake_im.set_faults(latency=0.4)
    await insert_events(store, [envelope(f"s{i:04}", room_id=f"r_{i % 50}") for i in range(2000)])
    config = write_config(tmp_path / "c.yaml", database_dsn, fake_im, publish_timeout="1s", batch_size=100)
    with dispatchers(config) as (proc,):
        await wait_until(lambda: len(fake_im.messages()) >= 50, timeout=60)
        took = proc.terminate()
    assert took <= 1.0 + 1.0, took
    assert proc.proc.returncode == 0
    rows = await fetch_rows(store)
    assert not [e for e, r in rows.items() if r["worker_id"] is not None and r["status"] == "pending"]
    published = {e for e, r in rows.items() if r["status"] == "published"}
    assert published <= set(received_ids(fake_im))  # published means the IM has it


async def test_bad_rows_get_clear_errors_and_block_nothing(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    async with store.transaction() as cur:  # deployments that store the envelope as a BLOB
        await cur.execute("ALTER TABLE room_outbox MODIFY envelope LONGBLOB NOT NULL")
    big = json.dumps(envelope("big", payload={"blob": "x" * 100_000}))
    bad = {
        "malformed": '{"event_id": "malformed",',
        "missing": json.dumps({"event_id": "missing", "event_type": "RoomUserJoined"}),
        "big": big,
        "badutf8": b'{"event_id": "badutf8", "room_id": "\xff"}',
    }
    await insert_rows(store, [("default", e, "RoomUserJoined", "r_1", body) for e, body in bad.items()])
    await insert_events(store, [envelope(f"good{i}") for i in range(20)])
    with dispatchers(write_config(tmp_path / "c.yaml", database_dsn, fake_im, batch_size=5)):

        async def settled() -> bool:
            rows = await fetch_rows(store)
            return all(rows[e]["retry_count"] >= 1 for e in bad) and all(
                rows[f"good{i}"]["status"] == "published" for i in range(20)
            )

        await wait_until(settled, timeout=60)
    rows = await fetch_rows(store)
    expected = {
        "malformed": "malformed envelope",
        "missing": "malformed envelope: room_id: Field required",
        "big": "tencent_im: permanent:",
        "badutf8": "envelope is not valid UTF-8",
    }
    for event_id, start in expected.items():
        row = rows[event_id]
        assert row["status"] == "pending" and row["last_error"].startswith(start), (event_id, row["last_error"])
        assert row["envelope"] == (bad[event_id] if isinstance(bad[event_id], bytes) else bad[event_id].encode())
    assert "8000" in rows["big"]["last_error"] or "8,000" in rows["big"]["last_error"]
    assert not set(bad) & set(received_ids(fake_im))  # never published


async def test_a_hanging_im_is_bounded_by_publish_timeout(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    fake_im.set_faults(hang_rate=1.0)
    await insert_events(store, [envelope("h1"), envelope("h2", room_id="r_2")])
    with dispatchers(write_config(tmp_path / "c.yaml", database_dsn, fake_im, publish_timeout="500ms")):

        async def timed_out() -> bool:
            rows = await fetch_rows(store)
            return all(r["retry_count"] >= 1 for r in rows.values())

        await wait_until(timed_out, timeout=30)
        errors = {r["last_error"] for r in (await fetch_rows(store)).values()}
        assert errors == {"tencent_im: no answer within publish_timeout 0.5s"}, errors
        fake_im.set_faults(hang_rate=0.0)
        await wait_until(lambda: all_published(store, 2), timeout=30)


async def test_per_room_order_across_three_processes_with_failures(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    fake_im.set_faults(error_rate=0.25, error_codes=[10002, 60008], drop_rate=0.05)
    rooms = [f"r_{n}" for n in range(12)]
    await insert_events(
        store, [envelope(f"{room}-{v:03}", room_id=room, room_version=v) for v in range(25) for room in rooms]
    )
    config = write_config(
        tmp_path / "c.yaml", database_dsn, fake_im, ordering="per_room", batch_size=20, poll_interval="50ms"
    )
    with dispatchers(config, 3):
        await wait_until(lambda: all_published(store, 300), timeout=120)
    versions: dict[str, list[int]] = defaultdict(list)
    for message in fake_im.messages():
        payload = json.loads(message["msg_body"][0]["MsgContent"]["Data"])
        versions[payload["room_id"]].append(payload["room_version"])
    for room in rooms:
        assert versions[room] == list(range(25)), (room, versions[room])
