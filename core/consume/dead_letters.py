"""A consumer's dead letters once recorded: logged, counted, and copied to its dead-letter topic.

The rows in ``room_consumer_retry`` are the record that counts (status, inspect, redrive); the
copy on the topic is for whoever watches it, with where and why the message died in its
``dlq.*`` headers. So a copy that fails is logged, never retried, and a batch's copies are sent
together under one deadline: a topic that refuses them holds the partition once, not once per
copy. Once the consumer is told to stop, the copies in progress are abandoned as its other
broker operations are (:mod:`.broker_calls`).
"""

from __future__ import annotations

import asyncio
import logging

import anyio
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from room_outbox.attempt.failure import describe, error_text
from room_outbox.consume.broker_calls import Abandoned, BrokerCalls
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.observability.metrics import ConsumerMetrics
from room_outbox.observability.redaction import Redactor
from room_outbox.store.consumers.protocol import RetryRow

log = logging.getLogger("room_outbox.consume")

#: How long a batch's dead-letter copies may take, together (not each: a topic that refuses
#: them would hold the partition this long once per copy).
DLQ_SEND_TIMEOUT = 10.0


class DeadLetters:
    """One consumer's dead letters, and its producer to the dead-letter topic (started on the
    first copy: most consumers never send one)."""

    def __init__(
        self,
        consumer: str,
        settings: ConsumerSettings,
        metrics: ConsumerMetrics,
        redactor: Redactor,
        on_broker: BrokerCalls,
    ) -> None:
        self.consumer = consumer
        self.settings = settings
        self.metrics = metrics
        self.redactor = redactor
        self.on_broker = on_broker
        self._producer: AIOKafkaProducer | None = None

    async def announce(self, dead: list[tuple[RetryRow, str]]) -> None:
        """Log, count and copy to the dead-letter topic dead letters already recorded, each
        with the reason it died for (``rejected``, ``permanent``, ``failed``)."""
        for row, reason in dead:
            log.error(
                "dead letter",
                extra={"consumer": self.consumer, "handler": row.handler or "(none)", "event_id": row.event_id,
                       "event_type": row.event_type, "topic": row.topic, "partition": row.partition,
                       "offset": row.offset, "attempts": row.attempts, "error": row.last_error},
            )  # fmt: skip
            self.metrics.dead.add(1, {"consumer": self.consumer, "handler": row.handler or "(none)", "reason": reason})
        await self.publish([row for row, _ in dead])

    async def publish(self, rows: list[RetryRow]) -> None:
        """Copies to the dead-letter topic, all sent at once and awaited together within
        ``DLQ_SEND_TIMEOUT`` (less once the consumer stops); a failed copy is logged."""
        topic = self.settings.dlq_topic()
        if topic is None or not rows:
            return

        async def send() -> None:
            producer = await self.producer()
            sent = [
                await producer.send(topic, row.value, key=row.room_key.encode(), headers=headers(self.consumer, row))
                for row in rows
            ]
            await asyncio.gather(*sent)

        try:
            with anyio.fail_after(DLQ_SEND_TIMEOUT):
                await self.on_broker(send)
        except (KafkaError, TimeoutError, OSError, Abandoned) as exc:
            log.warning(
                "dead letters not copied to their topic (they are in room_consumer_retry)",
                extra={"consumer": self.consumer, "topic": topic, "event_ids": [row.event_id for row in rows][:20],
                       "dead_letters": len(rows), "error": error_text(self.redactor, describe(exc))},
            )  # fmt: skip

    async def producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            producer = AIOKafkaProducer(
                bootstrap_servers=self.settings.bootstrap_servers, client_id=f"{self.settings.client_id}-dlq",
                acks="all", **self.settings.security.client_kwargs(),
            )  # fmt: skip
            try:
                await producer.start()
            except BaseException:
                await producer.stop()
                raise
            self._producer = producer
        return self._producer

    async def close(self, timeout: float) -> None:
        """Stop the producer, if one was started; shielded, and bounded by ``timeout``: a dead
        letter it still held is in room_consumer_retry all the same (redrive sends it again)."""
        if self._producer is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(timeout) as bounded:
                await self._producer.stop()
            if bounded.cancelled_caught:
                log.warning(
                    "dead-letter producer abandoned: the broker did not answer while the consumer stops;"
                    " the dead letters stay in room_consumer_retry"
                )


def headers(consumer: str, row: RetryRow) -> list[tuple[str, bytes]]:
    """The message's own headers but earlier ``dlq.*`` ones, and where and why it died."""
    return [
        *((k, v.encode()) for k, v in row.headers.items() if not k.startswith("dlq.")),
        ("dlq.error", (row.last_error or "").encode()),  # fitted to its column (RetryRow)
        ("dlq.consumer", consumer.encode()),
        ("dlq.handler", row.handler.encode()),
        ("dlq.topic", row.topic.encode()),
        ("dlq.partition", str(row.partition).encode()),
        ("dlq.offset", str(row.offset).encode()),
        ("dlq.attempts", str(row.attempts).encode()),
    ]
