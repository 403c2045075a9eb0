"""A consumer's dead-letter copies on a real broker (tansu): one producer for all of them, started
once however many chunks settle in parallel and stopped at close; each copy sent or failed on
its own, the warning naming only those not copied. The dead letters themselves are rows of
room_consumer_retry already (tests/consume/test_consume_processes.py): here they are made as the
consumer makes them, and only their copies are sent."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from consume.conftest import TOPIC, ConsumerBroker
from support import free_port
from telemetry_support import capture

from room_outbox.consume.broker_calls import BrokerCalls
from room_outbox.consume.dead_letters import DeadLetters
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.observability.metrics import ConsumerMetrics
from room_outbox.observability.redaction import Redactor
from room_outbox.store.consumers.protocol import RetryRow

pytestmark = pytest.mark.anyio

NOT_COPIED = "dead letters not copied to their topic (they are in room_consumer_retry)"


def dead_letters(bootstrap: str) -> DeadLetters:
    settings = ConsumerSettings(bootstrap_servers=bootstrap, handlers=["audit"])
    metrics = ConsumerMetrics(capture().telemetry.meter, "feed", ["audit"])
    return DeadLetters("feed", settings, metrics, Redactor(), BrokerCalls(anyio.Event()))


def dead_letter(offset: int, value: bytes = b"not json") -> RetryRow:
    return RetryRow(
        consumer="feed", handler="", app_code="app1", event_id=f"{TOPIC}:0:{offset}", event_type="",
        room_key=f"app1:r{offset}", topic=TOPIC, partition=0, offset=offset, value=value, headers={}, attempts=1,
        due_at_ms=0, last_error="unparsable value: malformed envelope: document: Invalid JSON",
    )  # fmt: skip


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[AIOKafkaProducer]:
    """Every producer started from now on (started or not: ``start`` was called)."""
    producers: list[AIOKafkaProducer] = []
    start = AIOKafkaProducer.start

    async def counted(self: AIOKafkaProducer) -> None:
        producers.append(self)
        await start(self)

    monkeypatch.setattr(AIOKafkaProducer, "start", counted)
    return producers


async def copies(bootstrap: str, expected: int) -> list[Any]:
    """The first ``expected`` copies on the dead-letter topic."""
    reader = AIOKafkaConsumer(
        f"{TOPIC}.dlq", bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    found: list[Any] = []
    with anyio.fail_after(60):
        await reader.start()
        try:
            while len(found) < expected:
                for records in (await reader.getmany(timeout_ms=500)).values():
                    found.extend(records)
        finally:
            await reader.stop()
    return found


def offsets(records: list[Any]) -> list[int]:
    return sorted(int(dict(r.headers)["dlq.offset"]) for r in records)


async def test_the_first_dead_letters_of_parallel_chunks_start_one_producer_stopped_at_close(
    broker: ConsumerBroker, started: list[AIOKafkaProducer]
) -> None:
    """Eight chunks announce their first dead letter at once: one producer is started (each
    started one before, and all but the last were never stopped), every copy goes through it,
    and closing stops it."""
    dead = dead_letters(broker.bootstrap)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as chunks:
            for offset in range(8):
                chunks.start_soon(dead.publish, [dead_letter(offset)])
    assert offsets(await copies(broker.bootstrap, 8)) == list(range(8))
    await dead.close(10)
    assert len(started) == 1 and started[0]._closed


async def test_a_producer_that_cannot_start_is_stopped_and_the_copy_logged(
    started: list[AIOKafkaProducer], caplog: pytest.LogCaptureFixture
) -> None:
    """No broker where the settings say: the copy is logged as not copied, the producer whose
    start failed is stopped (its connections closed), and none is kept for the next copy."""
    dead = dead_letters(f"127.0.0.1:{free_port()}")
    with caplog.at_level(logging.WARNING, logger="room_outbox.consume"):
        await dead.publish([dead_letter(0)])
    (warning,) = [r for r in caplog.records if r.getMessage() == NOT_COPIED]
    assert warning.event_ids == [f"{TOPIC}:0:0"]  # type: ignore[attr-defined]
    assert len(started) == 1 and started[0]._closed and dead._producer is None
    await dead.close(10)


async def test_a_copy_too_large_for_the_producer_stops_no_other_and_only_it_is_named(
    broker: ConsumerBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """One dead letter of a batch is larger than the producer sends (1 MiB, aiokafka's
    ``max_request_size``), which its ``send`` refuses at once: the copies before and after it
    are on the topic, and the warning names it alone, with its error."""
    dead = dead_letters(broker.bootstrap)
    batch = [dead_letter(0), dead_letter(1, b"x" * 1_200_000), dead_letter(2)]
    try:
        with caplog.at_level(logging.WARNING, logger="room_outbox.consume"):
            await dead.publish(batch)
        (warning,) = [r for r in caplog.records if r.getMessage() == NOT_COPIED]
        assert (warning.event_ids, warning.dead_letters) == ([f"{TOPIC}:0:1"], 1)  # type: ignore[attr-defined]
        assert warning.error.startswith("MessageSizeTooLargeError")  # type: ignore[attr-defined]
        assert offsets(await copies(broker.bootstrap, 2)) == [0, 2]
    finally:
        await dead.close(10)
