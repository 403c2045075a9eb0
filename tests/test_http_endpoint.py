"""/healthz, /readyz, /metrics over real HTTP: the endpoint alone and inside the lifecycle."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
from observability.test_metrics_conventions import promtool_check_metrics
from support import RecordingSink, SinkPlugin, envelope, fetch_rows, insert_events, wait_until

from room_outbox.app import run_service
from room_outbox.config import ConfigError, Settings, load_settings, parse_listen
from room_outbox.observability import http_endpoint
from room_outbox.observability.http_endpoint import Health, HttpEndpoint
from room_outbox.observability.redaction import Redactor
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.version import package_version

pytestmark = pytest.mark.anyio


class Database:
    def __init__(self) -> None:
        self.error: Exception | None = None

    async def check(self) -> None:
        if self.error:
            raise self.error


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[HttpEndpoint, Database, httpx.AsyncClient]]:
    database = Database()
    redactor = Redactor()
    redactor.add("dbpassw0rd")
    server = HttpEndpoint(Health(database.check, redactor=redactor), lambda: "room_outbox_pending 3\n")
    port = await server.bind("127.0.0.1", 0)
    async with anyio.create_task_group() as tg, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        tg.start_soon(server.serve)
        tg.start_soon(server.health.watch_database, 0.05)
        yield server, database, client
        tg.cancel_scope.cancel()


async def readyz(client: httpx.AsyncClient) -> dict[str, object]:
    answer = await client.get("/readyz")
    assert answer.status_code == (200 if answer.json()["ready"] else 503)
    return dict(answer.json())


async def test_health_readiness_and_metrics(endpoint: tuple[HttpEndpoint, Database, httpx.AsyncClient]) -> None:
    server, database, client = endpoint
    assert (await client.get("/healthz")).text == "ok\n"

    starting = {"ready": False, "worker": "starting", "database": "ok", "clock": "ok"}
    await wait_until(lambda: server.health.readiness()[1]["database"] == "ok", timeout=5)
    assert await readyz(client) == starting
    server.health.worker = "running"
    assert await readyz(client) == {"ready": True, "worker": "running", "database": "ok", "clock": "ok"}
    server.health.worker = "disabled"  # outbox_worker.enabled: false serves nothing, yet is not broken
    assert (await readyz(client))["ready"] is True

    # A short fixed cause, then the error on one line, its secrets masked.
    database.error = OSError("Can't connect as room:dbpassw0rd@db\n\tIs the server running?")
    await wait_until(lambda: server.health.readiness()[1]["database"] != "ok", timeout=5)
    cause = "query failed: OSError: Can't connect as room:[REDACTED]@db Is the server running?"
    assert await readyz(client) == {"ready": False, "worker": "disabled", "database": cause, "clock": "ok"}
    database.error = None
    await wait_until(lambda: server.health.readiness()[0], timeout=5)

    metrics = await client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert metrics.text == "room_outbox_pending 3\n"
    assert (await client.head("/metrics")).content == b""
    assert metrics.headers["cache-control"] == "no-store"
    nope = await client.get("/nope")
    assert nope.status_code == 404 and "/healthz" in nope.text
    assert (await client.post("/healthz")).status_code == 405


async def test_garbage_and_silent_clients_do_not_hurt(
    endpoint: tuple[HttpEndpoint, Database, httpx.AsyncClient], caplog: pytest.LogCaptureFixture
) -> None:
    server, _, client = endpoint
    garbage = [
        b"\x16\x03\x01 not http at all\r\n\r\n",  # TLS on a plain port
        b"GET /readyz HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",  # a bad header, second of a kind
        b"GET /\x00secret-bytes HTTP/1.1\r\n\r\n",
    ]
    with caplog.at_level(logging.DEBUG):
        for request in garbage:
            async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
                await stream.send(request)
                with anyio.fail_after(5):
                    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):  # closed: fine
                        while await stream.receive():
                            pass
    # Counted, and nothing logged: a traceback would echo the client's bytes.
    assert server.malformed_requests == len(garbage)
    assert [r for r in caplog.records if r.name.startswith("aiohttp")] == []
    silent = await anyio.connect_tcp("127.0.0.1", server.port)  # holds a connection open, says nothing
    try:
        assert (await client.get("/healthz")).status_code == 200
    finally:
        await silent.aclose()


async def test_a_client_that_sends_no_request_is_disconnected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_endpoint, "READ_TIMEOUT", 0.3)
    server = HttpEndpoint(Health(Database().check), lambda: "")
    port = await server.bind("127.0.0.1", 0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        for sent in (b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"):  # nothing, or half a request
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                if sent:
                    await stream.send(sent)
                with anyio.fail_after(5), pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    await stream.receive()
        tg.cancel_scope.cancel()


def test_listen_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen(":9464") == ("127.0.0.1", 9464)  # every interface only when asked for
    assert parse_listen("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    with pytest.raises(ValueError):
        parse_listen("localhost")
    monkeypatch.setenv("ROOM_OUTBOX__TELEMETRY__HTTP_LISTEN", "nonsense")
    with pytest.raises(ConfigError, match=r"telemetry\.http_listen: 'nonsense' is not host:port"):
        load_settings()


async def test_the_service_serves_the_endpoint_for_the_life_of_the_worker(
    database_dsn: str, store: MySQLStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    await insert_events(
        store, [envelope("ok", "RoomGiftSent"), envelope("bad", "RoomUserJoined"), envelope("fact", "RoomCreated")]
    )
    sink = RecordingSink(fail={"bad"})  # a failing sink must not make the process unready
    settings = Settings(
        mysql={"dsn": database_dsn},
        node_id="http-test",
        outbox_worker={"poll_interval": "50ms"},
        sinks={"tencent_im": {"enabled": False}, "flaky": {"event_types": ["RoomGiftSent", "RoomUserJoined"]}},
        telemetry={"http_listen": "127.0.0.1:0", "backlog_interval": "50ms"},
    )
    stop = anyio.Event()
    with caplog.at_level(logging.INFO):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_service(settings, stop, False, [SinkPlugin("flaky", sink)]))
            await wait_until(lambda: _logged(caplog, "http_started"))
            port = next(r.port for r in caplog.records if getattr(r, "lifecycle", "") == "http_started")  # type: ignore[attr-defined]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

                async def ready() -> bool:
                    return (await client.get("/readyz")).status_code == 200

                await wait_until(ready)

                async def metrics_seen() -> bool:
                    text = (await client.get("/metrics")).text
                    return (
                        'room_outbox_publish_success_total{event_type="RoomGiftSent",sink="flaky"} 1.0' in text
                        and 'room_outbox_publish_success_total{event_type="RoomCreated",sink="noop"} 1.0' in text
                        and 'room_outbox_pending{lane="main"} 1.0' in text
                    )

                await wait_until(metrics_seen)
                text = (await client.get("/metrics")).text
                assert 'error_class="retryable",event_type="RoomUserJoined",sink="flaky"' in text
                # The noop sink's attempts are counted (above), not timed; the others' are.
                durations = re.findall(r"^room_outbox_publish_duration_seconds_count\{(.*)\} ", text, re.MULTILINE)
                assert durations and all('sink="flaky"' in labels for labels in durations), durations
                assert 'room_outbox_oldest_pending_age_seconds{lane="main"} ' in text
                assert "room_outbox_claimed_batch_size_count " in text
                assert (await client.get("/readyz")).json()["ready"] is True  # failures everywhere, still ready
                # Which version each process runs, on a fleet's scrape (the resource's service.version)
                assert re.search(rf'^target_info\{{.*service_version="{re.escape(package_version())}"', text, re.M)
                stop.set()
    # Every name by Prometheus's conventions, as its own linter sees them.
    assert promtool_check_metrics(text) == ""
    assert {
        "room_outbox_pending",
        "room_outbox_oldest_pending_age_seconds",
        "room_outbox_publish_duration_seconds",
        "room_outbox_clock_offset_seconds",
        "room_outbox_http_malformed_requests_total",
        "room_outbox_round_failures_total",  # at 0 for the main lane from the start
        "process_cpu_seconds_total",
    } <= set(re.findall(r"^# TYPE (\S+)", text, re.MULTILINE))
    order = [r.lifecycle for r in caplog.records if hasattr(r, "lifecycle")]  # type: ignore[attr-defined]
    assert order[:2] == ["pool_opened", "http_started"]
    assert order[-6:] == [
        "stop_requested", "worker_stopped", "membership_left", "http_stopped", "sinks_closed", "pool_closed",
    ]  # fmt: skip
    assert (await fetch_rows(store))["ok"]["status"] == "published"
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as client:
            await client.get(f"http://127.0.0.1:{port}/healthz")


async def _logged(caplog: pytest.LogCaptureFixture, lifecycle: str) -> bool:
    return any(getattr(r, "lifecycle", "") == lifecycle for r in caplog.records)
