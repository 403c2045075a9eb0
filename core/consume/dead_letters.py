"""A consumer's dead letters once recorded: logged, counted, and copied to its dead-letter topic.

The rows in ``room_consumer_retry`` are the record that counts (status, inspect, redrive); the
copy on the topic is for whoever watches it, with where and why the message died in its
``dlq.*`` headers. So a copy that fails is logged, never retried, and a batch's copies are sent
together under one deadline: a topic that refuses them holds the partition once, not once per
copy. Each copy is sent or fails on its own (one too large for the producer stops no other),
and the warning names the copies not sent. Once the consumer is told to stop, the copies in
progress are abandoned as its other broker operations are (:mod:`.broker_calls`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from room_outbox.attempt.failure import describe, error_text
from room_outbox.consume.broker_calls import STOP_BROKER_TIMEOUT, Abandoned, BrokerCalls
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
        #: Chunks settle in parallel: their first dead letters must start one producer, not one each.
        self._starting = anyio.Lock()

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
        ``DLQ_SEND_TIMEOUT`` (less once the consumer stops); the copies not sent are logged
        with their errors."""
        topic = self.settings.dlq_topic()
        if topic is None or not rows:
            return
        sent: dict[int, asyncio.Future[Any]] = {}  # by index in rows
        refused: dict[int, BaseException] = {}

        async def send() -> None:
            producer = await self.producer()
            for n, row in enumerate(rows):
                try:
                    sent[n] = await producer.send(topic, row.value, key=row.room_key.encode(),
                                                  headers=headers(self.consumer, row))  # fmt: skip
                except KafkaError as exc:  # refused before sending (too large, say): this copy only
                    refused[n] = exc
            # When cancelled (the deadline, a stop) it cancels the copies still pending: none is left
            # failing later with nobody to read its error.
            await asyncio.gather(*sent.values(), return_exceptions=True)

        ended: BaseException | None = None
        try:
            with anyio.fail_after(DLQ_SEND_TIMEOUT):
                await self.on_broker(send)
        except (KafkaError, TimeoutError, OSError, Abandoned) as exc:
            ended = exc
        failed: dict[str, list[RetryRow]] = {}
        for n, row in enumerate(rows):
            delivery = sent.get(n)
            if delivery is not None and delivery.done() and not delivery.cancelled():
                error = delivery.exception()
            else:  # refused, or not sent (nor acknowledged) when the sending ended
                error = refused.get(n, ended)
            if error is not None:
                failed.setdefault(error_text(self.redactor, describe(error)), []).append(row)
        for reason, not_copied in failed.items():
            log.warning(
                "dead letters not copied to their topic (they are in room_consumer_retry)",
                extra={"consumer": self.consumer, "topic": topic, "event_ids": [row.event_id for row in not_copied][:20],
                       "dead_letters": len(not_copied), "error": reason},
            )  # fmt: skip

    async def producer(self) -> AIOKafkaProducer:
        """The producer, started on the first call (by one caller: the others wait for it); a
        start that fails leaves none, and the next call tries again."""
        async with self._starting:
            if self._producer is None:
                producer = AIOKafkaProducer(
                    bootstrap_servers=self.settings.bootstrap_servers, client_id=f"{self.settings.client_id}-dlq",
                    acks="all", **self.settings.security.client_kwargs(),
                )  # fmt: skip
                try:
                    await producer.start()
                except BaseException:
                    await _stop(producer, STOP_BROKER_TIMEOUT)  # its connections closed, even when cancelled
                    raise
                self._producer = producer
            return self._producer

    async def close(self, timeout: float) -> None:
        """Stop the producer, if one was started; shielded, and bounded by ``timeout``: a dead
        letter it still held is in room_consumer_retry all the same (redrive sends it again)."""
        if self._producer is not None and not await _stop(self._producer, timeout):
            log.warning(
                "dead-letter producer abandoned: the broker did not answer while the consumer stops;"
                " the dead letters stay in room_consumer_retry"
            )


async def _stop(producer: AIOKafkaProducer, timeout: float) -> bool:
    """Stop ``producer``, shielded and within ``timeout``; False when abandoned."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(timeout) as bounded:
        await producer.stop()
    return not bounded.cancelled_caught


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
