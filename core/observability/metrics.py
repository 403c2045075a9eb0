"""Metrics (delivery counts and durations, backlog, claim and lease health; the consumers') and
their Prometheus exposition.

Instruments are named by OpenTelemetry's conventions: dotted, the unit in the unit field (seconds
for durations and ages), no Prometheus suffix. ``/metrics`` shows them through the OpenTelemetry
Prometheus exporter's standard translation, so a collector and a Prometheus scrape see the same
instruments under the names each expects. docs/reference/metrics.md lists them, generated from
the calls below: the dispatcher's are :class:`OutboxMetrics`, a consume process's
:class:`ConsumerMetrics`. Counters start at 0 for every label set known at start-up, so an
alert expression has a series to evaluate before the first failure ever happens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from room_outbox.store.clock import CLOCK

DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (0.0, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)


#: ``error_class`` of a failed attempt. The first two are found before any sink is called
#: (their ``sink`` label is "-"); the others come from a sink.
ROUTING_ERROR_CLASSES = ("bad_envelope", "no_route")
SINK_ERROR_CLASSES = ("timeout", "permanent", "retryable", "sink_bug")
#: ``detected_at`` of a lost lease: where it was found first (a row is counted once).
LEASE_LOSS_POINTS = ("renewal", "result_write")
#: ``cause`` of a lost lease: ``taken_over`` (another claim holds the row: a paused process,
#: a lease too short; a fault), ``published_by_producer`` (room-service's own push
#: succeeded while this claim held the row; not a fault) or ``claim_failed`` (the claim
#: handed the row over and then failed, before its lease was written: a database fault, which
#: fails the round too). A renewal counts only the first.
LEASE_LOSS_CAUSES = ("taken_over", "published_by_producer", "claim_failed")
LEASE_LOSSES = (("renewal", "taken_over"), *(("result_write", cause) for cause in LEASE_LOSS_CAUSES))


class OutboxMetrics:
    """The instruments; recording on a no-op meter costs a method call."""

    def __init__(self, meter: Meter) -> None:
        self.pending = meter.create_gauge(
            "room_outbox.pending", unit="{event}", description="Events the lane still owes."
        )
        self.oldest_pending_age = meter.create_gauge(
            "room_outbox.oldest_pending.age",
            unit="s",
            description="Age of the oldest event the lane still owes; 0 when none is pending.",
        )
        self.skipped = meter.create_gauge(
            "room_outbox.lane.skipped",
            unit="{event}",
            description="Events the lane skipped and never sent: their ids were missing longer than"
            " lanes.gap_timeout (taken as rolled-back inserts), then they committed; sent once requeued"
            " (requeue --lane). 0 for the main lane, which skips none.",
        )
        self.success = meter.create_counter(
            "room_outbox.publish.success", unit="{event}", description="Delivery attempts that succeeded."
        )
        self.failure = meter.create_counter(
            "room_outbox.publish.failure", unit="{event}", description="Delivery attempts that failed."
        )
        self.parked = meter.create_counter(
            "room_outbox.parked",
            unit="{event}",
            description="Events parked: delivery given up on until an operator requeues them, by the class of"
            " the failure that parked them.",
        )
        self.throttled = meter.create_counter(
            "room_outbox.publish.throttled",
            unit="{event}",
            description="Deliveries held back by a rate limit, not attempts: this process's own (unsent) or the"
            " destination's (refused for its rate: Tencent IM's 60007, 60011, 10023, MsgFreqCtrl).",
        )
        self.duration = meter.create_histogram(
            "room_outbox.publish.duration",
            unit="s",
            description="Duration of one delivery attempt (parse, route, sink call); none for untimed sinks (noop).",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S,
        )
        self.claimed = meter.create_histogram(
            "room_outbox.claimed_batch.size",
            unit="{event}",
            description="Rows taken by one claim round (0 when the lane was idle).",
            explicit_bucket_boundaries_advisory=BATCH_BUCKETS,
        )
        self.round_failures = meter.create_counter(
            "room_outbox.round.failures",
            unit="{round}",
            description="Rounds of a lane that failed as a whole (the database unreachable or refusing, a"
            " tailing lane's batch); each is tried again after poll_interval.",
        )
        self.lost_leases = meter.create_counter(
            "room_outbox.lost_leases",
            unit="{event}",
            description="Claimed rows this process no longer held, each counted once, by cause (taken over,"
            " published by the producer, claim failed).",
        )
        meter.create_observable_gauge(
            "room_outbox.clock.offset",
            callbacks=[_clock_offset],
            unit="s",
            description="How far this host's clock is ahead of the database's (negative: behind).",
        )

    def start_at_zero(self, routes: Iterable[tuple[str, str]], lanes: Iterable[str] = ()) -> None:
        """Export every counter at 0 for ``routes`` ((sink, event_type) pairs), ``lanes`` and
        the fixed label values (each error class, each detection point), before anything has
        happened."""
        for lane in lanes:
            self.round_failures.add(0, {"lane": lane})
        event_types: set[str] = set()
        for sink, event_type in routes:
            event_types.add(event_type)
            labels = {"sink": sink, "event_type": event_type}
            self.success.add(0, labels)
            self.throttled.add(0, labels)
            for error_class in SINK_ERROR_CLASSES:
                self.failure.add(0, {**labels, "error_class": error_class})
                self.parked.add(0, {**labels, "error_class": error_class})
        for event_type in sorted(event_types):
            for error_class in ROUTING_ERROR_CLASSES:
                self.failure.add(0, {"sink": "-", "event_type": event_type, "error_class": error_class})
                self.parked.add(0, {"sink": "-", "event_type": event_type, "error_class": error_class})
        for point, cause in LEASE_LOSSES:
            self.lost_leases.add(0, {"detected_at": point, "cause": cause})


class BacklogSamples:
    """How the backlog timer fares, exported by the process that runs it from its first round
    on. A sample that fails leaves the backlog gauges at their last values, which alone look
    like a backlog standing still: the age says how old they are (alerts leave out a process's
    stale gauges), the counter how often sampling fails."""

    def __init__(self, meter: Meter) -> None:
        self._sampled_at = time.monotonic()
        self.failures = meter.create_counter(
            "room_outbox.backlog.sample.failures",
            unit="{sample}",
            description="Backlog samples that failed; the backlog gauges keep their last values meanwhile.",
        )
        self.failures.add(0)
        meter.create_observable_gauge(
            "room_outbox.backlog.sample.age",
            callbacks=[self._age],
            unit="s",
            description="Time since the backlog gauges were last sampled (before the first sample: since the"
            " timer started).",
        )

    def succeeded(self) -> None:
        self._sampled_at = time.monotonic()

    def failed(self) -> None:
        self.failures.add(1)

    def _age(self, options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(time.monotonic() - self._sampled_at)


def export_schema_problems(meter: Meter, failing: Callable[[], bool]) -> None:
    """The schema watch's finding (``failing``, read at each collection) as a gauge, 0 from
    start-up: a missing index makes the process unready and logs one line, neither of which
    pages anyone; an alert on the gauge does."""

    def observe(options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(1 if failing() else 0)

    meter.create_observable_gauge(
        "room_outbox.schema.problems",
        callbacks=[observe],
        unit="{problem}",
        description="1 while the outbox table lacks an index room-outbox's statements need (the schema watch's"
        " finding), else 0.",
    )


def _clock_offset(options: CallbackOptions) -> Iterable[Observation]:
    """Read at each collection: the offset as last measured (:mod:`room_outbox.store.clock`)."""
    yield Observation(CLOCK.offset)


#: ``reason`` of a dead letter a handler made: it failed for good, or ran out of attempts.
HANDLER_DEAD_REASONS = ("permanent", "failed")
#: The labels of a message no handler was chosen for (unparsable, or a type none takes).
REJECTED_DEAD = {"handler": "(none)", "reason": "rejected"}


class ConsumerMetrics:
    """One consumer's instruments, its counters exported at 0 for each of ``handlers`` (and
    every dead-letter reason: an alert on their increase sees the first dead letter only
    from a series that was there before it). A handling's ``outcome`` is ``handled``, or
    ``duplicate`` (its processed record existed: a redelivery); the lag is the partition's end
    minus the group's committed offset, read from the broker on a timer for every partition of
    the topic (room_outbox.consume.offsets). The partitions assigned start at 0: a process
    that never joins its group says so."""

    def __init__(self, meter: Meter, consumer: str, handlers: Iterable[str]) -> None:
        self.consumer = consumer
        self.lag = meter.create_gauge(
            "room_outbox.consumer.lag",
            unit="{message}",
            description="Messages of a partition its group has not committed yet, as the broker says.",
        )
        self.assigned = meter.create_gauge(
            "room_outbox.consumer.assigned_partitions",
            unit="{partition}",
            description="Partitions this process's member of the group holds; 0 while it is out of the group.",
        )
        self.retrying = meter.create_gauge(
            "room_outbox.consumer.retrying",
            unit="{message}",
            description="Rows of the consumer's retry table waiting for a retry (every process of the group"
            " reports them all).",
        )
        self.handled = meter.create_counter(
            "room_outbox.consumer.handled", unit="{message}", description="Messages a handler settled."
        )
        self.retried = meter.create_counter(
            "room_outbox.consumer.retried",
            unit="{message}",
            description="Handlings that failed and were scheduled for a retry.",
        )
        self.dead = meter.create_counter(
            "room_outbox.consumer.dead", unit="{message}", description="Messages that became dead letters."
        )
        self.duration = meter.create_histogram(
            "room_outbox.consumer.handler.duration",
            unit="s",
            description="One handling: its transaction, the handler and the commit.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S,
        )
        for handler in handlers:
            labels = {"consumer": consumer, "handler": handler}
            self.handled.add(0, {**labels, "outcome": "handled"})
            self.retried.add(0, labels)
            for reason in HANDLER_DEAD_REASONS:
                self.dead.add(0, {**labels, "reason": reason})
        self.dead.add(0, {"consumer": consumer, **REJECTED_DEAD})
        self.assigned.set(0, {"consumer": consumer})


# -- /metrics ------------------------------------------------------------------------------

#: Prometheus text format 0.0.4: what every Prometheus server reads.
PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class PrometheusExposition:
    """The metric reader behind ``/metrics``: OpenTelemetry's Prometheus exporter, in a registry
    of its own (so several in one process, as in tests, never meet) next to the process and
    runtime collectors.

    Those are ``prometheus_client``'s process, platform and GC collectors
    (``process_cpu_seconds_total``, ``python_gc_*``...): the names Prometheus users' dashboards
    already know (OpenTelemetry's system metrics would need psutil and name them
    ``process_runtime_*``). The scope labels are left off: every instrument has one scope."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)  # reads /proc/self; nothing on systems without it
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.reader = PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)
        # The exporter queues each collection for the next render to translate: two renders
        # at once (two scrapers) could each see the other's, and show a family twice.
        self._one_at_a_time = threading.Lock()

    def render(self) -> str:
        """Everything, collected now, in Prometheus text format 0.0.4."""
        with self._one_at_a_time:
            return generate_latest(self.registry).decode()
