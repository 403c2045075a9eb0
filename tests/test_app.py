"""Lifecycle: start and stop order, clean stops, the CLI as a real process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import V1_DDL, RecordingSink, SinkPlugin, envelope, fetch_rows, insert_events, wait_until

from room_outbox.app import run_service
from room_outbox.config import Settings
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio


def app_settings(dsn: str, **worker: Any) -> Settings:
    return Settings(
        mysql={"dsn": dsn},
        node_id="app-test",
        outbox_worker={"poll_interval": "50ms", **worker},
        sinks={"tencent_im": {"enabled": False}, "slow": {"event_types": ["RoomUserJoined"]}},
    )


async def test_start_and_stop_order(database_dsn: str, store: MySQLStore, caplog: pytest.LogCaptureFixture) -> None:
    await insert_events(store, [envelope(f"e{i}") for i in range(3)])
    sink = RecordingSink(delay=0.3)
    stop = anyio.Event()
    with caplog.at_level(logging.INFO):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_service(app_settings(database_dsn), stop, False, [SinkPlugin("slow", sink)]))
            await wait_until(lambda: len(sink.received) == 3)  # all three in flight
            stop.set()
    order = [r.lifecycle for r in caplog.records if hasattr(r, "lifecycle")]  # type: ignore[attr-defined]
    assert order == [
        "pool_opened", "sinks_loaded", "membership_joined", "worker_started", "stop_requested", "worker_stopped",
        "membership_left", "sinks_closed", "pool_closed",
    ]  # fmt: skip
    assert sink.closed
    rows = await fetch_rows(store)  # in-flight deliveries finished and were recorded before the pool closed
    assert {(r["status"], r["worker_id"]) for r in rows.values()} == {("published", None)}


async def test_disabled_worker_starts_nothing(
    database_dsn: str, store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    await insert_events(store, [envelope("e1")])
    sink = RecordingSink()
    stop = anyio.Event()
    with caplog.at_level(logging.INFO):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: run_service(app_settings(database_dsn, enabled=False), stop, False, [SinkPlugin("slow", sink)])
            )
            await wait_until(lambda: any(getattr(r, "lifecycle", "") == "worker_disabled" for r in caplog.records))
            stop.set()
    assert sink.received == []
    assert not any(getattr(r, "lifecycle", "") == "worker_started" for r in caplog.records)
    assert (await fetch_rows(store))["e1"]["status"] == "pending"


def _cli(*args: str, env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "room_outbox.cli", *args],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **kwargs,
    )


@pytest.mark.slow
async def test_migrate_then_run_publishes_v1_rows_and_stops_on_sigterm(database_dsn: str, tmp_path: Path) -> None:
    """`room-outbox migrate` on room-service's V1 table, rows inserted by plain SQL, `room-outbox
    run` as a real process, SIGTERM: rows published, clean exit, no lease left, JSON logs."""
    store = await MySQLStore.connect(database_dsn)
    try:
        async with store.transaction() as cur:
            await cur.execute(V1_DDL)
        await insert_events(store, [envelope("created", "RoomCreated"), envelope("heat", "RoomHeatChanged")])
        await insert_events(store, [envelope("joined", "RoomUserJoined")])  # no enabled sink takes it here
        config = tmp_path / "config.yaml"
        config.write_text(
            f"mysql:\n  dsn: '{database_dsn}'\noutbox_worker:\n  poll_interval: 100ms\n"
            "sinks:\n  tencent_im:\n    enabled: false\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
        migrate = _cli("--config", str(config), "migrate", env=env)
        out, err = migrate.communicate(timeout=60)
        assert migrate.returncode == 0, err
        assert "added column room_outbox.lock_until_ms" in out

        run = _cli("--config", str(config), "run", env=env)
        try:

            async def noop_rows_published() -> bool:
                rows = await fetch_rows(store)
                return rows["created"]["status"] == rows["heat"]["status"] == "published"

            async def join_attempted() -> bool:
                return int((await fetch_rows(store))["joined"]["retry_count"]) >= 1

            await wait_until(noop_rows_published, timeout=30.0)
            await wait_until(join_attempted, timeout=30.0)
            run.send_signal(signal.SIGTERM)
            _, err = run.communicate(timeout=30)
        finally:
            if run.poll() is None:
                run.kill()
        assert run.returncode == 0, err
        lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
        assert [line["lifecycle"] for line in lines if "lifecycle" in line][-5:] == [
            "stop_requested", "worker_stopped", "membership_left", "sinks_closed", "pool_closed",
        ]  # fmt: skip
        failure = next(line for line in lines if line["msg"] == "delivery failed; event parked")
        assert {k: failure[k] for k in ("worker", "event_id", "event_type", "room_id", "status", "error")} == {
            "worker": "room_outbox", "event_id": "joined", "event_type": "RoomUserJoined", "room_id": "r_1",
            "status": "failed", "error": "no sink for event_type RoomUserJoined",
        }  # fmt: skip
        assert failure["node_id"] and failure["retry_count"] >= 1
        rows = await fetch_rows(store)
        assert (  # no route: parked (kept for a requeue once routed), not retried for ever
            rows["joined"]["status"] == "failed"
            and rows["joined"]["last_error"] == "no sink for event_type RoomUserJoined"
        )
        assert all(r["worker_id"] is None for r in rows.values())
    finally:
        await store.aclose()


def test_bad_configuration_exits_2_with_one_message(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("outbox_worker:\n  retry_strategy: sometimes\n")
    proc = _cli("--config", str(config), "run", env=dict(os.environ))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "outbox_worker.retry_strategy: unknown retry strategy 'sometimes'" in err
    assert "Traceback" not in err
