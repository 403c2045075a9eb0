"""Limits are not attempts: a delivery this process's own rate limit (or its quota share) holds
back is handed back unsent, costs the event no retry, is never parked, and is delivered later.
The real Tencent IM sink against the fake IM on loopback, in-process dispatchers on MySQL, and
once with `room-outbox run` as a process."""

from __future__ import annotations

import io
import logging
import math
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from im_support import im_section
from processes import DispatcherProcess
from support import envelope, fetch_rows, insert_events, wait_until
from telemetry_support import Captured, capture

from bench.drive import run_until_empty
from room_outbox import QuotaShare
from room_outbox.cli.inspect import inspect_command
from room_outbox.cli.status import format_status, status_report
from room_outbox.config import Settings
from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
from room_outbox.delivery.routing import Router, build_lanes
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.plugins.tencent_im.fake import DEV_SDKAPPID, FakeTencentIM
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio

THROTTLED = "room_outbox.publish.throttled"
FAILED = "room_outbox.publish.failure"
PUBLISHED = "room_outbox.publish.success"
DURATION = "room_outbox.publish.duration"


async def _router(fake: FakeTencentIM, quota: QuotaShare | None = None, **im: Any) -> Router:
    settings = Settings(node_id="test", sinks={"tencent_im": im_section(fake, **im)})
    return (await build_lanes(make_plugin_manager(), settings, Redactor(), include_own=False, quota=quota)).main


def _dispatcher(store: MySQLStore, router: Router, captured: Captured, **worker: Any) -> Dispatcher:
    settings = Settings(node_id="test", outbox_worker={"poll_interval": "50ms", **worker})
    options = LaneOptions.from_settings(settings.outbox_worker)
    return Dispatcher(store, router, options, "test", telemetry=captured.telemetry)


@asynccontextmanager
async def _running(dispatcher: Dispatcher) -> AsyncIterator[None]:
    """The dispatcher's scan loop in the background, stopped whatever the test does (stop()
    bounds its end by publish_timeout + query_timeout)."""
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        try:
            yield
        finally:
            dispatcher.stop()


def _all_published(rows: dict[str, dict[str, Any]], expected: int) -> bool:
    return len(rows) == expected and all(r["status"] == "published" for r in rows.values())


@pytest.mark.serial
async def test_an_app_limit_below_the_concurrency_parks_nothing_and_delivers_everything(
    fake: FakeTencentIM, store: MySQLStore
) -> None:
    """app_rate_limit 10 with 64 deliveries at once and parking after 3 attempts: most
    deliveries find no slot in time, yet none of them counts as an attempt."""
    events = 60
    router = await _router(fake, app_rate_limit=10, reserved_share=0)
    captured = capture()
    dispatcher = _dispatcher(
        store, router, captured, concurrency=64, parking=True, retry={"max_attempts": 3}, publish_timeout="3s"
    )
    await insert_events(store, [envelope(f"e{i}", room_id=f"r_{i}") for i in range(events)])
    try:
        async with _running(dispatcher):

            async def drained() -> bool:
                return _all_published(await fetch_rows(store), events)

            await wait_until(drained, timeout=30, interval=0.1)
    finally:
        await router.aclose()
    rows = await fetch_rows(store)
    assert {r["status"] for r in rows.values()} == {"published"}  # nothing parked, nothing lost
    assert {r["retry_count"] for r in rows.values()} == {0}  # only the limit held them back
    assert all(r["last_error"] is None for r in rows.values())
    assert sorted(fake.event_ids()) == sorted(f"e{i}" for i in range(events))  # one request each
    assert fake.max_in_window(1.0) <= 10
    assert captured.value(THROTTLED, sink="tencent_im") > 0  # the limit did hold deliveries back
    assert captured.value(FAILED) == 0
    assert captured.value(PUBLISHED, sink="tencent_im") == events
    assert sum(p.count for p in captured.histogram(DURATION)) == events  # only attempts are timed


async def test_a_quota_share_of_zero_holds_back_without_an_attempt(fake: FakeTencentIM, store: MySQLStore) -> None:
    """A share of 0 (a stale heartbeat, a joining node): nothing is sent and nothing is
    counted against the events; once the share is back, they are delivered."""
    quota = QuotaShare()
    quota.apply(math.inf, math.inf)  # this process may send nothing right now
    router = await _router(fake, quota, rate_limit_max_wait="100ms")
    captured = capture()
    dispatcher = _dispatcher(store, router, captured, parking=True, retry={"max_attempts": 1})
    await insert_events(store, [envelope(f"e{i}", room_id=f"r_{i}") for i in range(5)])
    try:
        with anyio.fail_after(10):
            await run_until_empty(dispatcher)
        rows = await fetch_rows(store)
        assert {r["status"] for r in rows.values()} == {"pending"}  # not parked after 1 "attempt"
        assert {r["retry_count"] for r in rows.values()} == {0}
        assert all(r["last_error"] is None and r["worker_id"] is None for r in rows.values())
        assert fake.event_ids() == []
        assert captured.value(THROTTLED, sink="tencent_im") == 5
        assert captured.value(FAILED) == 0

        quota.apply(1, math.inf)  # the share is back
        with anyio.fail_after(10):
            await run_until_empty(dispatcher)
    finally:
        await router.aclose()
    rows = await fetch_rows(store)
    assert {r["status"] for r in rows.values()} == {"published"}
    assert {r["retry_count"] for r in rows.values()} == {0}
    assert sorted(fake.event_ids()) == [f"e{i}" for i in range(5)]


@pytest.mark.serial
async def test_tencent_rate_limit_answers_park_nothing_and_slow_the_process_down(
    fake: FakeTencentIM, store: MySQLStore
) -> None:
    """Others use most of the app's quota (room-service pushing above its reserve): Tencent
    takes 20 requests/s where this process's share says 200. Its 60011 answers are no
    attempts (nothing parked after 3 of them, no retry counted) and slow the app's limiter
    down, so few requests go over Tencent's limit: without the slow-down the process kept
    sending at its share, about seven requests over the limit per message delivered."""
    events = 150
    fake.set_faults(app_qps_limit=20)
    router = await _router(fake, reserved_share=0)
    captured = capture()
    dispatcher = _dispatcher(store, router, captured, parking=True, retry={"max_attempts": 3})
    await insert_events(store, [envelope(f"e{i}", room_id=f"r_{i % 30}", room_version=i) for i in range(events)])
    try:
        async with _running(dispatcher):

            async def drained() -> bool:
                rows = await fetch_rows(store)
                assert not [e for e, r in rows.items() if r["status"] == "failed"]  # fail at once
                return _all_published(rows, events)

            await wait_until(drained, timeout=60, interval=0.1)
    finally:
        await router.aclose()
    rows = await fetch_rows(store)
    assert {r["status"] for r in rows.values()} == {"published"}
    assert {r["retry_count"] for r in rows.values()} == {0}  # rate-limit answers only
    assert all(r["last_error"] is None for r in rows.values())
    assert sorted(fake.event_ids()) == sorted(rows)  # each delivered once
    assert fake.over_quota["app"] > 0  # Tencent's limit was met
    assert fake.over_quota["app"] < events / 2  # and the process backed off
    assert captured.value(FAILED) == 0


async def test_rows_tencent_keeps_refusing_for_its_rate_show_why_without_an_attempt(
    fake: FakeTencentIM, store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Tencent refuses every message for its rate (an OK answer with MsgDropReason
    MsgFreqCtrl): no attempt counted, nothing parked, as before; but each row says why it is
    still pending (last_error, shown by inspect and status), and the sink's log line names
    the event, its app and its group."""
    fake.set_faults(drop_rate=1.0)
    router = await _router(fake)
    captured = capture()
    dispatcher = _dispatcher(store, router, captured, parking=True, retry={"max_attempts": 1})
    await insert_events(store, [envelope(f"e{i}", room_id=f"r_{i}") for i in range(2)])
    caplog.set_level(logging.INFO, logger="room_outbox.sink.tencent_im")
    try:
        with anyio.fail_after(10):
            await run_until_empty(dispatcher)
    finally:
        await router.aclose()
    rows = await fetch_rows(store)
    assert {(r["status"], r["retry_count"]) for r in rows.values()} == {("pending", 0)}  # no attempt, not parked
    assert fake.event_ids() == [] and captured.value(THROTTLED, sink="tencent_im") == 2
    assert {event_id: row["last_error"] for event_id, row in rows.items()} == {
        f"e{i}": "throttled (not counted as an attempt): tencent_im: refused by Tencent IM for its rate limit:"
        f" MsgDropReason MsgFreqCtrl (GroupId r_{i}, app default); this process sends slower for a while"
        for i in range(2)
    }
    logged = [r for r in caplog.records if r.getMessage().startswith("Tencent IM refused for its rate limit")]
    assert {(r.event_id, r.group_id, r.app) for r in logged} == {("e0", "r_0", "default"), ("e1", "r_1", "default")}

    out = io.StringIO()
    assert await inspect_command(store, "e0", False, out, io.StringIO()) == 0
    assert rows["e0"]["last_error"] in out.getvalue()
    assert "state: waiting: held back without an attempt (a rate limit), next try in" in out.getvalue()
    status = format_status(await status_report(store))
    assert "refused by Tencent IM for its rate limit" in status


def _run_config(path: Path, dsn: str, fake: FakeTencentIM) -> Path:
    """The in-process test's limits for `room-outbox run`: app_rate_limit 10 below a
    concurrency of 64, parking after 3 attempts, rows claimable at once, /metrics on a free
    loopback port. The secret key comes from the environment."""
    config = {
        "mysql": {"dsn": dsn, "pool_size": 4},
        "outbox_worker": {
            "poll_interval": "100ms",
            "publish_timeout": "3s",
            "claim_after": "0s",
            "concurrency": 64,
            "parking": True,
            "retry": {"max_attempts": 3},
        },
        "sinks": {
            "tencent_im": {
                "base_url": fake.base_url,
                "sdkappid": DEV_SDKAPPID,
                "app_rate_limit": 10,
                "reserved_share": 0,
            }
        },
        "telemetry": {"http_listen": "127.0.0.1:0"},
        "log": {"level": "INFO"},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _counter(metrics: str, instrument: str) -> float:
    """The sum of a counter's samples over all its labels in Prometheus text."""
    name = instrument.replace(".", "_") + "_total"
    samples = (line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith((f"{name}{{", f"{name} ")))
    return sum(float(value) for _, value in samples)


def _parked_report(parked: list[str], rows: dict[str, dict[str, Any]], fake: FakeTencentIM) -> str:
    sent = set(fake.event_ids())
    unsent = [e for e in parked if e not in sent]
    first = rows[parked[0]]
    return (
        f"{len(parked)} events parked, {len(unsent)} of them never sent to the fake IM; "
        f"{parked[0]}: retry_count {first['retry_count']}, last_error {first['last_error']!r}"
    )


async def _scrape(proc: DispatcherProcess) -> str:
    (port,) = [line["port"] for line in proc.lines() if line.get("lifecycle") == "http_started"]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        response = await client.get("/metrics")
    response.raise_for_status()
    return response.text


async def _stop(proc: DispatcherProcess) -> None:
    """SIGTERM, waited for without blocking the loop: the fake IM serves on this test's loop,
    and a delivery still in flight needs it to answer."""
    proc.proc.send_signal(signal.SIGTERM)
    await wait_until(lambda: not proc.alive(), timeout=20, interval=0.1)


@pytest.mark.slow
@pytest.mark.serial
async def test_room_outbox_run_with_an_app_limit_below_the_concurrency_parks_nothing_and_delivers_everything(
    fake: FakeTencentIM, store: MySQLStore, database_dsn: str, tmp_path: Path
) -> None:
    """The same limits with `room-outbox run` as a process: no event parked without a request
    to the fake IM, every event published once, retry_count 0 on rows only ever held back,
    never more than 10 requests in any second; /metrics counts throttled deliveries and no
    failure."""
    events = 120
    await insert_events(store, [envelope(f"p{i:03}", room_id=f"r_{i}") for i in range(events)])
    proc = DispatcherProcess(_run_config(tmp_path / "config.yaml", database_dsn, fake), "limited")
    try:

        async def drained() -> bool:
            assert proc.alive(), proc.log.read_text()
            rows = await fetch_rows(store)
            parked = sorted(e for e, r in rows.items() if r["status"] == "failed")
            assert not parked, _parked_report(parked, rows, fake)  # fail at once, naming them
            return _all_published(rows, events)

        await wait_until(drained, timeout=40, interval=0.25)
        metrics = await _scrape(proc)
        await _stop(proc)
    finally:
        if proc.alive():
            proc.kill()
    assert proc.proc.returncode == 0, proc.log.read_text()
    rows = await fetch_rows(store)
    assert {r["status"] for r in rows.values()} == {"published"}  # nothing parked, nothing lost
    assert {r["retry_count"] for r in rows.values()} == {0}  # only the limit held them back
    assert all(r["last_error"] is None for r in rows.values())
    assert sorted(fake.event_ids()) == sorted(rows)  # one request each
    assert fake.max_in_window(1.0) <= 10
    assert _counter(metrics, THROTTLED) > 0  # the limit did hold deliveries back
    assert _counter(metrics, FAILED) == 0
    assert _counter(metrics, PUBLISHED) == events
