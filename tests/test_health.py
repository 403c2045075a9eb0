"""Liveness and readiness mean something: /healthz fails when a running lane stops ending
rounds, /readyz after consecutive failed rounds; a dispatcher cut off from its database (a
half-open partition, in process) keeps ending rounds, reports them failed, recovers by
itself, and stops within publish_timeout + query_timeout."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
from faults.tcp_proxy import TcpProxy
from support import RecordingSink, envelope, insert_events, make_dispatcher, wait_until

from room_outbox.errors import SchemaError
from room_outbox.observability.health import Health, stalled_after
from room_outbox.observability.http_endpoint import HttpEndpoint
from room_outbox.observability.redaction import Redactor
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore
from room_outbox.store.backends.postgres_address import PostgresAddress
from room_outbox.store.factory import open_store
from room_outbox.store.operator.reports import ping

pytestmark = pytest.mark.anyio


@pytest.fixture
async def served() -> AsyncIterator[tuple[Health, httpx.AsyncClient]]:
    health = Health(stalled_after=5.0, unready_after_failed_rounds=3)
    server = HttpEndpoint(health, lambda: "")
    port = await server.bind("127.0.0.1", 0)
    async with anyio.create_task_group() as tg, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        tg.start_soon(server.serve)
        tg.start_soon(health.watch_database)  # its check succeeds: no database in these tests
        yield health, client
        tg.cancel_scope.cancel()


async def test_healthz_fails_when_a_running_lane_ends_no_round(served: tuple[Health, httpx.AsyncClient]) -> None:
    health, client = served
    lane = health.lane("main")
    lane.last_progress = time.monotonic() - 60  # stuck for a minute
    assert (await client.get("/healthz")).status_code == 200  # starting: no rounds expected yet
    health.worker = "running"
    stalled = await client.get("/healthz")
    assert stalled.status_code == 503
    assert stalled.json()["live"] is False and stalled.json()["lane main"].startswith("no round ended for 60s")
    lane.round_ended("QueryTimeout: ...")  # a failed round is still a round that ended
    assert (await client.get("/healthz")).status_code == 200
    lane.last_progress = time.monotonic() - 60
    health.worker = "stopping"
    assert (await client.get("/healthz")).status_code == 200


async def test_readyz_fails_after_consecutive_failed_rounds(served: tuple[Health, httpx.AsyncClient]) -> None:
    health, client = served
    health.worker = "running"
    lane = health.lane("kafka")
    for _ in range(2):
        lane.round_ended("QueryTimeout: the database did not answer")
    await wait_until(lambda: health.readiness()[0], timeout=5)  # once the watch's first ping is in
    lane.round_ended("QueryTimeout: the database did not answer")
    unready = await client.get("/readyz")
    assert unready.status_code == 503
    assert (
        unready.json()["lane kafka"] == "3 rounds failed in a row, the last: QueryTimeout: the database did not answer"
    )
    lane.round_ended()
    assert (await client.get("/readyz")).status_code == 200


async def test_a_lanes_sink_failing_round_after_round_never_makes_the_process_unready(
    served: tuple[Health, httpx.AsyncClient],
) -> None:
    """A tailing lane's broker down failed its rounds, and the process went unready (an
    orchestrator took it out of service) though its database and its other lanes were well."""
    health, client = served
    health.worker = "running"
    lane = health.lane("kafka")
    await wait_until(lambda: health.readiness()[0], timeout=5)  # once the watch's first ping is in
    for _ in range(5):
        lane.round_ended("sink kafka did not answer within publish_timeout", sink_failed=True)
    assert (await client.get("/readyz")).status_code == 200
    lane.round_ended("QueryTimeout: the database did not answer")  # the database's, after those
    assert (await client.get("/readyz")).status_code == 503


async def test_a_database_check_that_times_out_is_logged_by_its_type_without_a_dangling_colon(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A ping the database never answers ends in a TimeoutError whose text is empty: the line
    names the type alone, not ``TimeoutError: `` with nothing after the colon."""
    monkeypatch.setattr("room_outbox.observability.health.DATABASE_CHECK_TIMEOUT", 0.05)

    async def never_answers() -> None:
        await anyio.sleep(60)

    health = Health(never_answers)
    with caplog.at_level(logging.WARNING, logger="room_outbox.health"):
        await health._ping()
    assert [r.getMessage() for r in caplog.records] == ["readiness: the database check failed: TimeoutError"]
    assert health.readiness()[1]["database"] == "no answer within 0.05s"


async def test_readyz_says_why_the_database_check_fails_without_the_dsns_password(postgresql_dsn: str) -> None:
    """The database cut off (every connection reset): /readyz said ``query failed`` and no
    more; the reason was in the log only. It gives the driver's words now, on one line, with
    the DSN's password masked."""
    real = PostgresAddress.from_dsn(postgresql_dsn)
    password = "pw-of-the-dsn-1234"
    async with TcpProxy(real.host, real.port) as proxy:
        # PostgreSQL trusts loopback here: the password is sent, or not, and never checked
        store = await open_store(
            f"postgresql://{real.user}:{password}@127.0.0.1:{proxy.port}/{real.database}", query_timeout=1.0
        )
        redactor = Redactor()
        redactor.add(password)
        health = Health(functools.partial(ping, store), redactor=redactor, worker="running")
        server = HttpEndpoint(health, lambda: "")
        port = await server.bind("127.0.0.1", 0)
        try:
            async with (
                anyio.create_task_group() as tg,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
            ):
                tg.start_soon(server.serve)
                tg.start_soon(health.watch_database, 0.05)
                await wait_until(lambda: health.readiness()[0], timeout=10)
                await proxy.cut()
                await wait_until(lambda: not health.readiness()[0], timeout=10)
                answer = await client.get("/readyz")
                assert answer.status_code == 503
                cause = answer.json()["database"]
                fixed, _, why = cause.partition(": ")
                assert fixed in ("query failed", "no answer within 2s") and why, cause
                assert "\n" not in cause and len(cause) <= 320
                assert password not in answer.text
                await proxy.restore()
                await wait_until(lambda: health.readiness()[0], timeout=10)
                tg.cancel_scope.cancel()
        finally:
            await store.aclose()


def test_the_stall_limit_is_never_shorter_than_a_healthy_gap() -> None:
    assert stalled_after(30, 1.0, 5.0, 3.0) == 30.0
    assert stalled_after(30, 0.1, 5.0, 3.0) == 0.1 + 5.0 + 3.0


@pytest.mark.serial
async def test_a_dispatcher_cut_off_from_its_database_reports_recovers_and_stops_in_time(database_dsn: str) -> None:
    real = MySQLAddress.from_dsn(database_dsn)
    query_timeout, publish_timeout = 0.5, 0.5
    async with TcpProxy(real.host, real.port) as proxy:
        direct = await MySQLStore.connect(database_dsn)
        await direct.migrate()
        store = await MySQLStore.connect(
            f"mysql://{real.user}:{real.password}@127.0.0.1:{proxy.port}/{real.database}", query_timeout=query_timeout
        )
        health = Health(unready_after_failed_rounds=2)
        sink = RecordingSink()
        dispatcher = make_dispatcher(
            store, sink, poll_interval=0.05, publish_timeout=publish_timeout, query_timeout=query_timeout, lease=3.0
        )
        dispatcher.health = health.lane("main")
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(dispatcher.run)
                await insert_events(direct, [envelope("before")])
                await wait_until(lambda: sink.received == ["before"], timeout=10)

                proxy.partition()
                await wait_until(lambda: health.lanes["main"].failed_in_a_row >= 2, timeout=10)
                assert "query_timeout" in health.lanes["main"].last_error
                ready, checks = health.readiness()
                assert not ready and "rounds failed in a row" in checks["lane main"]

                proxy.heal()
                await insert_events(direct, [envelope("after")])
                await wait_until(lambda: sink.received == ["before", "after"], timeout=query_timeout + 5)
                await wait_until(lambda: health.lanes["main"].failed_in_a_row == 0, timeout=5)

                proxy.partition()
                await wait_until(lambda: health.lanes["main"].failed_in_a_row >= 1, timeout=10)
                started = anyio.current_time()
                dispatcher.stop()
            took = anyio.current_time() - started
        finally:
            await store.aclose()
            await direct.aclose()
    assert took <= publish_timeout + query_timeout + 0.3, took


async def test_the_schema_watch_says_a_missing_index_once_per_incident_and_nothing_for_a_database_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The watch's check raising :class:`SchemaError`: one ERROR line and the ``schema``
    readiness check, until it passes (one line then); failing otherwise (the database down):
    nothing more, the database check says it."""
    answers: list[Exception | None] = []

    async def check() -> None:
        answer = answers.pop(0)
        if answer is not None:
            raise answer

    missing = SchemaError("table room_outbox lacks the index idx_room_outbox_claim: run `room-outbox migrate`")
    health = Health(check_schema=check, worker="running")
    health.lane("main").round_ended()  # a query answered lately
    answers.extend([None, missing, ConnectionError("down"), missing, None])
    await health._check_schema_once(check)
    assert health.readiness() == (True, {"worker": "running", "database": "ok", "clock": "ok"})
    for _ in range(3):
        await health._check_schema_once(check)
        assert health.readiness() == (
            False,
            {"worker": "running", "database": "ok", "clock": "ok", "schema": str(missing)},
        )
    await health._check_schema_once(check)  # it passes again
    assert "schema" not in health.readiness()[1]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, f"schema check failed: {missing}"),
        (logging.WARNING, "schema check passes again: the outbox table has room-outbox's indexes"),
    ]
