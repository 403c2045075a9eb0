"""In-memory telemetry for tests: spans through the redacting exporter, metrics read back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, NumberDataPoint
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from room_outbox.observability.metrics import PrometheusExposition
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.telemetry import Telemetry
from room_outbox.observability.tracing import RedactingSpanExporter

PRODUCER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01"


@dataclass
class Captured:
    telemetry: Telemetry
    spans_exporter: InMemorySpanExporter
    reader: InMemoryMetricReader
    redactor: Redactor

    def spans(self, name_prefix: str = "") -> list[ReadableSpan]:
        return [s for s in self.spans_exporter.get_finished_spans() if s.name.startswith(name_prefix)]

    def points(self, metric: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == metric:
                        found.extend(m.data.data_points)
        return found

    def value(self, metric: str, **labels: Any) -> float:
        """Sum of a counter's (or gauge's) points whose attributes include ``labels``."""
        return sum(
            p.value
            for p in self.points(metric)
            if isinstance(p, NumberDataPoint) and all(p.attributes.get(k) == v for k, v in labels.items())
        )

    def histogram(self, metric: str, **labels: Any) -> list[HistogramDataPoint]:
        return [
            p
            for p in self.points(metric)
            if isinstance(p, HistogramDataPoint) and all(p.attributes.get(k) == v for k, v in labels.items())
        ]


def capture(redactor: Redactor | None = None) -> Captured:
    redactor = redactor or Redactor()
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(RedactingSpanExporter(exporter, redactor)))
    reader = InMemoryMetricReader()
    exposition = PrometheusExposition()
    telemetry = Telemetry(tracer_provider, MeterProvider(metric_readers=[reader, exposition.reader]), exposition)
    return Captured(telemetry, exporter, reader, redactor)
