"""Claims and leases: SKIP LOCKED, fencing, crash takeover, renewal under a slow sink."""

from __future__ import annotations

import logging
from collections import Counter

import anyio
import pytest
from support import RecordingSink, envelope, fetch_rows, insert_events, make_dispatcher, wait_until

from room_outbox.store import DeliveryResult, Outcome
from room_outbox.store.mysql import MySQLStore, now_ms

pytestmark = pytest.mark.anyio


async def test_a_claim_leases_rows_to_its_claimant(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(5)])
    until = now_ms() + 60_000
    rows = (await store.claim("a#1", 3, until)).rows
    assert [r.event_id for r in rows] == ["e0", "e1", "e2"]
    leased = await fetch_rows(store)
    assert [(leased[f"e{i}"]["worker_id"], leased[f"e{i}"]["lock_until_ms"]) for i in range(3)] == [("a#1", until)] * 3
    others = (await store.claim("b#1", 10, now_ms() + 60_000)).rows
    assert [r.event_id for r in others] == ["e3", "e4"]  # leased rows are not claimable


async def test_concurrent_claims_skip_locked_rows(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(200)])
    results: dict[str, list[str]] = {}

    async def claim(name: str) -> None:
        rows = (await store.claim(name, 60, now_ms() + 60_000)).rows
        results[name] = [r.event_id for r in rows]

    async with anyio.create_task_group() as tg:
        for name in ("a#1", "b#1", "c#1"):
            tg.start_soon(claim, name)
    claimed = [e for ids in results.values() for e in ids]
    assert len(claimed) == 180 and len(set(claimed)) == 180


async def test_a_stale_claimant_changes_nothing_and_is_reported(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1")])
    (row,) = (await store.claim("a#1", 10, now_ms() - 1)).rows  # a lease that has already run out
    (taken,) = (await store.claim("b#1", 10, now_ms() + 60_000)).rows  # another process takes over
    assert taken.event_id == "e1"
    late = DeliveryResult(row.id, row.event_id, "a#1", Outcome.FAILED, "late failure", 0)
    assert await store.record([late]) == [late]
    current = (await fetch_rows(store))["e1"]
    assert (current["worker_id"], current["retry_count"], current["last_error"]) == ("b#1", 0, None)
    assert await store.record([DeliveryResult(taken.id, "e1", "b#1", Outcome.PUBLISHED)]) == []
    assert (await fetch_rows(store))["e1"]["status"] == "published"


async def test_a_result_for_a_row_the_producer_published_is_stale(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1")])
    (row,) = (await store.claim("a#1", 10, now_ms() + 60_000)).rows
    async with store.transaction() as cur:  # room-service's synchronous push succeeded meanwhile
        await cur.execute("UPDATE room_outbox SET status='published' WHERE event_id=%s", ("e1",))
    failure = DeliveryResult(row.id, "e1", "a#1", Outcome.FAILED, "boom", 0)
    assert await store.record([failure]) == [failure]
    assert (await fetch_rows(store))["e1"]["retry_count"] == 0


async def test_a_crashed_processs_rows_are_taken_over_after_the_lease(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(3)])
    crashed = (await store.claim("crashed#1", 10, now_ms() + 300)).rows  # claimed, then the process died
    assert len(crashed) == 3
    sink = RecordingSink()
    survivor = make_dispatcher(store, sink, node_id="survivor")
    assert await survivor.run_until_empty() == 0  # the lease still holds

    async def taken_over() -> bool:
        await survivor.run_until_empty()
        return sorted(sink.received) == ["e0", "e1", "e2"]

    await wait_until(taken_over, timeout=5.0)
    assert {r["status"] for r in (await fetch_rows(store)).values()} == {"published"}


async def test_a_live_lease_never_expires_under_a_slow_sink(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Lease 0.3 s, deliveries 1 s: renewal keeps the rows, so the rival never delivers them."""
    await insert_events(store, [envelope(f"e{i}") for i in range(4)])
    slow, fast = RecordingSink(delay=1.0), RecordingSink()
    holder = make_dispatcher(store, slow, node_id="holder", lease=0.3, publish_timeout=5.0)
    rival = make_dispatcher(store, fast, node_id="rival", poll_interval=0.02)
    async with anyio.create_task_group() as tg:
        tg.start_soon(holder.run_until_empty)
        await wait_until(lambda: len(slow.received) == 4)
        await tg.start(rival.run)

        async def published() -> bool:
            return {r["status"] for r in (await fetch_rows(store)).values()} == {"published"}

        await wait_until(published, timeout=10.0)
        rival.stop()
    assert fast.received == []
    assert not [r for r in caplog.records if "lease lost" in r.message or "not recorded" in r.message]


async def test_two_dispatchers_deliver_each_event_exactly_once(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{i}", room_id=f"r_{i % 7}") for i in range(1000)])
    sinks = [RecordingSink(), RecordingSink()]
    dispatchers = [make_dispatcher(store, s, node_id=f"d{n}", batch_size=50) for n, s in enumerate(sinks)]

    async def all_published() -> bool:
        return {r["status"] for r in (await fetch_rows(store)).values()} == {"published"}

    async with anyio.create_task_group() as tg:
        for dispatcher in dispatchers:
            await tg.start(dispatcher.run)
        await wait_until(all_published, timeout=30.0)
        for dispatcher in dispatchers:
            dispatcher.stop()
    counts = Counter(sinks[0].received + sinks[1].received)
    assert len(counts) == 1000 and set(counts.values()) == {1}
    assert sinks[0].received and sinks[1].received  # both took part


async def test_stop_finishes_in_flight_releases_the_rest_and_leaves_no_lease(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(10)])
    sink = RecordingSink(delay=0.3)
    dispatcher = make_dispatcher(store, sink, concurrency=2, publish_timeout=2.0)
    with caplog.at_level(logging.INFO):
        async with anyio.create_task_group() as tg:
            await tg.start(dispatcher.run)
            await wait_until(lambda: len(sink.received) == 2)
            dispatcher.stop()
    rows = await fetch_rows(store)
    published = sorted(e for e, r in rows.items() if r["status"] == "published")
    assert published == sorted(sink.received) and len(published) == 2
    assert all(r["worker_id"] is None and r["lock_until_ms"] == 0 for r in rows.values() if r["status"] == "pending")
    assert all(r["retry_count"] == 0 for r in rows.values())  # released rows count no attempt
