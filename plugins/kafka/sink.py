"""The Kafka sink's delivery (:class:`KafkaSink`): the producer, one message per event or a
tailing lane's batches packed per partition. Imported only where the sink is enabled."""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordTooLargeError
from aiokafka.partitioner import DefaultPartitioner, murmur2

from room_outbox import EventEnvelope, PermanentSinkError, RetryableSinkError, SinkContext
from room_outbox.plugins.kafka import KafkaSettings

#: A Kafka message as the producer takes it: value, key, headers.
Message = tuple[bytes, bytes, list[tuple[str, bytes]]]


class KafkaSink:
    def __init__(self, settings: KafkaSettings, context: SinkContext) -> None:
        self.settings = settings
        self.log = context.logger
        for secret in settings.security.secrets():
            context.add_secret(secret)
        # TLS files are read now: a bad certificate stops start-up, naming the file.
        self._security = settings.security.client_kwargs()
        self._producer: AIOKafkaProducer | None = None
        self._partitioner = KeyPartitioner()
        self._starting = anyio.Lock()
        #: The topic's partition count when last sent to (0: not yet known).
        self._partition_count = 0
        #: Record batches a publish cut off by its deadline left in the producer (see :meth:`publish`).
        self._unresolved: list[asyncio.Future[Any]] = []

    async def deliver(self, envelope: EventEnvelope) -> None:
        producer = await self._started()
        value, key, headers = self._message(envelope)
        known = producer.client.cluster.partitions_for_topic(self.settings.topic)
        if known:
            self._note_partitions(len(known))
        try:
            try:
                await producer.send_and_wait(self.settings.topic, value, key=key, headers=headers)
            except MessageSizeTooLargeError:
                # The producer may have put other events' messages in the same record batch,
                # which the broker refused whole: sent in a batch of its own, this message
                # alone says whether it is the one too large.
                partitions = sorted(await producer.partitions_for(self.settings.topic))
                alone = _batch_of_one(producer, (value, key, headers))
                partition = self._partitioner(key, partitions, partitions)
                await (await producer.send_batch(alone, self.settings.topic, partition=partition))
        except (MessageSizeTooLargeError, RecordTooLargeError) as exc:
            raise _too_large(exc) from exc
        except KafkaError as exc:
            raise self._retryable(exc) from exc

    async def publish(self, envelopes: Sequence[EventEnvelope]) -> list[PermanentSinkError | None]:
        """The tailing lane's entry point: the messages packed into record batches, one
        partition's in order (the partition every Kafka client picks for the key), and handed
        to the producer in waves: each partition's first batch at once, then, once every batch
        of a wave is acknowledged, each partition's next. A partition's batch goes out only
        after the one before it was written: when one fails (the broker hung, a timeout), the
        ones after it are never sent, so none of them is written, once the broker is back,
        ahead of the round sent again, and a key's messages never overtake each other.
        Packing them here spares each
        message the producer's own path through ``send`` (its metadata wait, partitioner,
        queue and future). A message too large is that envelope's permanent error (a batch
        the broker refuses as too large is sent again a message at a time, so that only the
        messages too large by themselves are refused); any other failure fails the whole
        publish (retryable).

        A publish cut off by its deadline leaves the batches it handed over queued or in
        flight in the producer, written or failed only later (up to ``request_timeout``): the
        next publish waits for them first, within its own deadline, so that a round this
        process sends again while the broker hangs adds no copy of its own (the relay keeps
        the other processes from sending it meanwhile)."""
        if self._unresolved:
            await asyncio.wait(self._unresolved)  # cancelled by the deadline: they stay awaited
            self._unresolved = []
        producer = await self._started()
        topic = self.settings.topic
        outcomes: list[PermanentSinkError | None] = [None] * len(envelopes)
        sent: list[tuple[int, list[int], asyncio.Future[Any]]] = []
        try:
            partitions = sorted(await producer.partitions_for(topic))
            self._note_partitions(len(partitions))
            # Each partition's record batches still to send, in order, with the envelopes each holds.
            queued: dict[int, deque[tuple[Any, list[int]]]] = {}
            messages: dict[int, Message] = {}
            for index, envelope in enumerate(envelopes):
                try:
                    value, key, headers = messages[index] = self._message(envelope)
                except PermanentSinkError as exc:
                    outcomes[index] = exc
                    continue
                batches = queued.setdefault(self._partitioner(key, partitions, partitions), deque())
                if not batches or batches[-1][0].append(timestamp=None, key=key, value=value, headers=headers) is None:
                    batches.append((producer.create_batch(), []))  # the first, or the last one is full
                    batches[-1][0].append(timestamp=None, key=key, value=value, headers=headers)  # one always fits
                batches[-1][1].append(index)
            while any(queued.values()):
                wave = [(partition, *batches.popleft()) for partition, batches in queued.items() if batches]
                sent = []  # filled one by one: a deadline may cut the wave off half handed over
                for partition, batch, indexes in wave:
                    sent.append((partition, indexes, await producer.send_batch(batch, topic, partition=partition)))
                failed: KafkaError | None = None
                for partition, indexes, future in sent:
                    try:
                        # Shielded: a deadline cancels this wait, never the batch's own future,
                        # which says when the batch is written or failed.
                        await asyncio.shield(future)
                    except (MessageSizeTooLargeError, RecordTooLargeError) as exc:
                        if len(indexes) == 1:
                            outcomes[indexes[0]] = _too_large(exc)
                            continue
                        # The broker's limit is below max_message_bytes: its messages go again,
                        # each in a batch of its own and in order, before the partition's next
                        # batch, so that only a message too large by itself is refused.
                        for index in reversed(indexes):
                            queued[partition].appendleft((_batch_of_one(producer, messages[index]), [index]))
                    except KafkaError as exc:
                        failed = failed or exc  # the wave's other answers are still awaited
                if failed is not None:
                    raise failed
        except KafkaError as exc:
            raise self._retryable(exc) from exc
        finally:
            for _, _, future in sent:  # a failed publish: nothing left unobserved
                if future.done():
                    _observe(future)
                else:
                    future.add_done_callback(_observe)
                    self._unresolved.append(future)
        return outcomes

    async def reachable(self) -> None:
        """One metadata round trip to the brokers (see ``OrderedLogSink``); raises while they do
        not answer. The caller bounds the wait."""
        producer = await self._started()
        try:
            await producer.client.fetch_all_metadata()
        except KafkaError as exc:
            raise RetryableSinkError(
                f"broker {self.settings.bootstrap_servers} unreachable: {type(exc).__name__}: {exc}"
            ) from exc

    def _note_partitions(self, count: int) -> None:
        """Warn once when the topic's partition count changes (as the producer's metadata shows
        it): each room's key then maps to another partition, so a consumer may read a room's
        newer events, in their new partition, before its older ones still waiting in the old."""
        if count != self._partition_count:
            if self._partition_count:
                self.log.warning(
                    "the topic's partition count changed: rooms' events go to other partitions from now"
                    " on, and a consumer may read a room's newer events before its older ones; let the"
                    " consumers catch up on the old partitions before relying on a room's order",
                    extra={"sink": "kafka", "topic": self.settings.topic, "partitions": count,
                           "partitions_before": self._partition_count},
                )  # fmt: skip
            self._partition_count = count

    def _message(self, envelope: EventEnvelope) -> Message:
        value = _json(envelope)
        if len(value) > self.settings.max_message_bytes:
            raise PermanentSinkError(
                f"message of {len(value)} bytes exceeds max_message_bytes {self.settings.max_message_bytes}"
            )
        headers = [("event_id", envelope.event_id.encode()), ("event_type", envelope.event_type.encode())]
        if envelope.traceparent:
            headers.append(("traceparent", envelope.traceparent.encode()))
        return value, f"{envelope.app_code}:{envelope.room_id}".encode(), headers

    def _retryable(self, exc: KafkaError) -> RetryableSinkError:
        return RetryableSinkError(f"send to topic {self.settings.topic} failed: {type(exc).__name__}: {exc}")

    async def _started(self) -> AIOKafkaProducer:
        """The producer, started on first use (and again after a failed start), so that a
        broker that is down at start-up only delays this lane."""
        if self._producer is not None:
            # Every delivery passes here: once started, no lock (taking one yields to the
            # event loop, a measurable cost per event at thousands of events a second).
            return self._producer
        async with self._starting:
            if self._producer is None:
                idempotent = self.settings.idempotence != "false"
                try:
                    self._producer = await self._start(idempotent)
                except KafkaError as exc:
                    if self.settings.idempotence != "auto" or not _refused_idempotence(exc):
                        raise RetryableSinkError(
                            f"broker {self.settings.bootstrap_servers} unavailable: {exc}"
                        ) from exc
                    self.log.warning(
                        "broker refused an idempotent producer; sending without idempotence",
                        extra={"sink": "kafka", "error": f"{type(exc).__name__}"},
                    )
                    try:
                        self._producer = await self._start(idempotent=False)
                    except KafkaError as exc2:
                        raise RetryableSinkError(
                            f"broker {self.settings.bootstrap_servers} unavailable: {exc2}"
                        ) from exc2
            return self._producer

    async def _start(self, idempotent: bool) -> AIOKafkaProducer:
        producer = AIOKafkaProducer(
            bootstrap_servers=self.settings.bootstrap_servers,
            client_id=self.settings.client_id,
            acks="all",
            enable_idempotence=idempotent,
            request_timeout_ms=int(self.settings.request_timeout * 1000),
            max_request_size=self.settings.max_message_bytes + 1024,
            # The broker's limit (message.max.bytes) bounds a record batch, not a message: a
            # batch above it is refused whole, and its messages must go again one at a time.
            max_batch_size=min(DEFAULT_BATCH_BYTES, self.settings.max_message_bytes),
            partitioner=self._partitioner,
            **self._security,
        )
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
        return producer

    async def aclose(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None


#: aiokafka's own record batch size.
DEFAULT_BATCH_BYTES = 16_384

#: The envelope as JSON bytes: ``model_dump_json`` without its wrapper and its str round trip.
_json = EventEnvelope.__pydantic_serializer__.to_json


class KeyPartitioner:
    """aiokafka's default partitioner for keyed messages (murmur2 of the key, the partition
    every Kafka client picks for that key), with each key's hash remembered: the hash is
    pure Python and a room's key comes back with each of its events."""

    def __init__(self, keys: int = 65_536) -> None:
        self._hash: Callable[[bytes], int] = functools.lru_cache(maxsize=keys)(murmur2)

    def __call__(self, key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
        if key is None:
            partition: int = DefaultPartitioner()(key, all_partitions, available)
            return partition
        return all_partitions[(self._hash(key) & 0x7FFFFFFF) % len(all_partitions)]


def _batch_of_one(producer: AIOKafkaProducer, message: Message) -> Any:
    value, key, headers = message
    batch = producer.create_batch()
    batch.append(timestamp=None, key=key, value=value, headers=headers)
    return batch


def _observe(future: asyncio.Future[Any]) -> None:
    """Take a finished batch's error, which nobody else awaits, so asyncio does not log it."""
    if not future.cancelled():
        future.exception()


def _too_large(exc: KafkaError) -> PermanentSinkError:
    return PermanentSinkError(f"broker refused the message as too large: {type(exc).__name__}")


def _refused_idempotence(exc: KafkaError) -> bool:
    # InitProducerId answered with an error code the broker uses for "not implemented".
    return type(exc).__name__ in ("UnknownError", "UnsupportedVersionError", "ClusterAuthorizationFailedError")
