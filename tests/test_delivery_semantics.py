"""Parking, per-room ordering across dispatchers, concurrency, and the requeue/cancel tools."""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

import anyio
import pytest
from support import (
    RecordingSink,
    envelope,
    fetch_rows,
    insert_events,
    insert_rows,
    make_dispatcher,
    running,
    wait_until,
)

from room_outbox.cli.cancel import cancel_command
from room_outbox.cli.requeue import requeue_command
from room_outbox.delivery.retry import RetryPolicy
from room_outbox.sink import PermanentSinkError
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.operator.changes import RequeueFilter

pytestmark = pytest.mark.anyio


async def test_parking_moves_permanent_failures_to_failed_keeping_everything(store: MySQLStore) -> None:
    await insert_events(store, [envelope("perm"), envelope("ok")])
    await insert_rows(store, [("", "bad", "RoomUserJoined", "r_1", "{oops")])
    sink = RecordingSink(fail={"perm"}, error=PermanentSinkError("ErrorCode 10010 group gone"))
    await make_dispatcher(store, sink, retry=RetryPolicy(parking=True)).run_until_empty()
    rows = await fetch_rows(store)
    assert (rows["perm"]["status"], rows["perm"]["retry_count"]) == ("failed", 1)
    assert rows["perm"]["last_error"] == "test: permanent: ErrorCode 10010 group gone"
    assert (rows["bad"]["status"], rows["bad"]["envelope"]) == ("failed", "{oops")  # bad input is permanent
    assert rows["ok"]["status"] == "published"


async def test_max_attempts_parks_the_last_allowed_attempt(store: MySQLStore) -> None:
    await insert_events(store, [envelope("flaky")])
    dispatcher = make_dispatcher(
        store, RecordingSink(fail={"flaky"}), retry=RetryPolicy(interval=0.01, parking=True, max_attempts=3)
    )

    async def parked() -> bool:
        await dispatcher.run_until_empty()
        return (await fetch_rows(store))["flaky"]["status"] == "failed"

    await wait_until(parked)
    assert (await fetch_rows(store))["flaky"]["retry_count"] == 3


async def test_without_parking_permanent_failures_stay_pending(store: MySQLStore) -> None:
    await insert_events(store, [envelope("perm")])
    sink = RecordingSink(fail={"perm"}, error=PermanentSinkError("no"))
    await make_dispatcher(store, sink).run_until_empty()
    assert (await fetch_rows(store))["perm"]["status"] == "pending"


async def test_without_ordering_nothing_waits_for_a_failed_event(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}", room_version=i) for i in range(3)])  # one room
    sink = RecordingSink(fail={"e0"})
    await make_dispatcher(store, sink).run_until_empty()
    rows = await fetch_rows(store)
    assert (rows["e1"]["status"], rows["e2"]["status"]) == ("published", "published")


@pytest.mark.serial
async def test_per_room_order_holds_back_only_the_failing_room(store: MySQLStore) -> None:
    await insert_events(
        store, [envelope(f"{room}-{v}", room_id=room, room_version=v) for v in range(3) for room in ("r_a", "r_b")]
    )
    sink = RecordingSink(fail={"r_a-1"})
    dispatcher = make_dispatcher(store, sink, per_room=True)
    await dispatcher.run_until_empty()
    rows = await fetch_rows(store)
    assert [rows[f"r_b-{v}"]["status"] for v in range(3)] == ["published"] * 3  # other rooms unaffected
    assert [rows[f"r_a-{v}"]["status"] for v in range(3)] == ["published", "pending", "pending"]
    assert "r_a-2" not in sink.received  # never delivered ahead of r_a-1
    assert rows["r_a-2"]["retry_count"] == 0 and rows["r_a-2"]["worker_id"] is None
    assert await dispatcher.run_until_empty() == 0  # r_a-2 stays behind r_a-1 while it waits for its retry
    sink.fail.clear()

    async def drained() -> bool:
        await dispatcher.run_until_empty()
        return (await fetch_rows(store))["r_a-2"]["status"] == "published"

    await wait_until(drained)
    assert [e for e in sink.received if e.startswith("r_a")] == ["r_a-0", "r_a-1", "r_a-1", "r_a-2"]


async def test_per_room_order_holds_across_dispatchers_with_failures(store: MySQLStore) -> None:
    rooms = [f"r_{n}" for n in range(8)]
    await insert_events(
        store, [envelope(f"{room}-{v:03}", room_id=room, room_version=v) for v in range(40) for room in rooms]
    )
    received: list[str] = []

    class FlakySink(RecordingSink):
        """Fails every event's first attempt when its version is divisible by 7."""

        async def deliver(self, env: object) -> None:
            event_id = env.event_id  # type: ignore[attr-defined]
            if int(event_id[-3:]) % 7 == 0 and event_id not in self.fail:
                self.fail.add(event_id)
                await super().deliver(env)  # raises: first attempt refused
            self.fail.discard(event_id)
            received.append(event_id)
            await anyio.sleep(0)

    sink = FlakySink()
    dispatchers = [
        make_dispatcher(store, sink, node_id=f"d{n}", per_room=True, batch_size=25, retry=RetryPolicy(interval=0.02))
        for n in range(3)
    ]

    async def all_published() -> bool:
        return {r["status"] for r in (await fetch_rows(store)).values()} == {"published"}

    async with running(*dispatchers):
        await wait_until(all_published, timeout=60.0)
    per_room: dict[str, list[int]] = defaultdict(list)
    for event_id in received:
        room, version = event_id.rsplit("-", 1)
        per_room[room].append(int(version))
    for room in rooms:
        assert per_room[room] == sorted(per_room[room]), room
        assert sorted(set(per_room[room])) == list(range(40))


class AllAtOnceSink:
    """Each delivery returns only once ``expected`` deliveries are in flight together: run one
    after another, the first would wait until ``publish_timeout`` and fail."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.in_flight = 0
        self.most_in_flight = 0
        self.all_in = anyio.Event()

    async def deliver(self, envelope: Any) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if self.in_flight == self.expected:
            self.all_in.set()
        try:
            await self.all_in.wait()
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        pass


async def test_rooms_of_one_batch_are_delivered_side_by_side(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}", room_id=f"r_{i}") for i in range(20)])
    sink = AllAtOnceSink(expected=20)
    await make_dispatcher(store, sink, concurrency=20, per_room=True, publish_timeout=5.0).run_until_empty()
    assert sink.most_in_flight == 20
    assert {row["status"] for row in (await fetch_rows(store)).values()} == {"published"}


async def test_requeue_shows_then_applies(store: MySQLStore) -> None:
    await insert_events(store, [envelope("parked1"), envelope("parked2", "RoomGiftSent"), envelope("fine")])
    sink = RecordingSink(fail={"parked1", "parked2"}, error=PermanentSinkError("group gone"))
    await make_dispatcher(store, sink, retry=RetryPolicy(parking=True)).run_until_empty()
    out = io.StringIO()
    where = RequeueFilter(error_contains="group gone")
    assert await requeue_command(store, where, apply=False, out=out) == 0
    assert "2 row(s) would be requeued" in out.getvalue() and "parked1" in out.getvalue()
    assert {r["status"] for e, r in (await fetch_rows(store)).items() if e != "fine"} == {
        "failed"
    }  # nothing changed yet
    await requeue_command(store, RequeueFilter(event_type="RoomGiftSent"), apply=True, out=out)
    rows = await fetch_rows(store)
    assert (rows["parked2"]["status"], rows["parked2"]["retry_count"], rows["parked2"]["lock_until_ms"]) == (
        "pending",
        0,
        0,
    )
    assert rows["parked1"]["status"] == "failed"
    sink.fail.clear()
    await make_dispatcher(store, sink).run_until_empty()
    assert (await fetch_rows(store))["parked2"]["status"] == "published"


async def test_requeue_never_touches_published_or_leased_rows(store: MySQLStore) -> None:
    await insert_events(store, [envelope("done"), envelope("leased")])
    await make_dispatcher(store, RecordingSink(), event_types=None).run_until_empty()
    await insert_events(store, [envelope("held")])
    await store.claim("other#1", 10, 2**62)
    out = io.StringIO()
    await requeue_command(store, RequeueFilter(event_ids=("done", "held")), apply=True, out=out)
    assert "no rows match" in out.getvalue()
    rows = await fetch_rows(store)
    assert rows["done"]["status"] == "published" and rows["held"]["worker_id"] == "other#1"


async def test_cancel_keeps_the_row_and_is_never_delivered(store: MySQLStore) -> None:
    await insert_events(store, [envelope("c1"), envelope("c2")])
    out = io.StringIO()
    assert await cancel_command(store, "c1", out, out) == 0
    sink = RecordingSink()
    await make_dispatcher(store, sink).run_until_empty()
    rows = await fetch_rows(store)
    assert rows["c1"]["status"] == "cancelled" and sink.received == ["c2"]
    assert await cancel_command(store, "c2", out, out) == 1 and "c2 is published" in out.getvalue()
    assert await cancel_command(store, "nope", out, out) == 1 and "no event nope" in out.getvalue()


class GatedSink(RecordingSink):
    """Holds each delivery until :attr:`release` is set: a delivery in flight on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.release = anyio.Event()

    async def deliver(self, envelope: Any) -> None:
        self.received.append(envelope.event_id)
        with anyio.fail_after(10):
            await self.release.wait()


async def test_cancel_refuses_an_event_in_flight_so_it_never_ends_delivered_yet_cancelled(store: MySQLStore) -> None:
    await insert_events(store, [envelope("racing")])
    sink = GatedSink()
    dispatcher = make_dispatcher(store, sink, publish_timeout=20.0, lease=30.0)
    out = io.StringIO()
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        try:
            await wait_until(lambda: sink.received == ["racing"])  # leased, at the sink
            assert await cancel_command(store, "racing", out, out) == 1
            sink.release.set()
            await wait_until(lambda: _status(store, "racing", "published"))
        finally:
            sink.release.set()
            dispatcher.stop()
    assert "racing is being delivered right now" in out.getvalue()
    assert sink.received == ["racing"]


async def _status(store: MySQLStore, event_id: str, status: str) -> bool:
    return (await fetch_rows(store))[event_id]["status"] == status
