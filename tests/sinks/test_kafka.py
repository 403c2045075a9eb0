"""The Kafka sink keeps the sink contract, against a real broker (tansu, memory only); the
silent broker is a stopped process (SIGSTOP), resumed with SIGCONT."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner
from lanes.conftest import Broker

from room_outbox import EventEnvelope
from room_outbox.plugins import kafka
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
