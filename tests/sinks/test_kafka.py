"""The Kafka sink keeps the sink contract, against a real broker (tansu, memory only); the
silent broker is a stopped process (SIGSTOP), resumed with SIGCONT."""

from __future__ import annotations

import logging
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner
from lanes.conftest import Broker

from room_outbox import EventEnvelope, PermanentSinkError, SinkContext
from room_outbox.plugins import kafka
from room_outbox.plugins.kafka import KafkaSettings
from room_outbox.plugins.kafka import sink as kafka_sink
from room_outbox.testing import SinkContract, closed_port, event
from room_outbox.testing import SinkHarness as Harness


class TestKafkaSink(SinkContract):
    plugin = kafka
    name = "kafka"

    @pytest.fixture
    def harness(self, kafka_broker: Broker) -> Harness:
        broker = kafka_broker
        section = {"bootstrap_servers": broker.bootstrap, "topic": broker.topic}

        async def delivered(sent: EventEnvelope) -> bool:
            """Whether the topic holds ``sent``: every partition read to its end offset."""
            partitions = [TopicPartition(broker.topic, p) for p in range(broker.partitions)]
            consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False)
            await consumer.start()
            seen: set[str] = set()
            try:
                consumer.assign(partitions)
                with anyio.fail_after(10):
                    ends = await consumer.end_offsets(partitions)
                    await consumer.seek_to_beginning(*partitions)
                    while not all([await consumer.position(tp) >= ends[tp] for tp in partitions]):
                        for batch in (await consumer.getmany(*partitions, timeout_ms=200)).values():
                            seen.update(dict(m.headers)["event_id"].decode() for m in batch)
            finally:
                await consumer.stop()
            return sent.event_id in seen

        @asynccontextmanager
        async def no_broker() -> AsyncIterator[dict[str, Any]]:
            yield {**section, "bootstrap_servers": f"127.0.0.1:{closed_port()}", "request_timeout": "1s"}

        @asynccontextmanager
        async def stopped_broker() -> AsyncIterator[dict[str, Any]]:
            assert broker.proc is not None
            broker.proc.send_signal(signal.SIGSTOP)
            try:
                yield section
            finally:
                broker.proc.send_signal(signal.SIGCONT)

        return Harness(
            section=section,
            delivered=delivered,
            invalid=[
                ({"max_message_bytes": 10}, "max_message_bytes"),
                ({"idempotence": "maybe"}, "idempotence"),
                ({"request_timeout": "soon"}, "request_timeout"),
            ],
            outage=no_broker,
            hang=stopped_broker,
            permanent=(
                {**section, "max_message_bytes": 1024},
                event("contract-too-large", payload={"blob": "x" * 2048}),
            ),
        )


def test_key_partitioner_places_every_key_where_aiokafka_default_does() -> None:
    """The remembered hash must never move a room to another partition than every other
    Kafka client puts it in: the same murmur2 placement, first call and repeated."""
    partitioner = kafka_sink.KeyPartitioner(keys=64)  # fewer than the keys: entries are evicted
    for partitions in ([0], [0, 1, 2], list(range(12))):
        for round_ in range(2):
            for n in range(300):
                key = f"app_{n % 7}:room_{n}".encode()
                assert partitioner(key, partitions, partitions) == DefaultPartitioner()(key, partitions, partitions), (
                    key,
                    partitions,
                    round_,
                )
    assert partitioner(None, [0, 1, 2], [1]) == 1  # no key: an available partition, as the default picks


def test_message_value_is_the_envelope_as_json() -> None:
    envelope = EventEnvelope.model_validate(
        {"event_id": "e1", "event_type": "RoomGiftSent", "room_id": "r1", "payload": {"名": 1.5}, "extra": [1]}
    )
    assert kafka_sink._json(envelope) == envelope.model_dump_json().encode()


@pytest.mark.anyio
async def test_a_change_of_the_topics_partition_count_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Partitions added to the topic move rooms' keys to other partitions: the sink warns once
    per change, on the tailing relay's path (publish) and the lane table's (deliver). tansu
    cannot add partitions to a topic, so the topic is made again with another count."""
    broker = Broker(tmp_path / "tansu.log", partitions=1)
    broker.start()
    logger = logging.getLogger("test.kafka_partitions")
    sink = kafka_sink.KafkaSink(
        KafkaSettings(bootstrap_servers=broker.bootstrap, topic=broker.topic), SinkContext("node", logger)
    )

    async def topic_made_again(partitions: int) -> None:
        url = f"tcp://{broker.bootstrap}"
        for command in (["delete", broker.topic], ["create", broker.topic, "--partitions", str(partitions)]):
            subprocess.run([str(broker.binary), "topic", *command, "--broker", url], check=True, timeout=20)
        assert sink._producer is not None
        with anyio.fail_after(10):  # the producer's metadata, refreshed now rather than in 5 minutes
            await sink._producer.client.force_metadata_update()

    def warnings() -> list[tuple[Any, Any]]:
        return [
            (r.partitions, r.partitions_before)
            for r in caplog.records
            if r.name == logger.name and "partition count changed" in r.getMessage()
        ]

    try:
        caplog.set_level(logging.WARNING, logger=logger.name)
        with anyio.fail_after(30):
            assert await sink.publish([event("p-1")]) == [None]
            assert warnings() == []
            await topic_made_again(3)
            assert await sink.publish([event("p-2"), event("p-3", room_id="r_2")]) == [None, None]
            assert await sink.publish([event("p-4")]) == [None]
            assert warnings() == [(3, 1)]
            await topic_made_again(2)
            await sink.deliver(event("d-1"))
            await sink.deliver(event("d-2"))
            assert warnings() == [(3, 1), (2, 3)]
    finally:
        await sink.aclose()
        broker.stop()


@pytest.mark.anyio
async def test_deliveries_batched_together_and_refused_as_too_large_fail_only_the_one_too_large(
    kafka_broker: Broker, broker_message_limit: Callable[[int], None]
) -> None:
    """The producer packs concurrent deliveries into one record batch, which a broker whose
    limit is below ``max_message_bytes`` refuses whole: each message then goes alone, and only
    the one too large by itself fails for good."""
    broker_message_limit(3000)
    sink = kafka_sink.KafkaSink(
        KafkaSettings(bootstrap_servers=kafka_broker.bootstrap, topic=kafka_broker.topic, max_message_bytes=10_000),
        SinkContext("node", logging.getLogger("test.kafka_limit")),
    )
    small = [event(f"small-{n}", room_id="r1", payload={"note": "x" * 800}) for n in range(8)]
    big = event("big", room_id="r1", payload={"note": "x" * 4000})
    outcomes: dict[str, BaseException | None] = {}

    async def deliver(envelope: EventEnvelope) -> None:
        try:
            await sink.deliver(envelope)
            outcomes[envelope.event_id] = None
        except Exception as exc:  # the outcome is what the test looks at
            outcomes[envelope.event_id] = exc

    try:
        await sink.deliver(event("warm-up", room_id="r1"))  # started: the next ones are sent together
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for envelope in [*small, big]:
                    group.start_soon(deliver, envelope)
    finally:
        await sink.aclose()
    assert {e.event_id: outcomes[e.event_id] for e in small} == {e.event_id: None for e in small}
    assert isinstance(outcomes["big"], PermanentSinkError), outcomes["big"]
    assert "too large" in str(outcomes["big"])
