"""The consumers' instruments.

=============================================  =========  =====================================
name                                           kind       attributes
=============================================  =========  =====================================
``room_outbox_consumer_lag``                   gauge      consumer, topic, partition
``room_outbox_consumer_handled_total``         counter    consumer, handler, outcome
``room_outbox_consumer_retried_total``         counter    consumer, handler
``room_outbox_consumer_dead_total``            counter    consumer, handler, reason
``room_outbox_consumer_handler_latency_ms``    histogram  consumer, handler
=============================================  =========  =====================================

``outcome``: ``handled``, or ``duplicate`` (its processed record existed: a redelivery).
Lag is the partition's high watermark minus the offset this process last committed, set after
each commit. The counters exist from start-up at 0 for every handler of the process.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry.metrics import Meter

from room_outbox.observability.metrics import LATENCY_BUCKETS_MS


class ConsumerMetrics:
    def __init__(self, meter: Meter, consumer: str, handlers: Iterable[str]) -> None:
        self.consumer = consumer
        self.lag = meter.create_gauge(
            "room_outbox_consumer_lag", unit="{message}", description="Messages of a partition not yet committed."
        )
        self.handled = meter.create_counter(
            "room_outbox_consumer_handled_total", unit="{message}", description="Messages a handler settled."
        )
        self.retried = meter.create_counter(
            "room_outbox_consumer_retried_total",
            unit="{message}",
            description="Handlings that failed and were scheduled for a retry.",
        )
        self.dead = meter.create_counter(
            "room_outbox_consumer_dead_total", unit="{message}", description="Messages that became dead letters."
        )
        self.latency = meter.create_histogram(
            "room_outbox_consumer_handler_latency_ms",
            unit="ms",
            description="One handling: its transaction, the handler and the commit.",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_MS,
        )
        for handler in handlers:
            labels = {"consumer": consumer, "handler": handler}
            self.handled.add(0, {**labels, "outcome": "handled"})
            self.retried.add(0, labels)
            self.dead.add(0, {**labels, "reason": "failed"})
