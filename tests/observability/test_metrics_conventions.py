"""Metric names follow the conventions: ``promtool check metrics`` (Prometheus's own linter:
base units, no ``_total`` on a gauge, counters ending in ``_total``...) finds nothing in a
consumer's instruments (and in a live ``/metrics``: tests/test_http_endpoint.py); OTel instrument
names carry no Prometheus suffix."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from room_outbox.observability.metrics import ConsumerMetrics, PrometheusExposition
from room_outbox.observability.telemetry import Telemetry


def promtool_check_metrics(text: str) -> str:
    """promtool's findings on ``text`` (empty: clean)."""
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail(
            "promtool is not installed: install the Debian package prometheus (scripts/test.sh does so as root)",
            pytrace=False,
        )
    checked = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    findings = (checked.stdout + checked.stderr).strip()
    assert (checked.returncode == 0) == (not findings), findings
    return findings


def test_promtool_flags_the_old_names() -> None:
    """The check is live: the names this project used to export are what it reports."""
    old = (
        "# HELP room_outbox_pending_total Rows pending.\n# TYPE room_outbox_pending_total gauge\n"
        'room_outbox_pending_total{lane="main"} 3\n'
        "# HELP room_outbox_publish_latency_ms One attempt.\n# TYPE room_outbox_publish_latency_ms histogram\n"
        'room_outbox_publish_latency_ms_bucket{le="+Inf"} 1\nroom_outbox_publish_latency_ms_sum 4\n'
        "room_outbox_publish_latency_ms_count 1\n"
    )
    findings = promtool_check_metrics(old)
    assert "room_outbox_pending_total" in findings and "room_outbox_publish_latency_ms" in findings


def test_a_consumers_instruments_pass_promtool_and_every_instrument_is_named_per_otel() -> None:
    exposition = PrometheusExposition()
    readback = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[exposition.reader, readback])
    telemetry = Telemetry(None, provider, exposition)
    consumer = ConsumerMetrics(telemetry.meter, "gifts", ["stats"])
    labels = {"consumer": "gifts", "handler": "stats"}
    consumer.duration.record(0.012, labels)
    consumer.handled.add(1, {**labels, "outcome": "handled"})
    consumer.lag.set(4, {"consumer": "gifts", "topic": "room-events", "partition": 0})
    consumer.retrying.set(2, {"consumer": "gifts"})
    telemetry.metrics.start_at_zero([("noop", "RoomCreated")])
    telemetry.backlog(2, 1500)
    text = telemetry.prometheus_text()
    assert promtool_check_metrics(text) == ""
    assert "room_outbox_consumer_handler_duration_seconds_sum" in text and "room_outbox_consumer_lag{" in text
    # Before anything happened: every dead-letter reason's counter at 0 (an alert on their
    # increase sees the first dead letter only from a series that was there before it), and
    # no partition held.
    for reason in ("permanent", "failed"):
        assert f'room_outbox_consumer_dead_total{{consumer="gifts",handler="stats",reason="{reason}"}} 0.0' in text
    assert 'room_outbox_consumer_dead_total{consumer="gifts",handler="(none)",reason="rejected"} 0.0' in text
    assert 'room_outbox_consumer_assigned_partitions{consumer="gifts"} 0.0' in text
    assert 'room_outbox_consumer_retrying{consumer="gifts"} 2.0' in text

    # The OTel side: dotted names, the unit in its field, no Prometheus suffix in the name.
    data = readback.get_metrics_data()
    assert data is not None
    units = {m.name: m.unit for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert units["room_outbox.consumer.handler.duration"] == "s"
    assert units["room_outbox.oldest_pending.age"] == "s"
    assert all("." in name and not name.endswith(("_total", "_ms", "_seconds")) for name in units), units
    provider.shutdown()


def test_renders_at_once_from_several_threads_each_show_every_family_once() -> None:
    """Two scrapers at the same moment (the endpoint renders off the event loop, in threads)."""
    exposition = PrometheusExposition()
    provider = MeterProvider(metric_readers=[exposition.reader])
    telemetry = Telemetry(None, provider, exposition)
    telemetry.metrics.start_at_zero([("noop", "RoomCreated")])
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda _: telemetry.prometheus_text(), range(40)))
    for text in texts:
        assert text.count("# TYPE room_outbox_publish_success_total counter") == 1, text
    provider.shutdown()
