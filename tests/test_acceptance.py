"""Seed 000's acceptance table and Done Definition, against MariaDB and the fake Tencent IM
over real HTTP.

A small room service stands in for room-service: a ``rooms`` table, and JoinRoom / SendGift
commands that change a room and append their events to ``room_outbox`` in one transaction,
then push them synchronously through the IM sink (:mod:`room_outbox.producer`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiomysql
import anyio
import pytest
from im_support import im_dispatcher, im_router, im_section
from support import fetch_rows, kill_if_running, wait_until

from bench.drive import run_until_empty
from room_outbox.delivery.routing import Router
from room_outbox.envelope import EventEnvelope
from room_outbox.observability.redaction import Redactor
from room_outbox.plugins.tencent_im.fake import DEV_KEY, FakeTencentIM, serve_fake_im
from room_outbox.producer import OutboxProducer, PublishOutcome, append_event
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore

pytestmark = pytest.mark.anyio

ROOMS_DDL = """
CREATE TABLE rooms (
  room_id    VARCHAR(64) PRIMARY KEY,
  version    BIGINT      NOT NULL,
  members    TEXT        NOT NULL,
  gift_total BIGINT      NOT NULL DEFAULT 0,
  heat       BIGINT      NOT NULL DEFAULT 0
) ENGINE=InnoDB
"""


@dataclass
class CommandResult:
    ok: bool
    snapshot: dict[str, Any]
    events: list[EventEnvelope]
    publishes: list[PublishOutcome] = field(default_factory=list)


class RoomService:
    """JoinRoom / SendGift as seed 000 describes the pipeline: state + outbox in one
    transaction, then a synchronous push whose failure never fails the command."""

    def __init__(self, pool: aiomysql.Pool, producer: OutboxProducer) -> None:
        self.pool = pool
        self.producer = producer

    async def create_room(self, room_id: str) -> CommandResult:
        return await self._command(room_id, lambda s: [("RoomCreated", {})], create=True)

    async def join_room(self, room_id: str, user_id: str) -> CommandResult:
        def apply(state: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
            state["members"] = sorted({*state["members"], user_id})
            return [("RoomUserJoined", {"user_id": user_id})]

        return await self._command(room_id, apply)

    async def send_gift(self, room_id: str, user_id: str, gift: str, amount: int) -> CommandResult:
        def apply(state: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
            state["gift_total"] += amount
            state["heat"] += amount * 10
            return [
                ("RoomGiftSent", {"user_id": user_id, "gift": gift, "amount": amount}),
                ("RoomHeatChanged", {"heat": state["heat"]}),
            ]

        return await self._command(room_id, apply)

    async def snapshot(self, room_id: str) -> dict[str, Any]:
        async with self.pool.acquire() as conn, conn.cursor(aiomysql.DictCursor) as cur:
            await cur.execute("SELECT * FROM rooms WHERE room_id = %s", (room_id,))
            row: dict[str, Any] = await cur.fetchone()
            await conn.commit()
        return {**row, "members": json.loads(row["members"])}

    async def _command(self, room_id: str, apply: Any, create: bool = False) -> CommandResult:
        async with self.pool.acquire() as conn:
            try:
                async with conn.cursor(aiomysql.DictCursor) as cur:
                    if create:
                        state: dict[str, Any] = {
                            "room_id": room_id,
                            "version": 0,
                            "members": [],
                            "gift_total": 0,
                            "heat": 0,
                        }
                        await cur.execute(
                            "INSERT INTO rooms (room_id, version, members) VALUES (%s, 0, '[]')", (room_id,)
                        )
                    else:
                        await cur.execute("SELECT * FROM rooms WHERE room_id = %s FOR UPDATE", (room_id,))
                        state = dict(await cur.fetchone())
                        state["members"] = json.loads(state["members"])
                    changes = apply(state)
                    state["version"] += 1
                    await cur.execute(
                        "UPDATE rooms SET version = %s, members = %s, gift_total = %s, heat = %s WHERE room_id = %s",
                        (state["version"], json.dumps(state["members"]), state["gift_total"], state["heat"], room_id),
                    )
                    events = [
                        await append_event(
                            cur,
                            {
                                "event_id": f"evt_{uuid.uuid4().hex}",
                                "event_type": event_type,
                                "app_code": "default",
                                "room_id": room_id,
                                "room_version": state["version"],
                                "occurred_at_ms": int(time.time() * 1000),
                                "command_id": f"cmd_{uuid.uuid4().hex[:8]}",
                                "payload": payload,
                            },
                        )
                        for event_type, payload in changes
                    ]
                await conn.commit()
            except BaseException:
                await conn.rollback()
                raise
        # After the commit: the push may fail, the command has succeeded regardless.
        publishes = [await self.producer.publish_committed(e) for e in events]
        return CommandResult(True, state, events, publishes)


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeTencentIM]:
    async with serve_fake_im(FakeTencentIM(seed=11)) as fake:
        yield fake


@pytest.fixture
def redactor() -> Redactor:
    return Redactor()


@pytest.fixture
async def router(fake: FakeTencentIM, redactor: Redactor) -> AsyncIterator[Router]:
    router = await im_router(fake, redactor)
    try:
        yield router
    finally:
        await router.aclose()


@pytest.fixture
async def pool(database_dsn: str, store: MySQLStore) -> AsyncIterator[aiomysql.Pool]:
    address = MySQLAddress.from_dsn(database_dsn)
    pool = await aiomysql.create_pool(minsize=1, maxsize=4, db=address.database, **address.connect_kwargs())
    async with pool.acquire() as conn, conn.cursor() as cur:
        await cur.execute(ROOMS_DDL)
        await conn.commit()
    try:
        yield pool
    finally:
        pool.close()
        await pool.wait_closed()


@pytest.fixture
async def service(pool: aiomysql.Pool, router: Router, redactor: Redactor) -> RoomService:
    service = RoomService(pool, OutboxProducer(pool, router, publish_timeout=1.0, redactor=redactor))
    await service.create_room("r_1")
    return service


async def row(store: MySQLStore, event_id: str) -> dict[str, Any]:
    return (await fetch_rows(store))[event_id]


# -- seed 000, "Acceptance Tests" -----------------------------------------------------------


async def test_1_sync_im_failure_still_succeeds_the_command(service: RoomService, fake: FakeTencentIM) -> None:
    fake.set_faults(error_rate=1.0, error_codes=[10002])
    joined = await service.join_room("r_1", "u1")
    gift = await service.send_gift("r_1", "u1", "rocket", 3)
    assert joined.ok and gift.ok
    assert not joined.publishes[0].published and "ErrorCode 10002" in (joined.publishes[0].error or "")
    snapshot = await service.snapshot("r_1")
    assert snapshot["members"] == ["u1"] and snapshot["gift_total"] == 3 and snapshot["version"] == 3


async def test_2_sync_im_failure_leaves_the_row_pending_without_counting_a_retry(
    service: RoomService, fake: FakeTencentIM, store: MySQLStore
) -> None:
    fake.set_faults(http_error_rate=1.0)
    (event,) = (await service.join_room("r_1", "u1")).events
    stored = await row(store, event.event_id)
    assert (stored["status"], stored["retry_count"], stored["last_error"]) == ("pending", 0, None)


async def test_3_worker_delivers_the_pending_event(
    service: RoomService, fake: FakeTencentIM, store: MySQLStore, router: Router
) -> None:
    fake.set_faults(fail_next=[10002])
    (event,) = (await service.join_room("r_1", "u1")).events
    assert fake.event_ids() == []
    await run_until_empty(im_dispatcher(store, router))
    assert fake.event_ids() == [event.event_id]  # the same event_id reached Tencent IM
    assert (await row(store, event.event_id))["status"] == "published"


async def test_4_worker_failure_keeps_pending_and_counts(
    service: RoomService, fake: FakeTencentIM, store: MySQLStore, router: Router
) -> None:
    fake.set_faults(error_rate=1.0, error_codes=[60018])
    (event,) = (await service.join_room("r_1", "u1")).events
    await run_until_empty(im_dispatcher(store, router))
    stored = await row(store, event.event_id)
    assert (stored["status"], stored["retry_count"]) == ("pending", 1)
    assert "ErrorCode 60018" in stored["last_error"]
    assert DEV_KEY not in stored["last_error"] and "usersig" not in stored["last_error"].lower()


async def test_5_fails_once_then_succeeds_on_the_next_round(
    service: RoomService, fake: FakeTencentIM, store: MySQLStore, router: Router
) -> None:
    fake.set_faults(error_rate=1.0, error_codes=[10002])
    gift = await service.send_gift("r_1", "u1", "rose", 1)
    gift_event = next(e for e in gift.events if e.event_type == "RoomGiftSent")
    dispatcher = im_dispatcher(store, router)
    await run_until_empty(dispatcher)
    assert (await row(store, gift_event.event_id))["retry_count"] == 1
    fake.set_faults(error_rate=0.0)

    async def published() -> bool:
        await run_until_empty(dispatcher)
        return bool((await row(store, gift_event.event_id))["status"] == "published")

    await wait_until(published, timeout=5)
    stored = await row(store, gift_event.event_id)
    assert (stored["retry_count"], stored["last_error"]) == (1, None)
    assert fake.event_ids() == [gift_event.event_id]
    assert fake.messages[0].priority == "High"


async def test_6_sync_success_is_marked_and_never_rescanned(
    service: RoomService, fake: FakeTencentIM, store: MySQLStore, router: Router
) -> None:
    result = await service.join_room("r_1", "u1")
    (event,) = result.events
    assert result.publishes[0].published and result.publishes[0].marked
    assert (await row(store, event.event_id))["status"] == "published"
    assert await run_until_empty(im_dispatcher(store, router)) == 0  # nothing to claim
    assert fake.event_ids() == [event.event_id]  # sent once, by the command


@pytest.mark.serial
async def test_7_cancel_stops_scanning_and_bounds_the_in_flight_delivery(
    service: RoomService, fake: FakeTencentIM, store: MySQLStore, router: Router
) -> None:
    fake.set_faults(fail_next=[10002])
    (in_flight,) = (await service.join_room("r_1", "u1")).events
    fake.set_faults(hang_rate=1.0)  # Tencent stops answering
    dispatcher = im_dispatcher(store, router, publish_timeout="500ms")
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        await wait_until(lambda: _true(len(fake.arrivals) == 2))  # after the failed sync push: in flight
        dispatcher.stop()
        stopped_at = time.monotonic()
        fake.set_faults(hang_rate=0.0, fail_next=[10002])
        (late,) = (await service.join_room("r_1", "u2")).events  # committed after the cancel
    assert time.monotonic() - stopped_at < 0.5 + 0.5  # publish_timeout plus a margin
    stored = await row(store, in_flight.event_id)
    assert (stored["status"], stored["retry_count"]) == ("pending", 1)
    assert "publish_timeout" in stored["last_error"]
    untouched = await row(store, late.event_id)
    assert (untouched["status"], untouched["retry_count"], untouched["worker_id"]) == ("pending", 0, None)
    assert len(fake.arrivals) == 3  # sync push, the hung worker request, the late command's sync push


async def test_8_non_im_events_are_published_without_a_tencent_call(
    service: RoomService, fake: FakeTencentIM, store: MySQLStore, router: Router, pool: aiomysql.Pool
) -> None:
    async with pool.acquire() as conn, conn.cursor() as cur:  # as room-service writes them, no sync push
        for i, event_type in enumerate(["RoomCreated", "RoomHeatChanged", "RoomRankChanged"]):
            await append_event(cur, {"event_id": f"noop{i}", "event_type": event_type, "room_id": "r_9"})
        await conn.commit()
    heat = next(
        e for e in (await service.send_gift("r_1", "u1", "rose", 1)).events if e.event_type == "RoomHeatChanged"
    )
    await run_until_empty(im_dispatcher(store, router))
    rows = await fetch_rows(store)
    assert {rows[f"noop{i}"]["status"] for i in range(3)} == {"published"}
    assert rows[heat.event_id]["status"] == "published"  # marked by the sync path, no Tencent call
    sent_types = {json.loads(m.data or "{}")["event_type"] for m in fake.messages}
    assert sent_types == {"RoomGiftSent"}


async def test_append_is_part_of_the_callers_transaction(pool: aiomysql.Pool, store: MySQLStore) -> None:
    async with pool.acquire() as conn:
        async with conn.cursor() as cur:
            await append_event(cur, {"event_id": "rolled-back", "event_type": "RoomUserJoined", "room_id": "r_1"})
        await conn.rollback()
    assert "rolled-back" not in await fetch_rows(store)


async def test_a_failed_mark_does_not_fail_the_command(
    fake: FakeTencentIM, store: MySQLStore, router: Router, pool: aiomysql.Pool
) -> None:
    class BrokenPool:
        async def acquire(self) -> Any:
            raise ConnectionError("database went away")

    producer = OutboxProducer(BrokenPool(), router)  # type: ignore[arg-type]
    async with pool.acquire() as conn:
        async with conn.cursor() as cur:
            event = await append_event(cur, {"event_id": "e1", "event_type": "RoomUserJoined", "room_id": "r_1"})
        await conn.commit()
    outcome = await producer.publish_committed(event)
    assert outcome.published and not outcome.marked and "database went away" in (outcome.error or "")
    assert (await row(store, "e1"))["status"] == "pending"  # the worker sends it again; clients de-duplicate


# -- seed 000, "Done Definition" ------------------------------------------------------------


@pytest.mark.slow
async def test_done_definition_with_room_outbox_run_as_a_process(
    service: RoomService, fake: FakeTencentIM, store: MySQLStore, database_dsn: str, tmp_path: Path
) -> None:
    """command committed → outbox persisted → sync push fails → command succeeds → row pending →
    `room-outbox run` scans it → same event_id reaches Tencent IM → published → SIGTERM stops
    the worker before the pool closes."""
    fake.set_faults(error_rate=1.0, error_codes=[10002])
    result = await service.send_gift("r_1", "u1", "rocket", 5)
    gift = next(e for e in result.events if e.event_type == "RoomGiftSent")
    assert result.ok and (await service.snapshot("r_1"))["gift_total"] == 5
    assert (await row(store, gift.event_id))["status"] == "pending"
    fake.set_faults(error_rate=0.0)

    section = {k: v for k, v in im_section(fake).items() if k != "secret_key"}  # the key comes from the environment
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "mysql": {"dsn": database_dsn},
                "node_id": "done-definition",
                "outbox_worker": {"poll_interval": "100ms"},
                "sinks": {"tencent_im": section},
            }
        )  # JSON is YAML
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    env["ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY"] = DEV_KEY
    log_path = tmp_path / "run.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "run"], stderr=log_file, env=env
        )
        try:

            async def all_published() -> bool:
                assert proc.poll() is None, log_path.read_text()
                return {r["status"] for r in (await fetch_rows(store)).values()} == {"published"}

            await wait_until(all_published, timeout=20)
            proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: _true(proc.poll() is not None), timeout=15)
        finally:
            kill_if_running(proc)
    logs = log_path.read_text()
    assert proc.returncode == 0, logs
    assert fake.event_ids() == [gift.event_id]
    lifecycle = [json.loads(line).get("lifecycle") for line in logs.splitlines() if line.startswith("{")]
    lifecycle = [step for step in lifecycle if step]
    assert lifecycle.index("worker_stopped") < lifecycle.index("pool_closed")
    assert DEV_KEY not in logs
    rows = await fetch_rows(store)
    assert all(r["worker_id"] is None for r in rows.values())


async def _true(value: bool) -> bool:
    return value
