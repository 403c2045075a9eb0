"""/metrics from start-up: a backlog gauge per running lane (label ``lane``), and every
counter present at 0 for the label sets known then, before anything has happened."""

from __future__ import annotations

import logging

import anyio
import httpx
import pytest
from lanes.conftest import Broker
from support import envelope, insert_events, wait_until

from room_outbox.app import run_service
from room_outbox.config import Settings
from room_outbox.delivery.lanes import migrate_plugins
from room_outbox.observability.metrics import LEASE_LOSSES, ROUTING_ERROR_CLASSES, SINK_ERROR_CLASSES
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio


async def test_metrics_from_start_up(
    store: MySQLStore,
    database_dsn: str,
    kafka_broker: Broker,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings(
        mysql={"dsn": database_dsn},
        node_id="metrics",
        outbox_worker={"poll_interval": "50ms", "enabled": False},  # nothing is delivered: all counters 0
        sinks={"tencent_im": {"enabled": False}, "kafka": {"bootstrap_servers": kafka_broker.bootstrap}},
        telemetry={"http_listen": "127.0.0.1:0", "backlog_interval": "50ms"},
    )
    await migrate_plugins(store, make_plugin_manager(), settings)
    async with store.transaction() as cur:  # the Kafka lane has run once: fed through id 0
        await cur.execute(
            "INSERT INTO room_outbox_lane_cursor (lane, fed_through_id, updated_at_ms) VALUES ('kafka', 0, 0)"
        )
    await insert_events(store, [envelope("c1", "RoomCreated"), envelope("j1", "RoomUserJoined")])
    stop = anyio.Event()
    with caplog.at_level(logging.INFO):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_service(settings, stop, False))
            await wait_until(lambda: any(getattr(r, "lifecycle", "") == "http_started" for r in caplog.records))
            port = next(r.port for r in caplog.records if getattr(r, "lifecycle", "") == "http_started")  # type: ignore[attr-defined]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:

                async def both_gauges() -> bool:
                    text = (await client.get("/metrics")).text
                    return 'room_outbox_pending{lane="kafka"}' in text and 'room_outbox_pending{lane="main"}' in text

                await wait_until(both_gauges)
                lines = (await client.get("/metrics")).text.splitlines()
            stop.set()
    assert 'room_outbox_pending{lane="main"} 2.0' in lines  # RoomCreated (noop) and RoomUserJoined: no route yet
    assert 'room_outbox_pending{lane="kafka"} 2.0' in lines  # both unfed
    assert any(line.startswith('room_outbox_oldest_pending_age_seconds{lane="kafka"} ') for line in lines)
    assert 'room_outbox_lane_skipped{lane="kafka"} 0.0' in lines  # sampled with the backlog
    assert 'room_outbox_lane_skipped{lane="main"} 0.0' in lines  # it skips none: a series all the same
    success = [line for line in lines if line.startswith("room_outbox_publish_success_total{")]
    assert 'room_outbox_publish_success_total{event_type="RoomCreated",sink="noop"} 0.0' in success
    assert 'room_outbox_publish_success_total{event_type="RoomGiftSent",sink="kafka"} 0.0' in success
    assert len(success) == 3 + 19  # noop's three types, Kafka's whole catalogue
    for error_class in SINK_ERROR_CLASSES:
        assert (
            f'room_outbox_publish_failure_total{{error_class="{error_class}",event_type="RoomCreated",sink="kafka"}} 0.0'
            in lines
        )
    for error_class in ROUTING_ERROR_CLASSES:
        assert (
            f'room_outbox_publish_failure_total{{error_class="{error_class}",event_type="RoomCreated",sink="-"}} 0.0'
            in lines
        )
    for point, cause in LEASE_LOSSES:
        assert f'room_outbox_lost_leases_total{{cause="{cause}",detected_at="{point}"}} 0.0' in lines
    assert all(line.endswith(" 0.0") for line in lines if line.startswith("room_outbox_publish_"))  # nothing happened
