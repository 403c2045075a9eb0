"""Metrics read back from an in-memory reader; their Prometheus text; exporter set-up from OTEL_*."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import RecordingSink, envelope, insert_events, make_dispatcher, wait_until
from telemetry_support import capture

from bench.drive import run_until_empty
from room_outbox.attempt.failure import ErrorClass, Failure
from room_outbox.config import ConfigError
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.telemetry import NO_ATTEMPT, Telemetry, telemetry_from_environment
from room_outbox.sink import PermanentSinkError
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.operator.reports import sample_backlog
from room_outbox.store.protocol import OutboxRow


def gone_for_good(sink: RecordingSink) -> RecordingSink:
    """``sink``, but event ``gone`` fails for good (its group dismissed)."""

    async def deliver(env: Any) -> None:
        if env.event_id == "gone":
            raise PermanentSinkError("group dismissed")
        await RecordingSink.deliver(sink, env)

    sink.deliver = deliver  # type: ignore[method-assign]
    return sink


@pytest.mark.anyio
async def test_success_failure_latency_and_batch_size(store: MySQLStore) -> None:
    await insert_events(
        store, [envelope("ok1"), envelope("ok2", "RoomGiftSent"), envelope("bad"), envelope("gone", "RoomClosed")]
    )
    captured = capture()
    sink = gone_for_good(RecordingSink(fail={"bad", "gone"}))
    sink.error = None
    dispatcher = make_dispatcher(store, sink)
    dispatcher.telemetry = captured.telemetry
    await run_until_empty(dispatcher)

    v = captured.value
    assert v("room_outbox.publish.success", sink="test", event_type="RoomUserJoined") == 1
    assert v("room_outbox.publish.success", sink="test", event_type="RoomGiftSent") == 1
    assert v("room_outbox.publish.failure", event_type="RoomUserJoined", error_class="retryable") == 1
    assert v("room_outbox.publish.failure", event_type="RoomClosed", error_class="permanent") == 1
    latency = captured.histogram("room_outbox.publish.duration")
    assert sum(p.count for p in latency) == 4
    assert sum(p.count for p in latency if p.attributes["outcome"] == "failed") == 2
    (batches,) = captured.histogram("room_outbox.claimed_batch.size")
    assert batches.count >= 1 and batches.sum == 4


@pytest.mark.anyio
async def test_parked_events_are_counted_by_the_failure_that_parked_them(store: MySQLStore) -> None:
    """With parking, an event whose retries ran out and one that failed for good are each
    counted once as parked, under the class of the failure that parked it; a failure that
    leaves the event to retry is not."""
    from room_outbox.attempt.retry import RetryPolicy

    await insert_events(store, [envelope("tired"), envelope("gone", "RoomClosed"), envelope("again", "RoomGiftSent")])
    captured = capture()
    sink = gone_for_good(RecordingSink(fail={"tired", "gone", "again"}))
    retry = RetryPolicy(interval=0.05, max_attempts=2, parking=True)
    dispatcher = make_dispatcher(store, sink, retry=retry)
    dispatcher.telemetry = captured.telemetry
    await run_until_empty(dispatcher)  # each fails once: "gone" parked for good
    v = captured.value
    assert v("room_outbox.parked", sink="test", event_type="RoomClosed", error_class="permanent") == 1
    assert v("room_outbox.parked", event_type="RoomUserJoined", error_class="retryable") == 0

    async def all_parked() -> bool:  # the second attempts, once due: the retries used up
        await run_until_empty(dispatcher)
        async with store.transaction() as cur:
            await cur.execute("SELECT COUNT(*) FROM room_outbox WHERE status = 'failed'")
            return int((await cur.fetchone())[0]) == 3

    await wait_until(all_parked, timeout=10)
    assert v("room_outbox.parked", sink="test", event_type="RoomUserJoined", error_class="retryable") == 1
    assert v("room_outbox.parked", sink="test", event_type="RoomGiftSent", error_class="retryable") == 1
    assert v("room_outbox.parked", sink="test", event_type="RoomClosed", error_class="permanent") == 1


@pytest.mark.anyio
async def test_a_row_published_by_the_producer_mid_delivery_is_told_apart_from_a_takeover(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The producer's own push won the race: counted under its own cause, logged at INFO (one
    line for the batch's rows), no WARNING; nothing counted as taken over."""
    await insert_events(store, [envelope(f"e{i}", room_id=f"r_{i}") for i in range(3)])
    captured = capture()

    class ProducerWins(RecordingSink):
        async def deliver(self, env: Any) -> None:
            async with store.transaction() as cur:  # room-service's own synchronous push succeeded
                await cur.execute("UPDATE room_outbox SET status='published' WHERE event_id=%s", (env.event_id,))

    dispatcher = make_dispatcher(store, ProducerWins())
    dispatcher.telemetry = captured.telemetry
    with caplog.at_level(logging.INFO, logger="room_outbox"):
        await run_until_empty(dispatcher)
    lost = captured.value
    assert lost("room_outbox.lost_leases", detected_at="result_write", cause="published_by_producer") == 3
    assert lost("room_outbox.lost_leases", detected_at="result_write", cause="taken_over") == 0
    (record,) = [r for r in caplog.records if "results not recorded" in r.getMessage()]
    assert record.levelno == logging.INFO and "producer already published" in record.getMessage()
    assert record.rows == 3 and sorted(record.event_ids) == ["e0", "e1", "e2"]  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_a_row_taken_over_by_another_claim_counts_as_a_lost_lease(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Another claim took the row mid-delivery (this process's lease ran out) and published
    it: a fault, counted as taken over and logged at WARNING, even though the row ends
    published."""
    await insert_events(store, [envelope("e1")])
    captured = capture()

    class TakenOver(RecordingSink):
        async def deliver(self, env: Any) -> None:
            async with store.transaction() as cur:  # another process's claim, then its published result
                await cur.execute(
                    "UPDATE room_outbox SET worker_id = 'other#1', status = 'published' WHERE event_id = %s",
                    (env.event_id,),
                )
                await cur.execute("UPDATE room_outbox SET worker_id = NULL WHERE event_id = %s", (env.event_id,))

    dispatcher = make_dispatcher(store, TakenOver())
    dispatcher.telemetry = captured.telemetry
    with caplog.at_level(logging.INFO, logger="room_outbox"):
        await run_until_empty(dispatcher)
    lost = captured.value
    assert lost("room_outbox.lost_leases", detected_at="result_write", cause="taken_over") == 1
    assert lost("room_outbox.lost_leases", detected_at="result_write", cause="published_by_producer") == 0
    (record,) = [r for r in caplog.records if "results not recorded" in r.getMessage()]
    assert record.levelno == logging.WARNING and "taken over" in record.getMessage()
    assert record.rows == 1 and record.event_ids == ["e1"]  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_a_takeover_the_renewal_finds_first_counts_once(store: MySQLStore) -> None:
    """Another claim takes the row while it is being delivered; a lease renewal finds it gone
    (counted there), then its result comes back stale: the same lost lease, not a second one."""
    await insert_events(store, [envelope("e1")])
    captured = capture()

    def lost(point: str) -> float:
        return captured.value("room_outbox.lost_leases", detected_at=point, cause="taken_over")

    class TakenOverMidDelivery(RecordingSink):
        async def deliver(self, env: Any) -> None:
            async with store.transaction() as cur:  # another process's claim takes the row
                await cur.execute("UPDATE room_outbox SET worker_id = 'other#1' WHERE event_id = %s", (env.event_id,))
            await wait_until(lambda: lost("renewal") == 1, timeout=10)

    dispatcher = make_dispatcher(store, TakenOverMidDelivery(), lease=0.6, publish_timeout=20)
    dispatcher.telemetry = captured.telemetry
    with anyio.fail_after(30):
        await dispatcher.run_once()
        await dispatcher.flush()
    assert (lost("renewal"), lost("result_write")) == (1, 0)
    assert not dispatcher._lost_at_renewal  # the claim's count is used up with its results


@pytest.mark.anyio
async def test_rows_of_a_claim_that_failed_after_handing_them_over_are_not_counted_as_taken_over(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim hands its rows to the workers, then fails before its leases are written (the
    database gone): the rows are delivered, their results cannot be written, and they are
    claimed and delivered again. Counted and logged under a cause of their own: no other
    claim took them over. One line for them all, with how many and a few of their event ids:
    not one per row, which a batch of 10,000 would make 10,000 of."""
    await insert_events(store, [envelope(f"e{i:02}") for i in range(30)])
    captured = capture()
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink, batch_size=10)
    dispatcher.telemetry = captured.telemetry
    real_claim = store.claim
    failed: list[str] = []

    async def claim(*args: Any, on_locked: Any = None, **kwargs: Any) -> Any:
        async def then_fail(rows: Any) -> None:
            await on_locked(rows)
            if not failed:
                failed.extend(row.event_id for row in rows)
                raise ConnectionError("database gone as the leases were written")

        return await real_claim(*args, on_locked=then_fail if on_locked and args[3] else on_locked, **kwargs)

    store.claim = claim  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="room_outbox"):
        with pytest.raises(ConnectionError):
            await dispatcher.run_once()
        assert failed, "no claim handed its rows over before writing its leases"
        await run_until_empty(dispatcher)
    lost = captured.value
    assert lost("room_outbox.lost_leases", detected_at="result_write", cause="claim_failed") == len(failed)
    assert lost("room_outbox.lost_leases", detected_at="result_write", cause="taken_over") == 0
    (record,) = [r for r in caplog.records if "results not recorded" in r.getMessage()]
    assert record.levelno == logging.WARNING and "claim failed" in record.getMessage()
    assert record.rows == len(failed) == 10 and record.outcomes == {"published": 10}  # type: ignore[attr-defined]
    assert len(record.event_ids) == 5 and set(record.event_ids) <= set(failed)  # type: ignore[attr-defined]
    assert sorted(sink.received) == sorted([f"e{i:02}" for i in range(30)] + failed)  # those twice


@pytest.mark.anyio
async def test_event_types_the_routing_does_not_know_are_labelled_other(store: MySQLStore) -> None:
    """Rows name the event type: unknown ones must not mint label values or span names."""
    from support import insert_rows

    from room_outbox.envelope import KNOWN_EVENT_TYPES

    strange = [f"RoomTeleported{n}\x1b" for n in range(3)]
    await insert_rows(
        store,
        [("default", f"u{n}", t, "r_1", json.dumps(envelope(f"u{n}", t))) for n, t in enumerate(strange)]
        + [("default", "custom", "RoomCustomThing", "r_1", json.dumps(envelope("custom", "RoomCustomThing")))],
    )
    await insert_events(store, [envelope("known", "RoomGiftSent")])
    captured = capture()
    dispatcher = make_dispatcher(store, RecordingSink(), event_types=[*KNOWN_EVENT_TYPES, "RoomCustomThing"])
    dispatcher.telemetry = captured.telemetry
    await run_until_empty(dispatcher)

    labels = {p.attributes["event_type"] for p in captured.points("room_outbox.publish.duration")}
    assert labels == {"other", "RoomCustomThing", "RoomGiftSent"}  # routed by name: kept
    assert captured.value("room_outbox.publish.failure", event_type="other", error_class="no_route") == 3
    names = sorted(span.name for span in captured.spans("room_outbox.deliver "))
    assert names == ["room_outbox.deliver " + t for t in ("RoomCustomThing", "RoomGiftSent", "other", "other", "other")]
    by_id = {span.attributes["event_id"]: span.attributes for span in captured.spans() if span.attributes}
    assert by_id["u0"]["event_type"] == strange[0]  # the attribute keeps what the row says


@pytest.mark.anyio
async def test_backlog_gauges_come_from_index_lookups(store: MySQLStore) -> None:
    assert await sample_backlog(store) == (await sample_backlog(store))  # empty table: zeros
    assert (await sample_backlog(store)).pending == 0
    await insert_events(store, [envelope("old"), envelope("new")])
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET created_at_ms = created_at_ms - 60000 WHERE event_id = 'old'")
        await cur.execute("EXPLAIN SELECT created_at_ms FROM room_outbox WHERE status='pending' ORDER BY id LIMIT 1")
        plan = await cur.fetchall()
    assert any("status" in str(row) for row in plan)  # an index on status, not a table scan
    backlog = await sample_backlog(store)
    assert backlog.pending == 2 and 60_000 <= backlog.oldest_pending_age_ms < 120_000
    captured = capture()
    captured.telemetry.backlog(backlog.pending, backlog.oldest_pending_age_ms)
    assert captured.value("room_outbox.pending") == 2
    assert captured.value("room_outbox.oldest_pending.age") == backlog.oldest_pending_age_ms / 1000  # seconds


def test_prometheus_text_is_the_standard_translation_in_base_units() -> None:
    """Dotted instrument names with their unit become Prometheus names with a unit suffix,
    counters get ``_total``, gauges do not, and durations are seconds."""
    captured = capture()
    m = captured.telemetry.metrics
    m.success.add(2, {"sink": "tencent_im", "event_type": "RoomGiftSent"})
    m.failure.add(1, {"sink": "tencent_im", "event_type": "RoomGiftSent", "error_class": 'odd "quote"\n'})
    for seconds in (0.003, 0.03, 30.0):
        m.duration.record(seconds, {"sink": "noop", "event_type": "RoomCreated", "outcome": "published"})
    captured.telemetry.backlog(7, 1234)
    families = {f.name: f for f in text_string_to_metric_families(captured.telemetry.prometheus_text())}

    success = families["room_outbox_publish_success"]  # the parser drops a counter's _total
    assert success.type == "counter"
    assert [(s.name, s.labels, s.value) for s in success.samples] == [
        ("room_outbox_publish_success_total", {"event_type": "RoomGiftSent", "sink": "tencent_im"}, 2)
    ]
    assert families["room_outbox_publish_failure"].samples[0].labels["error_class"] == 'odd "quote"\n'
    assert families["room_outbox_pending"].type == "gauge"
    assert families["room_outbox_pending"].samples[0].labels == {"lane": "main"}
    assert families["room_outbox_pending"].samples[0].value == 7
    assert families["room_outbox_oldest_pending_age_seconds"].samples[0].value == 1.234
    assert families["room_outbox_clock_offset_seconds"].type == "gauge"
    duration = families["room_outbox_publish_duration_seconds"]
    assert duration.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in duration.samples if s.name.endswith("_bucket")}
    assert (buckets["0.005"], buckets["0.05"], buckets["10.0"], buckets["+Inf"]) == (1, 2, 2, 3)  # cumulative
    (total,) = (s.value for s in duration.samples if s.name.endswith("_sum"))
    assert total == pytest.approx(30.033)
    assert not any(name.endswith(("_ms", "_total")) for name in families)  # no units but base ones


def test_a_failed_attempt_adds_to_the_series_made_at_zero_not_a_second_one() -> None:
    """A failure's error class is an enum: counted as its label text, /metrics shows one
    series per label set (two would make Prometheus keep either value)."""
    captured = capture()
    telemetry = captured.telemetry
    telemetry.metrics.start_at_zero([("tencent_im", "RoomGiftSent")])
    row = OutboxRow(1, "e1", "RoomGiftSent", "r", "a", "{}", 0, "n#1")
    for failed in (Failure("tencent_im", ErrorClass.RETRYABLE, "down"), None):
        telemetry.attempt(row).finish(failed)
    telemetry.flush_counts()
    text = telemetry.prometheus_text()
    retryable = [
        line
        for line in text.splitlines()
        if line.startswith("room_outbox_publish_failure_total")
        and 'error_class="retryable",event_type="RoomGiftSent"' in line
    ]
    assert retryable == [
        'room_outbox_publish_failure_total{error_class="retryable",event_type="RoomGiftSent",sink="tencent_im"} 1.0'
    ]


def test_without_configuration_nothing_is_recorded() -> None:
    telemetry = telemetry_from_environment("n", Redactor(), environ={})
    assert telemetry.tracer is None and not telemetry.metrics_enabled and not telemetry.serves_prometheus
    assert telemetry.attempt(None) is NO_ATTEMPT  # type: ignore[arg-type]
    assert telemetry.prometheus_text() == ""


def test_exporters_follow_the_otel_environment() -> None:
    console = telemetry_from_environment("n", Redactor(), environ={"OTEL_TRACES_EXPORTER": "console"})
    assert console.tracer is not None and not console.metrics_enabled
    endpoint = telemetry_from_environment(
        "n", Redactor(), environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_METRICS_EXPORTER": "none"}
    )
    assert endpoint.tracer is not None and not endpoint.metrics_enabled
    grpc = telemetry_from_environment(
        "n", Redactor(), environ={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    )
    assert grpc.tracer is not None
    with_prometheus = telemetry_from_environment("n", Redactor(), prometheus=True, environ={})
    assert with_prometheus.metrics_enabled and with_prometheus.tracer is None
    disabled = telemetry_from_environment(
        "n", Redactor(), prometheus=True, environ={"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}
    )
    assert disabled.tracer is None and not disabled.metrics_enabled
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER: unknown exporter 'jaeger'"):
        telemetry_from_environment("n", Redactor(), environ={"OTEL_TRACES_EXPORTER": "jaeger"})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        telemetry_from_environment(
            "n", Redactor(), environ={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
        )
    for t in (console, endpoint, grpc, with_prometheus):
        for provider in t._providers:
            provider.shutdown()


@pytest.mark.serial
def test_the_disabled_attempt_is_cheap() -> None:
    """Rough guard on the cost with nothing configured (a loose bound: a regression by an order of magnitude, not a measurement)."""
    telemetry = Telemetry()
    started = time.perf_counter()
    for _ in range(20_000):
        attempt = telemetry.attempt(None)  # type: ignore[arg-type]
        with attempt.current("s"):
            pass
        attempt.finish(None)
    per_attempt_us = (time.perf_counter() - started) / 20_000 * 1e6
    assert per_attempt_us < 20, per_attempt_us
