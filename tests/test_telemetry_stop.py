"""The stop does not wait on an OpenTelemetry collector that is down, refuses or never answers:
the exporters get a bounded time to flush, then are abandoned."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import envelope, fetch_rows, free_port, insert_events, kill_if_running, wait_until

from room_outbox.observability.telemetry import EXPORT_AT_STOP
from room_outbox.store.backends.mysql import MySQLStore

#: SIGTERM → exit, at most: the exporters' time and a little more, well inside compose's
#: stop_grace_period (10 s).
STOP_WITHIN = EXPORT_AT_STOP + 3.0


@contextmanager
def silent_collector() -> Iterator[int]:
    """A loopback port that accepts connections and reads what comes, never answering."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            held.append(connection)  # never read from, never answered, never closed until the end

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for connection in held:
            connection.close()


@contextmanager
def refusing_collector() -> Iterator[int]:
    """A loopback port nothing listens on: every connection refused."""
    yield free_port()


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize(
    ("collector", "protocol"),
    [(silent_collector, "http/protobuf"), (refusing_collector, "http/protobuf"), (silent_collector, "grpc")],
    ids=["silent-http", "refused-http", "silent-grpc"],
)
async def test_sigterm_exits_promptly_whatever_the_collector_does(
    store: MySQLStore, database_dsn: str, tmp_path: Path, collector: object, protocol: str
) -> None:
    """`room-outbox run` with the OTLP environment docker-compose gives it (traces only), its
    collector unreachable and spans waiting: SIGTERM ends it within a few seconds, every step
    of the stop logged, and one WARNING says the exporters were abandoned with what they held."""
    config = tmp_path / "config.yaml"
    config.write_text(
        f"mysql:\n  dsn: '{database_dsn}'\noutbox_worker:\n  poll_interval: 100ms\n"
        "sinks:\n  tencent_im:\n    enabled: false\n"  # the noop sink takes RoomCreated
    )
    events = [envelope(f"e{n:04}", "RoomCreated", room_id=f"r_{n % 50}") for n in range(1500)]
    log = tmp_path / "run.log"
    with collector() as port:  # type: ignore[operator]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ROOM_OUTBOX", "OTEL_"))}
        env |= {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "none",
        }
        with log.open("w") as stderr:
            run = subprocess.Popen(
                [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "run"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        try:
            await wait_until(lambda: '"lifecycle": "worker_started"' in log.read_text(), timeout=60)
            await insert_events(store, events)

            async def all_published() -> bool:
                return all(row["status"] == "published" for row in (await fetch_rows(store)).values())

            await wait_until(all_published, timeout=60, interval=0.1)
            started = time.monotonic()
            run.send_signal(signal.SIGTERM)
            assert run.wait(timeout=60) == 0
            stopped_in = time.monotonic() - started
        finally:
            kill_if_running(run)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert stopped_in < STOP_WITHIN, (stopped_in, [line["msg"] for line in lines][-8:])
    lifecycle = [line["lifecycle"] for line in lines if "lifecycle" in line]
    assert lifecycle[-4:] == ["membership_left", "telemetry_abandoned", "sinks_closed", "pool_closed"], lifecycle
    (abandoned,) = [line for line in lines if line.get("lifecycle") == "telemetry_abandoned"]
    assert abandoned["level"] == "warning" and abandoned["spans_lost"] > 0
