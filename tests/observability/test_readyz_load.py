"""/readyz under load: probes read state the process keeps, so a crowd of them queries no
database and is answered while the process drains a backlog."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.streams.buffered
import httpx
import pytest
import yaml
from processes import DispatcherProcess, FakeIMProcess, write_config
from support import envelope, insert_events, wait_until

from room_outbox.observability.health import Health
from room_outbox.observability.http_endpoint import HttpEndpoint
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio

CLIENTS = 100
ROWS = 3000
#: Each probe's pause between two requests (ten times a usual probe's pace): a hundred a second.
PROBE_PERIOD = 1.0


async def test_readyz_requests_make_no_database_query() -> None:
    queries = 0

    async def check_database() -> None:
        nonlocal queries
        queries += 1

    health = Health(check_database)
    health.worker = "running"
    server = HttpEndpoint(health, lambda: "")
    port = await server.bind("127.0.0.1", 0)
    answers: list[int] = []
    async with anyio.create_task_group() as tg, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        tg.start_soon(server.serve)
        tg.start_soon(health.watch_database, 1.0)
        await wait_until(lambda: queries == 1, timeout=5)
        started = time.monotonic()
        with anyio.fail_after(60):
            async with anyio.create_task_group() as probes:
                for _ in range(CLIENTS):
                    probes.start_soon(_probe_times, client, 3, answers)
        elapsed = time.monotonic() - started
        tg.cancel_scope.cancel()
    assert answers == [200] * CLIENTS * 3
    # The watch's pings, one a second at most: none for the 300 requests themselves.
    assert queries <= 2 + elapsed, (queries, elapsed)


async def _probe_times(client: httpx.AsyncClient, times: int, answers: list[int]) -> None:
    for _ in range(times):
        answers.append((await client.get("/readyz", timeout=30)).status_code)


@pytest.fixture
async def dispatcher(
    database_dsn: str, store: MySQLStore, tmp_path: Path
) -> AsyncIterator[tuple[DispatcherProcess, int]]:
    fake = FakeIMProcess(tmp_path)
    config = write_config(tmp_path / "c.yaml", database_dsn, fake, concurrency=32, batch_size=200)
    settings = yaml.safe_load(config.read_text())
    settings["telemetry"] = {"http_listen": "127.0.0.1:0"}
    # No client-side rate limit to wait on: the drain is as fast as the process can go, so
    # whatever the probes cost it shows.
    settings["sinks"]["tencent_im"].update(app_rate_limit=100_000, group_rate_limit=100_000)
    config.write_text(yaml.safe_dump(settings))
    proc = DispatcherProcess(config, "dispatcher-0")
    try:
        await wait_until(lambda: any(line.get("lifecycle") == "http_started" for line in proc.lines()), timeout=30)
        yield proc, next(int(line["port"]) for line in proc.lines() if line.get("lifecycle") == "http_started")
    finally:
        if proc.alive():
            proc.terminate()
        fake.close()


@pytest.mark.timeout(120)
async def test_a_hundred_probing_clients_are_answered_while_the_process_drains(
    dispatcher: tuple[DispatcherProcess, int], store: MySQLStore
) -> None:
    """A hundred keep-alive probes, a request a second each, are all answered 200 while the
    process drains a backlog, and the drain completes. What the probes cost in CPU is a speed
    figure, measured by the bench, not asserted here."""
    process, port = dispatcher
    probes_answered = 0

    async def probe(stop: anyio.Event) -> None:
        """A probe on its own keep-alive connection, one request every ``PROBE_PERIOD``; raw
        bytes, so the clients' own CPU (they share the machine) stays small."""
        nonlocal probes_answered
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            buffered = anyio.streams.buffered.BufferedByteReceiveStream(stream)
            while not stop.is_set():
                with anyio.fail_after(10):
                    await stream.send(b"GET /readyz HTTP/1.1\r\nHost: probe\r\n\r\n")
                    head = await buffered.receive_until(b"\r\n\r\n", 4096)
                    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    await buffered.receive_exactly(length)
                assert head.startswith(b"HTTP/1.1 200"), head
                probes_answered += 1
                await anyio.sleep(PROBE_PERIOD)  # the probe's pace, not a synchronisation

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        await wait_until(lambda: _ready(client), timeout=30)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        try:
            for _ in range(CLIENTS):
                tg.start_soon(probe, stop)
            await _drain(store, "probed")
            # Every probe has had its first answer, and the slowest a second one.
            await wait_until(lambda: probes_answered >= 2 * CLIENTS, timeout=30)
        finally:
            stop.set()
    assert process.alive()
    assert probes_answered >= 2 * CLIENTS


async def _ready(client: httpx.AsyncClient) -> bool:
    return (await client.get("/readyz", timeout=5)).status_code == 200


async def _drain(store: MySQLStore, prefix: str) -> float:
    """Seconds from inserting ``ROWS`` events until none is pending."""
    events = [envelope(f"{prefix}-{n:05}", room_id=f"r_{n % 50}") for n in range(ROWS)]
    started = time.monotonic()
    await insert_events(store, events)
    await wait_until(lambda: _pending(store, prefix), timeout=60, interval=0.05)
    return time.monotonic() - started


async def _pending(store: MySQLStore, prefix: str) -> bool:
    async with store.transaction() as cur:
        await cur.execute(
            "SELECT COUNT(*) FROM room_outbox WHERE status = 'pending' AND event_id LIKE %s", (f"{prefix}-%",)
        )
        (count,) = await cur.fetchone()
    return int(count) == 0
