"""Table profile ``silk`` on PostgreSQL, at the store: silk's outbox_events as its producer
writes it, claimed, leased, fenced, retried and parked in silk's words."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from support import RecordingSink, make_dispatcher, wait_until

from bench.drive import run_until_empty
from room_outbox.cli.inspect import format_inspection, inspect_events
from room_outbox.cli.lanes import lane_rows
from room_outbox.cli.status import format_status, status_report
from room_outbox.config import LanePlan, load_settings
from room_outbox.envelope import parse_envelope
from room_outbox.errors import ConfigurationError, EnvelopeError, SchemaError
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.membership import bucket_of
from room_outbox.store.operator.changes import RequeueFilter, cancel, find_requeue_candidates, requeue
from room_outbox.store.protocol import DeliveryResult, Outcome, SQLStore
from room_outbox.store.schema.buckets import row_bucket
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.profiles import SILK

pytestmark = pytest.mark.anyio

#: silk's PublishTx: GORM's Create with ON CONFLICT (event_id) DO NOTHING, inside the caller's
#: transaction; id, attempts, last_error left to their defaults.
SILK_INSERT = (
    "INSERT INTO outbox_events (event_id, event_type, aggregate_type, aggregate_id, payload, status,"
    " max_attempts, next_attempt_at, created_at, updated_at)"
    " VALUES (%s, %s, %s, %s, %s, 'pending', %s, now(), now(), now()) ON CONFLICT (event_id) DO NOTHING"
)


async def silk_publish(store: SQLStore, *events: tuple[str, str, dict[str, Any]], max_attempts: int = 5) -> None:
    async with store.transaction() as cur:
        for event_id, aggregate_id, payload in events:
            await cur.execute(
                SILK_INSERT, (event_id, "wechat.subscribe", "user", aggregate_id, json.dumps(payload), max_attempts)
            )


async def silk_rows(store: SQLStore) -> dict[str, dict[str, Any]]:
    async with store.transaction() as cur:
        await cur.execute("SELECT * FROM outbox_events ORDER BY outbox_seq")
        names = [d[0] for d in cur.description]
        return {row[1]: dict(zip(names, row, strict=True)) for row in await cur.fetchall()}


@pytest.fixture
async def silk(postgresql_dsn: str) -> AsyncIterator[SQLStore]:
    store = await open_store(postgresql_dsn, profile=SILK)
    try:
        yield store
    finally:
        await store.aclose()


async def test_migrate_creates_silks_table_or_adds_only_what_room_outbox_needs(silk: SQLStore) -> None:
    assert await silk.migrate() == [
        "created table outbox_events",
        "added column outbox_events.outbox_seq",
        "added column outbox_events.worker_id",
        "added index outbox_events.uk_outbox_events_outbox_seq",
        "added index outbox_events.idx_outbox_events_room",
        "created table room_outbox_node",
        "created table room_outbox_bucket",
        "created function room_outbox_crc32",
        "added index outbox_events.idx_outbox_events_claim",  # with the bucket: after its function
    ]
    assert await silk.migrate() == []


async def test_migrate_and_run_refuse_a_table_without_silks_columns_alike(silk: SQLStore) -> None:
    """Another producer's table under silk's name: migrate cannot make it silk's, and run's
    start-up check says so in the same words instead of advising migrate."""
    async with silk.transaction() as cur:
        await cur.execute(
            "CREATE TABLE outbox_events (id BIGSERIAL PRIMARY KEY, event_type VARCHAR(128) NOT NULL,"
            " payload JSONB NOT NULL, status VARCHAR(32) NOT NULL, created_at TIMESTAMPTZ NOT NULL)"
        )
    with pytest.raises(SchemaError) as refused:
        await silk.migrate()
    with pytest.raises(SchemaError) as checked:
        await check_schema(silk)
    assert str(checked.value) == str(refused.value)
    assert str(refused.value).startswith(
        "table outbox_events exists but lacks silk's outbox columns event_id, aggregate_type, aggregate_id,"
        " attempts, max_attempts, next_attempt_at, last_error, updated_at, which its producer writes: it is not"
        " an outbox table of profile silk; check database.table and database.profile"
    )


async def test_silk_rows_are_claimed_sent_retried_and_failed_after_their_own_max_attempts(silk: SQLStore) -> None:
    await silk.migrate()
    await silk_publish(silk, ("e1", "u1", {"n": 1}), ("e2", "u2", {}), ("e3", "u3", {}), max_attempts=2)
    await silk_publish(silk, ("e1", "u1", {"n": "again"}))  # a duplicate event_id: skipped, as silk does
    async with silk.transaction() as cur:
        await cur.execute(SILK_INSERT.replace("'pending'", "'cancelled'"), ("e4", "x", "user", "u4", "{}", 5))
    rows = {r.event_id: r for r in (await silk.claim("a#1", 10, now_ms() + 60_000)).rows}
    assert sorted(rows) == ["e1", "e2", "e3"]  # cancelled is never touched
    envelope = json.loads(rows["e1"].envelope)
    assert (envelope["room_id"], envelope["aggregate_type"], envelope["payload"]) == ("u1", "user", {"n": 1})
    got = await silk_rows(silk)
    assert {e: (r["status"], r["worker_id"]) for e, r in got.items()} == {
        "e1": ("sending", "a#1"), "e2": ("sending", "a#1"), "e3": ("sending", "a#1"), "e4": ("cancelled", None),
    }  # fmt: skip
    retry_at = now_ms() + 30_000
    stale = await silk.record(
        [
            DeliveryResult(rows["e1"].id, "e1", "a#1", Outcome.PUBLISHED),
            DeliveryResult(rows["e2"].id, "e2", "a#1", Outcome.FAILED, "timeout", retry_at),
            DeliveryResult(rows["e3"].id, "e3", "a#1", Outcome.RELEASED),
        ]
    )
    assert stale == []
    got = await silk_rows(silk)
    assert {e: (r["status"], r["attempts"]) for e, r in got.items()} == {
        "e1": ("sent", 1), "e2": ("retry", 1), "e3": ("pending", 0), "e4": ("cancelled", 0),
    }  # fmt: skip
    assert abs(got["e2"]["next_attempt_at"] - datetime.fromtimestamp(retry_at / 1000, UTC)) < timedelta(milliseconds=2)
    assert [r.event_id for r in (await silk.claim("b#1", 10, now_ms() + 60_000)).rows] == ["e3"]  # e2 not due yet
    async with silk.transaction() as cur:
        await cur.execute(
            "UPDATE outbox_events SET next_attempt_at = now() - interval '1 second' WHERE event_id = 'e2'"
        )
    (again,) = (await silk.claim("c#1", 10, now_ms() + 60_000)).rows
    slot = now_ms() + 30_000  # held back by a rate limit: no attempt, not due before the slot
    await silk.record([DeliveryResult(again.id, "e2", "c#1", Outcome.THROTTLED, retry_at_ms=slot)])
    throttled = (await silk_rows(silk))["e2"]
    assert (throttled["status"], throttled["attempts"], throttled["worker_id"]) == ("retry", 1, None)
    assert abs(throttled["next_attempt_at"] - datetime.fromtimestamp(slot / 1000, UTC)) < timedelta(milliseconds=2)
    async with silk.transaction() as cur:
        await cur.execute(
            "UPDATE outbox_events SET next_attempt_at = now() - interval '1 second' WHERE event_id = 'e2'"
        )
    (again,) = (await silk.claim("d#1", 10, now_ms() + 60_000)).rows
    await silk.record([DeliveryResult(again.id, "e2", "d#1", Outcome.FAILED, "timeout again", now_ms())])
    assert (await silk_rows(silk))["e2"]["status"] == "failed"  # its own max_attempts (2) used up


async def test_silk_operator_commands_speak_its_words(silk: SQLStore) -> None:
    await silk.migrate()
    await silk_publish(silk, ("e1", "u1", {}), ("e2", "u2", {}), max_attempts=1)
    rows = {r.event_id: r for r in (await silk.claim("a#1", 10, now_ms() + 60_000)).rows}
    await silk.record([DeliveryResult(rows["e1"].id, "e1", "a#1", Outcome.FAILED, "group gone", now_ms())])
    report = await status_report(silk)
    assert (report.pending, report.leased, report.other_statuses) == (1, 1, {"failed": 1})
    (doc,) = await inspect_events(silk, "e2")
    assert doc["state"].startswith("in flight: leased by a#1")
    assert doc["envelope"]["room_id"] == "u2"
    (found,) = await find_requeue_candidates(silk, RequeueFilter(error_contains="group gone"))
    assert await requeue(silk, [found["id"]]) == 1
    assert {e: (r["status"], r["attempts"]) for e, r in (await silk_rows(silk)).items()}["e1"] == ("pending", 0)
    assert await cancel(silk, "e1") == (True, "cancelled")


async def test_silk_needs_postgresql_and_defaults_to_its_linear_backoff(tmp_path: Any) -> None:
    with pytest.raises(
        ConfigurationError, match=r"database\.profile: silk's table lives on postgresql; database\.dsn names a sqlite"
    ):
        await open_store(f"sqlite:///{tmp_path / 'x.db'}", profile=SILK)
    (tmp_path / "c.yaml").write_text("database:\n  profile: silk\n")
    worker = load_settings(tmp_path / "c.yaml").outbox_worker
    assert (worker.retry_strategy, worker.retry.base) == ("linear", 15.0)
    (tmp_path / "c.yaml").write_text("database:\n  profile: silk\noutbox_worker:\n  retry_strategy: exponential\n")
    assert load_settings(tmp_path / "c.yaml").outbox_worker.retry_strategy == "exponential"


async def test_silk_rows_carry_the_room_bucket_python_computes_for_the_aggregate(silk: SQLStore) -> None:
    """The aggregate is the room, in the default app: ``bucket_of("", aggregate_id)`` (no
    aggregate: the room ``""``), so per-room claims of the membership work on silk's table."""
    await silk.migrate()
    await silk_publish(silk, *[(f"e{n}", f"user-{n}", {}) for n in range(20)], ("e-cn", "用户-7", {}))
    async with silk.transaction() as cur:
        await cur.execute(SILK_INSERT, ("e-none", "wechat.subscribe", "user", None, "{}", 5))
        await cur.execute(f"SELECT aggregate_id, {row_bucket(silk.dialect, SILK)} FROM outbox_events")
        found = await cur.fetchall()
    assert len(found) == 22
    assert all(bucket == bucket_of("", aggregate or "") for aggregate, bucket in found)


async def test_claim_after_leaves_young_pending_events_and_takes_due_retries(silk: SQLStore) -> None:
    """silk's rows start at their own next_attempt_at: claim_after is checked on created_at
    (against the database's clock) for pending rows only; a young row waiting for its retry is due."""
    await silk.migrate()
    await silk_publish(silk, ("old", "u1", {}), ("young", "u2", {}), ("retried", "u3", {}))
    async with silk.transaction() as cur:
        await cur.execute("UPDATE outbox_events SET created_at = now() - interval '1 minute' WHERE event_id = 'old'")
        await cur.execute("UPDATE outbox_events SET status = 'retry', attempts = 1 WHERE event_id = 'retried'")
    silk.claim_after_ms = 10_000
    claimed = await silk.claim("c#1", 10, now_ms() + 60_000)
    assert {row.event_id for row in claimed.rows} == {"old", "retried"}


async def test_a_silk_envelope_above_the_bound_is_claimed_unread(postgresql_dsn: str) -> None:
    """silk's envelope is built of its row's columns: one above ``database.max_envelope_bytes``
    is claimed with its size in place of it, and fails as too large."""
    store = await open_store(postgresql_dsn, profile=SILK, max_envelope_bytes=4096)
    try:
        await store.migrate()
        await silk_publish(store, ("big", "u1", {"text": "你好" * 1024}), ("small", "u2", {"text": "你好"}))
        rows = {r.event_id: r.envelope for r in (await store.claim("a#1", 10, now_ms() + 60_000)).rows}
        assert json.loads(rows["small"])["payload"] == {"text": "你好"}
        with pytest.raises(EnvelopeError, match=r"^envelope too large: \d+ bytes, above database.max_envelope_bytes"):
            parse_envelope(rows["big"])
    finally:
        await store.aclose()


async def test_a_row_parked_by_its_own_max_attempts_is_logged_as_parked_in_silks_words(
    silk: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """silk parks a row once its own ``max_attempts`` are used up: the dispatcher reads that
    limit with the row, so the attempt that parks it logs "delivery failed; event parked" with
    the row's status, ``failed``; the failures before it say ``retry``, silk's word for a row
    waiting for its next attempt (not v1's ``pending``)."""
    await silk.migrate()
    await silk_publish(silk, ("m1", "u1", {}), max_attempts=3)
    dispatcher = make_dispatcher(silk, RecordingSink(fail={"m1"}), event_types=["wechat.subscribe"])

    async def parked() -> bool:
        await run_until_empty(dispatcher)
        return (await silk_rows(silk))["m1"]["status"] == "failed"

    with caplog.at_level(logging.WARNING, logger="room_outbox"):
        await wait_until(parked)
    assert (await silk_rows(silk))["m1"]["attempts"] == 3
    lines = [
        (r.message, r.status, r.retry_count)  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "event_id", None) == "m1"
    ]
    assert lines == [("delivery failed", "retry", 1), ("delivery failed; event parked", "failed", 3)]


#: silk's MarkSending: GORM's Update of one column, which writes updated_at too; next_attempt_at
#: keeps the due time the row was claimed at.
SILK_MARK_SENDING = (
    "UPDATE outbox_events SET status = 'sending', updated_at = now()"
    " WHERE event_id = %s AND status IN ('pending', 'retry')"
)


@pytest.mark.parametrize("claim_after_ms", [0, 10_000])
@pytest.mark.parametrize("by_bucket", [False, True])
async def test_a_row_silks_own_worker_claimed_is_left_to_it_for_a_lease_then_taken_over(
    silk: SQLStore, claim_after_ms: int, by_bucket: bool
) -> None:
    """Adopted live, silk's worker still claims rows (``sending``, no worker_id, next_attempt_at
    still the past due time): no claim of room-outbox takes such a row until it was last changed
    a lease ago (its worker died). room-outbox's own leases (worker_id set) are taken over once
    they pass, however recently the row changed."""
    await silk.migrate()
    await silk_publish(silk, ("silks", "u1", {}), ("ours", "u2", {}), ("died", "u3", {}))
    async with silk.transaction() as cur:
        await cur.execute("UPDATE outbox_events SET created_at = now() - interval '1 minute'")
        await cur.execute("UPDATE outbox_events SET next_attempt_at = now() - interval '20 seconds'")
        for event_id in ("silks", "died"):
            await cur.execute(SILK_MARK_SENDING, (event_id,))
        await cur.execute("UPDATE outbox_events SET updated_at = now() - interval '61 seconds' WHERE event_id = 'died'")
    silk.lease_ms, silk.claim_after_ms = 60_000, claim_after_ms
    if by_bucket:  # the claim that scans without locks, then locks what it found

        async def every_bucket(cur: Any, along: Any = None) -> list[int]:
            return list(range(256))

        silk.room_buckets = every_bucket
    claimed = await silk.claim("a#1", 10, now_ms() - 1, per_room=by_bucket)  # a lease already past
    assert sorted(row.event_id for row in claimed.rows) == ["died", "ours"]
    claimed = await silk.claim("b#1", 10, now_ms() + 60_000, per_room=by_bucket)
    assert sorted(row.event_id for row in claimed.rows) == ["died", "ours"]  # a#1's lease taken over
    rows = await silk_rows(silk)
    assert (rows["silks"]["status"], rows["silks"]["worker_id"]) == ("sending", None)
    (doc,) = await inspect_events(silk, "silks")
    assert doc["state"].startswith("in flight: claimed by silk's own worker; taken over from")


async def test_a_parked_silk_row_is_due_when_parked_and_inspect_shows_that_time(silk: SQLStore) -> None:
    """Parked, a row's next_attempt_at is the time it was parked, as silk's MarkResult writes
    it (the profile's cleared lock, now()): not epoch 0, and inspect shows it as a time. So is
    a row its own max_attempts park on a failure whose retry was set for later."""
    await silk.migrate()
    await silk_publish(silk, ("parked", "u1", {}), ("used-up", "u2", {}), max_attempts=1)
    rows = {r.event_id: r for r in (await silk.claim("a#1", 10, now_ms() + 60_000)).rows}
    before = datetime.now(UTC)
    await silk.record(
        [
            DeliveryResult(rows["parked"].id, "parked", "a#1", Outcome.PARKED, "no such group"),
            DeliveryResult(rows["used-up"].id, "used-up", "a#1", Outcome.FAILED, "timeout", now_ms() + 600_000),
        ]
    )
    got = await silk_rows(silk)
    for event_id in ("parked", "used-up"):
        assert got[event_id]["status"] == "failed"
        assert abs(got[event_id]["next_attempt_at"] - before) < timedelta(seconds=5)
    (doc,) = await inspect_events(silk, "parked")
    (line,) = [line for line in format_inspection(doc, SILK.time_columns).splitlines() if "next_attempt_at" in line]
    assert line.split()[1] != "0" and len(line.split()) > 2  # the value, then when that was


async def test_a_sent_silk_row_counts_its_successful_attempt_as_silk_does(silk: SQLStore) -> None:
    """silk's MarkResult counts every attempt, the successful one too: a row sent at its first
    attempt has attempts 1, one sent after a failure 2."""
    await silk.migrate()
    await silk_publish(silk, ("first", "u1", {}), ("second", "u2", {}))
    rows = {r.event_id: r for r in (await silk.claim("a#1", 10, now_ms() + 60_000)).rows}
    await silk.record(
        [
            DeliveryResult(rows["first"].id, "first", "a#1", Outcome.PUBLISHED),
            DeliveryResult(rows["second"].id, "second", "a#1", Outcome.FAILED, "timeout", now_ms()),
        ]
    )
    (again,) = (await silk.claim("b#1", 10, now_ms() + 60_000)).rows
    await silk.record([DeliveryResult(again.id, "second", "b#1", Outcome.PUBLISHED)])
    assert {e: (r["status"], r["attempts"]) for e, r in (await silk_rows(silk)).items()} == {
        "first": ("sent", 1),
        "second": ("sent", 2),
    }


async def test_status_and_lanes_name_silks_table_while_the_main_lane_is_off(silk: SQLStore) -> None:
    await silk.migrate()
    text = format_status(await status_report(silk, im_lane=False), silk.profile)
    assert "main lane               disabled: outbox_events.status is silk's, not a backlog here" in text
    (main,) = await lane_rows(silk, LanePlan(main=False, own=()))
    assert main.state == "disabled (outbox_events.status is silk's)"
