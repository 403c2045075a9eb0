"""Metrics (delivery counts and latency, backlog, claim and lease health; the consumers') and
their Prometheus text form.

=============================================  =========  ====================================
name                                           kind       attributes
=============================================  =========  ====================================
``room_outbox_pending_total``                  gauge      lane: events the lane still owes
``room_outbox_oldest_pending_age_ms``          gauge      lane: age of the oldest of them
``room_outbox_publish_success_total``          counter    sink, event_type
``room_outbox_publish_failure_total``          counter    sink, event_type, error_class
``room_outbox_publish_latency_ms``             histogram  sink, event_type, outcome
``room_outbox_claimed_batch_size``             histogram  one observation per claim round
``room_outbox_lost_leases_total``              counter    detected_at (renewal, result_write), cause
``room_outbox_consumer_lag``                   gauge      consumer, topic, partition
``room_outbox_consumer_handled_total``         counter    consumer, handler, outcome
``room_outbox_consumer_retried_total``         counter    consumer, handler
``room_outbox_consumer_dead_total``            counter    consumer, handler, reason
``room_outbox_consumer_handler_latency_ms``    histogram  consumer, handler
=============================================  =========  ====================================

The first seven are the dispatcher's (:class:`OutboxMetrics`), the last five a consume
process's (:class:`ConsumerMetrics`). A consumer's ``outcome`` is ``handled``, or
``duplicate`` (its processed record existed: a redelivery); its lag is the partition's high
watermark minus the offset this process last committed, set after each commit.

Next to them ``/metrics`` carries the process and runtime metrics of ``prometheus_client``'s
process, platform and GC collectors (``process_cpu_seconds_total``,
``process_resident_memory_bytes``, ``process_open_fds``, ``python_gc_*``, ``python_info``...):
the names every Prometheus user's dashboards already know, from a small, pure-Python library
maintained by the Prometheus project (OpenTelemetry's system-metrics instrumentation would need
psutil and names them ``process_runtime_*`` instead).

The two gauges come from a timer (:mod:`room_outbox.observability.service`), one series per lane the
configuration runs: ``lane="im"`` counts pending rows of ``room_outbox`` (only while the IM
lane runs: otherwise ``status`` is room-service's and no backlog of anyone's here), a lane of
its own counts its pending rows plus the rows not fed to it yet. Every counter is exported
from start-up at 0 for the label sets known then (each sink with each event type it takes,
each error class, each detection point), so that an alert expression has a series to
evaluate before the first failure ever happens (a consumer's: every handler of the process,
with outcome ``handled``, reason ``failed``). Instruments are named exactly as Prometheus shows them,
so the OTLP and the ``/metrics`` names agree; :func:`render_prometheus` therefore never
appends ``_total`` to a counter that already ends with it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics.export import Gauge, Histogram, MetricsData, NumberDataPoint, Sum
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest

LATENCY_BUCKETS_MS = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0)
BATCH_BUCKETS = (0.0, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0)


#: ``error_class`` of a failed attempt. The first two are found before any sink is called
#: (their ``sink`` label is "-"); the others come from a sink.
ROUTING_ERROR_CLASSES = ("bad_envelope", "no_route")
SINK_ERROR_CLASSES = ("timeout", "permanent", "retryable", "sink_bug")
#: ``detected_at`` of a lost lease.
LEASE_LOSS_POINTS = ("renewal", "result_write")
#: ``cause`` of a lost lease: ``taken_over`` (another claim holds the row: a paused process,
#: a lease too short; a fault) or ``published_by_producer`` (room-service's own push
#: succeeded while this claim held the row; not a fault). A renewal counts only the first.
LEASE_LOSS_CAUSES = ("taken_over", "published_by_producer")
LEASE_LOSSES = (("renewal", "taken_over"), *(("result_write", cause) for cause in LEASE_LOSS_CAUSES))


class OutboxMetrics:
    """The instruments; recording on a no-op meter costs a method call."""

    def __init__(self, meter: Meter) -> None:
        self.pending = meter.create_gauge(
            "room_outbox_pending_total", unit="{event}", description="Rows of room_outbox with status pending."
        )
        self.oldest_pending_age = meter.create_gauge(
            "room_outbox_oldest_pending_age_ms",
            unit="ms",
            description="Age of the oldest (lowest id) pending row; 0 when none is pending.",
        )
        self.success = meter.create_counter(
            "room_outbox_publish_success_total", unit="{event}", description="Delivery attempts that succeeded."
        )
        self.failure = meter.create_counter(
            "room_outbox_publish_failure_total", unit="{event}", description="Delivery attempts that failed."
        )
        self.latency = meter.create_histogram(
            "room_outbox_publish_latency_ms",
            unit="ms",
            description="Duration of one delivery attempt (parse, route, sink call).",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_MS,
        )
        self.claimed = meter.create_histogram(
            "room_outbox_claimed_batch_size",
            unit="{event}",
            description="Rows taken by one claim round (0 when the lane was idle).",
            explicit_bucket_boundaries_advisory=BATCH_BUCKETS,
        )
        self.lost_leases = meter.create_counter(
            "room_outbox_lost_leases_total",
            unit="{event}",
            description="Claimed rows this process no longer held, by cause (taken over, published by the producer).",
        )

    def start_at_zero(self, routes: Iterable[tuple[str, str]]) -> None:
        """Export every counter at 0 for ``routes`` ((sink, event_type) pairs) and the fixed
        label values, before anything has happened."""
        event_types: set[str] = set()
        for sink, event_type in routes:
            event_types.add(event_type)
            labels = {"sink": sink, "event_type": event_type}
            self.success.add(0, labels)
            for error_class in SINK_ERROR_CLASSES:
                self.failure.add(0, {**labels, "error_class": error_class})
        for event_type in sorted(event_types):
            for error_class in ROUTING_ERROR_CLASSES:
                self.failure.add(0, {"sink": "-", "event_type": event_type, "error_class": error_class})
        for point, cause in LEASE_LOSSES:
            self.lost_leases.add(0, {"detected_at": point, "cause": cause})


class ConsumerMetrics:
    """One consumer's instruments, its counters exported at 0 for each of ``handlers``."""

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


# -- Prometheus text exposition format 0.0.4 ------------------------------------------------

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INVALID_NAME = re.compile(r"[^a-zA-Z0-9_:]")
_INVALID_LABEL = re.compile(r"[^a-zA-Z0-9_]")


def render_prometheus(data: MetricsData | None) -> str:
    """Cumulative OTel metrics as Prometheus text (counters, gauges, histograms)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                name = _INVALID_NAME.sub("_", metric.name)
                point_data = metric.data
                lines: list[str] = []
                if isinstance(point_data, Sum):
                    kind = "counter" if point_data.is_monotonic else "gauge"
                    if kind == "counter" and not name.endswith("_total"):
                        name += "_total"
                    lines = [_sample(name, p.attributes, p.value) for p in _numbers(point_data.data_points)]
                elif isinstance(point_data, Gauge):
                    kind = "gauge"
                    lines = [_sample(name, p.attributes, p.value) for p in _numbers(point_data.data_points)]
                elif isinstance(point_data, Histogram):
                    kind = "histogram"
                    for point in point_data.data_points:
                        cumulative = 0
                        bounds = [*point.explicit_bounds, math.inf]
                        for bound, count in zip(bounds, point.bucket_counts, strict=True):
                            cumulative += count
                            lines.append(_sample(f"{name}_bucket", point.attributes, cumulative, le=_number(bound)))
                        lines.append(_sample(f"{name}_sum", point.attributes, point.sum))
                        lines.append(_sample(f"{name}_count", point.attributes, point.count))
                else:  # exponential histograms are never configured here
                    continue
                _, _, existing = families.setdefault(name, (kind, metric.description or "", []))
                existing.extend(lines)
    out: list[str] = []
    for name, (kind, description, lines) in sorted(families.items()):
        if description:
            out.append(f"# HELP {name} {description.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(lines)
    return "\n".join(out) + "\n" if out else ""


_RUNTIME = CollectorRegistry(auto_describe=False)
ProcessCollector(registry=_RUNTIME)  # reads /proc/self; nothing on systems without it
PlatformCollector(registry=_RUNTIME)
GCCollector(registry=_RUNTIME)


def render_runtime() -> str:
    """``process_*`` and ``python_*`` of this process, Prometheus text format 0.0.4."""
    return generate_latest(_RUNTIME).decode()


def _numbers(points: Iterable[object]) -> Iterable[NumberDataPoint]:
    return (p for p in points if isinstance(p, NumberDataPoint))


def _sample(name: str, attributes: Mapping[str, object] | None, value: float, le: str | None = None) -> str:
    pairs = sorted((attributes or {}).items())
    if le is not None:  # by convention the bucket bound comes last
        pairs.append(("le", le))
    if not pairs:
        return f"{name} {_number(value)}"
    text = ",".join(f'{_INVALID_LABEL.sub("_", k)}="{_escape(v)}"' for k, v in pairs)
    return f"{name}{{{text}}} {_number(value)}"


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
