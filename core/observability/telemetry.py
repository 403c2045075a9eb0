"""Telemetry: the :class:`Telemetry` the dispatcher records into (logs:
:mod:`room_outbox.observability.logs`).

Traces and metrics (:mod:`room_outbox.observability.tracing`,
:mod:`room_outbox.observability.metrics`) are set up from the standard OpenTelemetry
environment by :func:`telemetry_from_environment`. With no span exporter the dispatcher gets
no tracer at all and with no metric reader a no-op meter, so an unconfigured process pays a
few attribute look-ups per delivery attempt.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import anyio
from opentelemetry import trace
from opentelemetry.metrics import MeterProvider, NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider as SDKMeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from room_outbox.config import ConfigError
from room_outbox.envelope import event_type_label
from room_outbox.observability.logs import span_stream
from room_outbox.observability.metrics import OutboxMetrics, PrometheusExposition
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.tracing import SCOPE, AttemptSpan, RedactingSpanExporter
from room_outbox.version import package_version

if TYPE_CHECKING:
    from room_outbox.attempt.failure import Failure
    from room_outbox.envelope import EventEnvelope
    from room_outbox.store.protocol import OutboxRow

log = logging.getLogger("room_outbox.telemetry")

#: Seconds the exporters get, all together, to send what they hold when the process stops.
#: Unbounded, a collector that is down, refuses or never answers would hold the stop for as
#: long as the SDK retries (each batch of spans with the exporter's timeout and backoff, then
#: the metrics' last export): past a container's grace period, and the process is killed.
EXPORT_AT_STOP = 2.0

# -- traces and metrics ---------------------------------------------------------------------


class Telemetry:
    """What the dispatcher and the lifecycle record into. ``Telemetry()`` records nothing,
    cheaply; tests pass SDK providers with in-memory exporters/readers."""

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        prometheus: PrometheusExposition | None = None,
        span_processors: Sequence[SpanProcessor] = (),
    ) -> None:
        """``span_processors``: the batch processors of ``tracer_provider``, to count the spans
        a stop abandons (:meth:`aclose`)."""
        self.tracer = tracer_provider.get_tracer(SCOPE) if tracer_provider is not None else None
        #: True when some reader or exporter consumes metrics (the backlog timer runs only then).
        self.metrics_enabled = meter_provider is not None
        #: For instruments beyond the dispatcher's (the consumers' own).
        self.meter = (meter_provider or NoOpMeterProvider()).get_meter(SCOPE)
        self.metrics = OutboxMetrics(self.meter)
        self._prometheus = prometheus
        #: False: :meth:`attempt` observes nothing, and callers may skip what only it needs.
        self.recording = self.tracer is not None or self.metrics_enabled
        self._providers: list[Any] = [p for p in (tracer_provider, meter_provider) if p is not None]
        self._span_processors = span_processors
        #: Sinks whose attempts are counted but not timed (see ``SinkSpec.timed``).
        self.untimed_sinks: frozenset[str] = frozenset()
        #: Outcome counts not yet added to their counters (see :meth:`count`).
        self._counts: dict[tuple[Any, tuple[tuple[str, str], ...]], int] = {}

    def count(self, counter: Any, labels: Mapping[str, str], events: int = 1) -> None:
        """``events`` more on ``counter`` with ``labels``, added by the next :meth:`flush_counts`:
        an SDK counter's ``add`` costs about as much as the rest of a no-op delivery, so the
        outcomes of a batch are added once per label set, not once per event."""
        key = (counter, tuple(labels.items()))
        self._counts[key] = self._counts.get(key, 0) + events

    def flush_counts(self) -> None:
        """Add the counts :meth:`count` kept: before every claim and every result write (so
        what the database shows published is counted), before a scrape, and at shutdown."""
        counts, self._counts = self._counts, {}
        for (counter, labels), n in counts.items():
            counter.add(n, dict(labels))

    def attempt(self, row: OutboxRow, event_label: str | None = None) -> DeliveryAttempt:
        """Start observing one delivery attempt of ``row``. ``event_label``: the event type as
        metric label and span name, ``other`` for a type the routing does not know (the
        dispatcher's :meth:`~room_outbox.delivery.routing.Router.event_label`): a type comes from a row,
        and rows must not mint label values without bound. Default: the known types' rule."""
        if not self.recording:
            return NO_ATTEMPT
        return DeliveryAttempt(self, row, event_label or event_type_label(row.event_type))

    def claimed(self, rows: int) -> None:
        if self.metrics_enabled:
            self.metrics.claimed.record(rows)

    def round_failed(self, lane: str) -> None:
        if self.metrics_enabled:
            self.metrics.round_failures.add(1, {"lane": lane})

    def leases_lost(self, rows: int, detected_at: str, cause: str = "taken_over") -> None:
        """``detected_at``: ``renewal`` (the renewal found rows gone) or ``result_write``
        (a result could not be written because the claim no longer held the row); ``cause``:
        one of ``LEASE_LOSS_CAUSES``."""
        if rows > 0 and self.metrics_enabled:
            self.metrics.lost_leases.add(rows, {"detected_at": detected_at, "cause": cause})

    def backlog(self, pending: int, oldest_pending_age_ms: int, lane: str = "main", skipped: int = 0) -> None:
        """A lane's backlog sample; ``skipped``: the events it skipped and never sent (the main
        lane skips none: its rows are claimed from room_outbox itself, 0 all the same)."""
        labels = {"lane": lane}
        self.metrics.pending.set(pending, labels)
        self.metrics.oldest_pending_age.set(oldest_pending_age_ms / 1000, labels)
        self.metrics.skipped.set(skipped, labels)

    @property
    def serves_prometheus(self) -> bool:
        return self._prometheus is not None

    def prometheus_text(self) -> str:
        """The current metrics, process and runtime ones included, in Prometheus text format
        ("" without a Prometheus reader)."""
        if self._prometheus is None:
            return ""
        self.flush_counts()
        return self._prometheus.render()

    async def aclose(self) -> None:
        """Flush and stop the exporters, for :data:`EXPORT_AT_STOP` seconds at most: past it
        they are abandoned (what they still hold is lost, said in one WARNING) and the stop
        goes on. They block on network I/O, so they stop in a thread of their own: a daemon,
        which a collector that never answers cannot keep from exiting with the process."""
        self.flush_counts()
        providers, self._providers = self._providers, []
        if not providers:
            return
        stopped = threading.Event()

        def stop() -> None:
            try:
                for provider in providers:
                    if hasattr(provider, "shutdown"):  # the API's no-op providers have none
                        provider.shutdown()
            except Exception as exc:  # the metric readers' failures, gathered by the SDK
                log.warning("telemetry exporters failed to stop", extra={"error": f"{type(exc).__name__}: {exc}"})
            finally:
                stopped.set()

        threading.Thread(target=stop, name="room-outbox-telemetry-stop", daemon=True).start()
        if await anyio.to_thread.run_sync(stopped.wait, EXPORT_AT_STOP):
            return
        waiting = _spans_waiting(self._span_processors)
        log.warning(
            "telemetry exporters did not finish within %gs: abandoned, what they still held is lost",
            EXPORT_AT_STOP,
            extra={"lifecycle": "telemetry_abandoned", **({"spans_lost": waiting} if waiting is not None else {})},
        )


def _spans_waiting(processors: Sequence[SpanProcessor]) -> int | None:
    """Spans the batch processors still hold, besides any batch being exported; ``None`` when
    unknown: the SDK keeps them in a private queue, read here only to say what a stop lost."""
    try:
        queues = [processor._batch_processor._queue for processor in processors]  # type: ignore[attr-defined]
    except AttributeError:
        return None
    return sum(len(queue) for queue in queues)


class DeliveryAttempt:
    """One delivery attempt being observed: its span (when tracing) and its metrics (an
    :class:`~room_outbox.attempt.pipeline.Observer`)."""

    __slots__ = ("_event_label", "_sink", "_span", "_t0", "_telemetry")

    def __init__(self, telemetry: Telemetry, row: OutboxRow, event_label: str) -> None:
        self._telemetry = telemetry
        self._event_label = event_label
        self._t0 = time.perf_counter()
        self._sink = "-"
        self._span = AttemptSpan(telemetry.tracer, row, event_label) if telemetry.tracer is not None else None

    def parsed(self, envelope: EventEnvelope) -> None:
        """The envelope parsed: its ``traceparent`` becomes the span's parent."""
        if self._span is not None:
            self._span.parsed(envelope)

    def current(self, sink: str) -> AbstractContextManager[None]:
        """Around the sink call: the attempt's span is current, so the sink's spans nest."""
        self._sink = sink
        return self._span.delivering(sink) if self._span is not None else _NULL_CONTEXT

    def ended(self) -> AbstractContextManager[None]:
        """Around the lines logged about the attempt's outcome, once it is finished: its span is
        current again, so that they carry its ``trace_id`` and ``span_id`` as the sink's do."""
        return self._span.ended() if self._span is not None else _NULL_CONTEXT

    def finish(self, failure: Failure | None) -> None:
        """End the span and record the outcome; ``failure`` is ``None`` on success."""
        elapsed = time.perf_counter() - self._t0
        sink = failure.sink if failure is not None else self._sink
        telemetry = self._telemetry
        metrics = telemetry.metrics
        labels = {"sink": sink, "event_type": self._event_label}
        if failure is not None and failure.throttled:  # not an attempt: counted, nothing else
            telemetry.count(metrics.throttled, labels)
            if self._span is not None:
                self._span.throttled(sink)
            return
        if self._span is not None:
            if failure is None:
                self._span.finish(sink, None, None)
            else:
                self._span.finish(sink, str(failure.error_class), failure.error)
        if failure is None:
            telemetry.count(metrics.success, labels)
        else:
            # A plain str: the SDK keeps an enum member and its value as two series, which
            # /metrics would show twice (the series made at zero, and this one).
            telemetry.count(metrics.failure, {**labels, "error_class": str(failure.error_class)})
        if sink not in telemetry.untimed_sinks:
            outcome = "published" if failure is None else "failed"
            metrics.duration.record(elapsed, {**labels, "outcome": outcome})


class _NoAttempt(DeliveryAttempt):
    """Shared by every attempt when nothing is recorded: no clock, no allocation."""

    __slots__ = ()

    def __init__(self) -> None:
        pass

    def parsed(self, envelope: EventEnvelope) -> None:
        pass

    def current(self, sink: str) -> AbstractContextManager[None]:
        return _NULL_CONTEXT

    def ended(self) -> AbstractContextManager[None]:
        return _NULL_CONTEXT

    def finish(self, failure: Failure | None) -> None:
        pass


_NULL_CONTEXT: AbstractContextManager[None] = nullcontext()
#: The attempt that observes nothing.
NO_ATTEMPT: DeliveryAttempt = _NoAttempt()

_TRACE_EXPORTERS = ("otlp", "console", "none")
_METRIC_EXPORTERS = ("otlp", "console", "prometheus", "none")


def telemetry_from_environment(
    node_id: str,
    redactor: Redactor,
    prometheus: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Telemetry:
    """Build :class:`Telemetry` from the ``OTEL_*`` environment. ``prometheus``: keep metrics
    for the HTTP endpoint's ``/metrics``. Raises :class:`~room_outbox.config.ConfigError`
    naming the variable on an unknown exporter.

    * ``OTEL_SDK_DISABLED=true``: nothing, whatever else is set, ``/metrics`` included
      (:func:`sdk_disabled` says so at start).
    * ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: comma-separated ``otlp``,
      ``console`` or ``none``. Unset, OTLP is used when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
      the signal's own ``…_TRACES_ENDPOINT`` / ``…_METRICS_ENDPOINT``) is set, and nothing
      otherwise: unlike the SDK's default, an unconfigured process does not try to reach a
      collector that is not there.
    * ``OTEL_EXPORTER_OTLP[_TRACES|_METRICS]_PROTOCOL``: ``http/protobuf`` (default) or
      ``grpc``; endpoint, headers, timeouts, ``OTEL_TRACES_SAMPLER``, ``OTEL_SERVICE_NAME``,
      ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_METRIC_EXPORT_INTERVAL`` are read by the SDK."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return Telemetry()
    span_exporters = [RedactingSpanExporter(e, redactor) for e in _span_exporters(env)]
    readers: list[MetricReader] = [PeriodicExportingMetricReader(e) for e in _metric_exporters(env)]
    exposition = PrometheusExposition() if prometheus else None
    if exposition is not None:
        readers.append(exposition.reader)
    resource = _resource(node_id)
    # No shutdown at exit from the SDK: Telemetry.aclose stops the providers, bounded; the SDK's
    # own would wait for the exporters again, unbounded, after the process has finished.
    tracer_provider = None
    processors = [BatchSpanProcessor(exporter) for exporter in span_exporters]
    if processors:
        tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        for processor in processors:
            tracer_provider.add_span_processor(processor)
    meter_provider = (
        SDKMeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False) if readers else None
    )
    return Telemetry(tracer_provider, meter_provider, exposition, processors)


def sdk_disabled(environ: Mapping[str, str] | None = None) -> str | None:
    """The warning a start (``run``, ``consume``) and ``check-config`` give while
    ``OTEL_SDK_DISABLED=true``; None otherwise. It turns off the metrics on ``/metrics`` too,
    where the alerts come from: the endpoint still answers, empty, so Prometheus sees the
    process up and no series, and no alert can fire without a word, unless one is said here."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() != "true":
        return None
    return (
        "OTEL_SDK_DISABLED=true: no traces and no metrics, none on /metrics either (it answers empty:"
        " Prometheus sees the process up and no series), so no alert on room-outbox's metrics can fire;"
        " to turn off only the OTLP export, unset it and set OTEL_TRACES_EXPORTER=none and"
        " OTEL_METRICS_EXPORTER=none (or leave OTEL_EXPORTER_OTLP_ENDPOINT unset)"
    )


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`~room_outbox.config.ConfigError` for an ``OTEL_*`` exporter or protocol
    room-outbox does not know, without building anything (``room-outbox check-config``)."""
    env = os.environ if environ is None else environ
    for variable, allowed, signal in (
        ("OTEL_TRACES_EXPORTER", _TRACE_EXPORTERS, "TRACES"),
        ("OTEL_METRICS_EXPORTER", _METRIC_EXPORTERS, "METRICS"),
    ):
        if "otlp" in _names(env, variable, allowed, signal):
            _protocol(env, signal)


def _resource(node_id: str) -> Resource:
    """The process as every span and metric names it: ``service.name`` (room-outbox unless
    ``OTEL_SERVICE_NAME`` says otherwise), ``service.instance.id`` (the node_id) and
    ``service.version`` (the installed package's, on ``/metrics`` as ``target_info``: which
    version each process runs during a rolling deploy); ``OTEL_RESOURCE_ATTRIBUTES`` may set any."""
    resource = Resource.create({"service.instance.id": node_id})  # + OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "room-outbox"}))
    if "service.version" not in resource.attributes:
        resource = resource.merge(Resource({"service.version": package_version()}))
    return resource


def _names(env: Mapping[str, str], variable: str, allowed: tuple[str, ...], signal: str) -> list[str]:
    raw = env.get(variable)
    if raw is None or not raw.strip():
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
        return ["otlp"] if endpoint else []
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ConfigError(f"{variable}: unknown exporter {unknown[0]!r} (allowed: {', '.join(allowed)})")
    return [] if "none" in names else names


def _protocol(env: Mapping[str, str], signal: str) -> str:
    variable = f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL"
    protocol = (env.get(variable) or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if protocol not in ("http/protobuf", "grpc"):
        raise ConfigError(f"{variable}: unsupported OTLP protocol {protocol!r} (allowed: http/protobuf, grpc)")
    if protocol == "grpc":
        # The gRPC exporter (and grpcio) is an extra: most collectors take OTLP over HTTP too.
        try:
            import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"{variable}: OTLP over gRPC needs the gRPC exporter: pip install 'room-outbox[otlp-grpc]',"
                " or set the protocol to http/protobuf"
            ) from None
    return protocol


def _span_exporters(env: Mapping[str, str]) -> Iterator[SpanExporter]:
    for name in _names(env, "OTEL_TRACES_EXPORTER", _TRACE_EXPORTERS, "TRACES"):
        if name == "console":
            yield ConsoleSpanExporter(out=span_stream())  # never into the log stream unless asked
        elif _protocol(env, "TRACES") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

            yield GrpcSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            yield OTLPSpanExporter()


def _metric_exporters(env: Mapping[str, str]) -> Iterator[MetricExporter]:
    for name in _names(env, "OTEL_METRICS_EXPORTER", _METRIC_EXPORTERS, "METRICS"):
        if name == "prometheus":
            continue  # served by the HTTP endpoint (telemetry.http_listen), not pushed
        if name == "console":
            yield ConsoleMetricExporter(out=span_stream())
        elif _protocol(env, "METRICS") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcMetricExporter,
            )

            yield GrpcMetricExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            yield OTLPMetricExporter()
