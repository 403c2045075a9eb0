"""Metric names follow the conventions: ``promtool check metrics`` (Prometheus's own linter:
base units, no ``_total`` on a gauge, counters ending in ``_total``...) finds nothing in a live
``/metrics``, nor in a consumer's instruments; OTel instrument names carry no Prometheus suffix."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support import RecordingSink, SinkPlugin, envelope, insert_events, wait_until

from room_outbox.app import run_service
from room_outbox.config import Settings
from room_outbox.observability.metrics import ConsumerMetrics, PrometheusExposition
from room_outbox.observability.telemetry import Telemetry
from room_outbox.store.backends.mysql import MySQLStore


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


@pytest.mark.anyio
async def test_a_live_metrics_endpoint_passes_promtool(
    database_dsn: str, store: MySQLStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    await insert_events(store, [envelope("ok", "RoomGiftSent"), envelope("bad", "RoomUserJoined")])
    settings = Settings(
        mysql={"dsn": database_dsn},
        node_id="conventions",
        outbox_worker={"poll_interval": "50ms"},
        sinks={"tencent_im": {"enabled": False}, "flaky": {"event_types": ["RoomGiftSent", "RoomUserJoined"]}},
        telemetry={"http_listen": "127.0.0.1:0", "backlog_interval": "50ms"},
    )
    stop = anyio.Event()
    with caplog.at_level(logging.INFO):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: run_service(settings, stop, False, [SinkPlugin("flaky", RecordingSink(fail={"bad"}))])
            )
            await wait_until(lambda: any(getattr(r, "lifecycle", "") == "http_started" for r in caplog.records))
            port = next(r.port for r in caplog.records if getattr(r, "lifecycle", "") == "http_started")  # type: ignore[attr-defined]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:

                async def every_kind_seen() -> bool:  # a success, a failure, a batch, the backlog
                    text = (await client.get("/metrics")).text
                    return all(
                        sample in text
                        for sample in (
                            'room_outbox_publish_success_total{event_type="RoomGiftSent",sink="flaky"} 1.0',
                            'error_class="retryable",event_type="RoomUserJoined",sink="flaky"} 1.0',
                            "room_outbox_publish_duration_seconds_bucket{",
                            'room_outbox_oldest_pending_age_seconds{lane="main"}',
                        )
                    )

                await wait_until(every_kind_seen, timeout=30)
                text = (await client.get("/metrics")).text
            stop.set()
    assert promtool_check_metrics(text) == ""
    names = set(re.findall(r"^# TYPE (\S+)", text, re.MULTILINE))
    assert {
        "room_outbox_pending",
        "room_outbox_oldest_pending_age_seconds",
        "room_outbox_publish_duration_seconds",
        "room_outbox_clock_offset_seconds",
        "room_outbox_http_malformed_requests_total",
        "process_cpu_seconds_total",
    } <= names


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
    telemetry.metrics.start_at_zero([("noop", "RoomCreated")])
    telemetry.backlog(2, 1500)
    text = telemetry.prometheus_text()
    assert promtool_check_metrics(text) == ""
    assert "room_outbox_consumer_handler_duration_seconds_sum" in text and "room_outbox_consumer_lag{" in text

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
