"""Where a consumer group stands on its topic, as the broker says: each partition's end (its
high watermark) and the group's committed offset. ``consumers describe`` reads them once; every
``consume`` process reads them on a timer for the lag metric (:class:`LagWatch`).

The lag comes from the broker, not from what the process last did: a consumer that commits
nothing (a handler stuck, the database down, a partition assigned to no member, the group
rebalancing, the process not in the group at all) shows a lag that grows with the topic.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import anyio
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from room_outbox.attempt.failure import describe, error_text
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.observability.metrics import ConsumerMetrics
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.repeated import RepeatedFailure

log = logging.getLogger("room_outbox.consume")

#: One reading of the lag (metadata, committed offsets, end offsets and a fetch): past it, the
#: reading is abandoned and the gauges keep their last values until the next one.
LAG_READ_TIMEOUT = 10.0
#: Closing the watch's clients (at the consumer's stop, or after a failed reading).
CLOSE_TIMEOUT = 2.0


@dataclass(frozen=True)
class PartitionOffsets:
    #: The group's committed offset (None: nothing committed yet).
    committed: int | None
    #: The partition's end: the offset its next message gets.
    end: int

    @property
    def lag(self) -> int:
        """Messages not yet committed (from the beginning when nothing is committed)."""
        return self.end - (self.committed or 0)


async def group_offsets(
    admin: AIOKafkaAdminClient, reader: AIOKafkaConsumer, group: str, topic: str
) -> dict[TopicPartition, PartitionOffsets]:
    """Every partition of ``topic`` (none when it does not exist yet): ``group``'s committed
    offset and the partition's end. ``reader``: a consumer outside any group."""
    await reader._client.force_metadata_update()
    partitions = [TopicPartition(topic, p) for p in sorted(reader.partitions_for_topic(topic) or ())]
    if not partitions:
        return {}
    committed = await admin.list_consumer_group_offsets(group, partitions=partitions)
    ends = await high_watermarks(reader, partitions, await reader.end_offsets(partitions))
    offsets = {}
    for tp in partitions:
        done = committed.get(tp)
        offsets[tp] = PartitionOffsets(done.offset if done is not None and done.offset >= 0 else None, ends[tp])
    return offsets


async def high_watermarks(
    reader: AIOKafkaConsumer, partitions: list[TopicPartition], listed: dict[TopicPartition, int]
) -> dict[TopicPartition, int]:
    """Each partition's end: the later of ``listed`` (the offsets lookup) and the high watermark
    a fetch from there reports, which the lookup can lag by the last batch (seen on tansu).
    ``reader`` is assigned the partitions: a reader outside any group. It is left with none,
    so a reader kept for the next call fetches nothing meanwhile. The caller bounds the wait."""
    reader.assign(partitions)
    try:
        for tp in partitions:
            reader.seek(tp, listed[tp])
        while any(reader.highwater(tp) is None for tp in partitions):
            await reader.getmany(*partitions, timeout_ms=200, max_records=1)
        return {tp: max(listed[tp], reader.highwater(tp) or 0) for tp in partitions}
    finally:
        reader.unsubscribe()


class LagWatch:
    """A consumer's lag metric (``room_outbox.consumer.lag``), read every ``interval``: per
    partition of the topic, its end minus the group's committed offset. Every process of the
    group reports every partition (the same numbers: take their max, not their sum), so a
    partition no member holds is reported too. Its own clients, outside the group, kept
    between readings (started again after a failed one); a reading that fails leaves the
    gauges as they were, and is logged as a recurring failure (:class:`RepeatedFailure`)."""

    def __init__(
        self, name: str, settings: ConsumerSettings, metrics: ConsumerMetrics, redactor: Redactor, interval: float
    ) -> None:
        self.name = name
        self.settings = settings
        self.metrics = metrics
        self.redactor = redactor
        self.interval = interval
        self._clients: tuple[AIOKafkaAdminClient, AIOKafkaConsumer] | None = None
        self.failing = RepeatedFailure(
            log,
            "consumer lag not read; its metric keeps its last values until it is",
            "consumer lag read again",
            level=logging.WARNING,
            consumer=name,
        )

    async def run(self, stop: anyio.Event) -> None:
        """Read the lag now, then every ``interval``, until ``stop`` is set."""
        try:
            while not stop.is_set():
                await self.read_once()
                with anyio.move_on_after(self.interval):
                    await stop.wait()
        finally:
            await self._close()

    async def read_once(self) -> None:
        try:
            with anyio.fail_after(LAG_READ_TIMEOUT):
                admin, reader = await self._started()
                offsets = await group_offsets(admin, reader, self.settings.group(self.name), self.settings.topic)
        except Exception as exc:  # whatever the broker or the driver does, a metric never stops consuming
            await self._close()
            self.failing.failed(error_text(self.redactor, describe(exc)))
            return
        self.failing.succeeded()
        for tp, at in offsets.items():
            labels = {"consumer": self.name, "topic": tp.topic, "partition": tp.partition}
            self.metrics.lag.set(max(0, at.lag), labels)

    async def _started(self) -> tuple[AIOKafkaAdminClient, AIOKafkaConsumer]:
        if self._clients is None:
            client = {"bootstrap_servers": self.settings.bootstrap_servers, **self.settings.security.client_kwargs()}
            admin = AIOKafkaAdminClient(**client)
            reader = AIOKafkaConsumer(enable_auto_commit=False, fetch_max_wait_ms=100, **client)
            self._clients = admin, reader
            await admin.start()
            await reader.start()
        return self._clients

    async def _close(self) -> None:
        clients, self._clients = self._clients, None
        if clients is None:
            return
        admin, reader = clients
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
            for close in (reader.stop, admin.close):
                with contextlib.suppress(Exception):  # a client whose start failed may refuse its close
                    await close()
