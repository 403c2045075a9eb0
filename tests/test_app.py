"""Lifecycle: start and stop order, clean stops, the CLI as a real process."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import (
    V1_DDL,
    RecordingSink,
    SinkPlugin,
    envelope,
    fetch_rows,
    insert_events,
    install_plugin,
    kill_if_running,
    wait_until,
)

from room_outbox.app import run_service
from room_outbox.config import Settings
from room_outbox.envelope import KNOWN_EVENT_TYPES
from room_outbox.plugins.noop import DEFAULT_EVENT_TYPES as NOOP_EVENT_TYPES
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore
from room_outbox.store.clock import now_ms
from room_outbox.store.schema.buckets import NODE_TABLE

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
    # unrouted: the sinks take RoomUserJoined and the noop sink's three types alone
    assert order == [
        "pool_opened", "sinks_loaded", "unrouted_event_types", "membership_joined", "worker_started",
        "stop_requested", "worker_stopped", "membership_left", "sinks_closed", "pool_closed",
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
            kill_if_running(run)
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


def _run_logged(
    config: Path, log: Path, env: dict[str, str], *python: str, command: str = "run"
) -> subprocess.Popen[bytes]:
    """`room-outbox run` (or ``command``) as a process, its stderr (JSON log lines) in ``log``;
    ``python``: interpreter options."""
    with log.open("w") as stderr:
        return subprocess.Popen(
            [sys.executable, *python, "-m", "room_outbox.cli", "--config", str(config), command],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


def _lifecycle(log: Path) -> list[str]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [line["lifecycle"] for line in lines if "lifecycle" in line]


async def _sigterm_once(
    run: subprocess.Popen[bytes], log: Path, logged: str, signum: signal.Signals = signal.SIGTERM
) -> None:
    """SIGTERM (or ``signum``) once ``logged`` is in the process's log; it must exit 0 (killed
    otherwise)."""
    try:
        await wait_until(lambda: logged in log.read_text(), timeout=60.0)
        run.send_signal(signum)
        assert run.wait(timeout=30) == 0, _lifecycle(log)
    finally:
        kill_if_running(run)


def _migrated_config(tmp_path: Path, database_dsn: str, env: dict[str, str], extra: str = "") -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(f"mysql:\n  dsn: '{database_dsn}'\n{extra}sinks:\n  tencent_im:\n    enabled: false\n")
    migrate = _cli("--config", str(config), "migrate", env=env)
    _, err = migrate.communicate(timeout=60)
    assert migrate.returncode == 0, err
    return config


async def test_a_main_lane_that_takes_only_some_event_types_says_so_at_start(database_dsn: str, tmp_path: Path) -> None:
    """The Tencent IM sink disabled and the noop sink left on (its three types): every other
    event would be parked in room_outbox. The start says which types, and the way out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    log = tmp_path / "run.log"
    run = _run_logged(_migrated_config(tmp_path, database_dsn, env), log, env)
    await _sigterm_once(run, log, '"lifecycle": "worker_started"')
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    (warning,) = [line for line in lines if line.get("lifecycle") == "unrouted_event_types"]
    assert warning["event_types"] == sorted(KNOWN_EVENT_TYPES - set(NOOP_EVENT_TYPES))
    assert warning["sinks"] == ["noop"]
    assert "sinks.noop.enabled: false" in warning["msg"]


async def test_the_warning_on_unrouted_event_types_names_the_profiles_table(
    postgresql_dsn: str, tmp_path: Path
) -> None:
    """On silk's table the rows would be parked in outbox_events, whose status is then not
    this process's to write: the warning names that table, not room_outbox."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    config = tmp_path / "config.yaml"
    config.write_text(
        f"database:\n  dsn: '{postgresql_dsn}'\n  profile: silk\nsinks:\n  tencent_im:\n    enabled: false\n"
    )
    migrate = _cli("--config", str(config), "migrate", env=env)
    _, err = migrate.communicate(timeout=60)
    assert migrate.returncode == 0, err
    log = tmp_path / "run.log"
    run = _run_logged(config, log, env)
    await _sigterm_once(run, log, '"lifecycle": "worker_started"')
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    (warning,) = [line for line in lines if line.get("lifecycle") == "unrouted_event_types"]
    assert "parked in outbox_events (status failed," in warning["msg"]
    assert "where outbox_events.status is not this process's" in warning["msg"]
    assert "room_outbox" not in warning["msg"]


async def test_lane_settings_a_tailing_lane_ignores_are_named_once_at_start(database_dsn: str, tmp_path: Path) -> None:
    """Retries, parking and ordering of a lane that tails room_outbox do nothing: the start says
    which keys, once, and runs all the same (a configuration that started before still starts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    env.update(ROOM_OUTBOX__SINKS__KAFKA__ENABLED="true", ROOM_OUTBOX__SINKS__KAFKA__BOOTSTRAP_SERVERS="127.0.0.1:1")
    lanes = "outbox_worker:\n  lanes: {kafka: {parking: true, retry: {max_attempts: 20}, batch_size: 50}}\n"
    log = tmp_path / "run.log"
    run = _run_logged(_migrated_config(tmp_path, database_dsn, env, lanes), log, env)
    await _sigterm_once(run, log, '"lane": "kafka"')  # the tailing relay's worker_started
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    (warning,) = [line for line in lines if line.get("lifecycle") == "config_warning"]
    assert warning["level"] == "warning"
    assert warning["msg"].startswith(
        "outbox_worker.lanes.kafka.retry.max_attempts, outbox_worker.lanes.kafka.parking: ignored while the kafka"
        " lane tails room_outbox (sinks.kafka.relay: tail)"
    )
    assert warning["msg"].endswith("they take effect only with relay: lane_table")


async def test_otel_sdk_disabled_is_named_at_start_and_by_check_config(database_dsn: str, tmp_path: Path) -> None:
    """OTEL_SDK_DISABLED=true empties /metrics too (it still answers, so Prometheus sees the
    process up and no series, and no alert can fire): the start and check-config say so, and
    what to set to turn off only the OTLP export."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROOM_OUTBOX", "OTEL_"))}
    config = _migrated_config(tmp_path, database_dsn, env)
    env["OTEL_SDK_DISABLED"] = "true"
    checked = _cli("--config", str(config), "check-config", env=env)
    out, err = checked.communicate(timeout=60)
    assert checked.returncode == 0, err
    assert "warning: OTEL_SDK_DISABLED=true: no traces and no metrics, none on /metrics either" in out
    log = tmp_path / "run.log"
    run = _run_logged(config, log, env)
    await _sigterm_once(run, log, '"lifecycle": "worker_started"')
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    (warning,) = [line for line in lines if line.get("lifecycle") == "config_warning"]
    assert warning["level"] == "warning" and warning["msg"].startswith("OTEL_SDK_DISABLED=true: ")
    assert "no alert on room-outbox's metrics can fire" in warning["msg"]
    assert "OTEL_TRACES_EXPORTER=none and OTEL_METRICS_EXPORTER=none" in warning["msg"]


async def test_a_process_loads_only_what_it_runs(database_dsn: str, tmp_path: Path) -> None:
    """`room-outbox run` on MySQL/MariaDB without the Kafka lane (a start pays for every module
    it imports) imports no PostgreSQL driver, no Kafka client and no other command's module:
    its imports, as `python -X importtime` lists them, from the start to the stop once its
    worker ran."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    log = tmp_path / "run.log"
    run = _run_logged(_migrated_config(tmp_path, database_dsn, env), log, env, "-X", "importtime")
    await _sigterm_once(run, log, '"lifecycle": "worker_started"')
    lines = log.read_text().splitlines()
    imported = [line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")]
    assert "room_outbox.store.backends.mysql" in imported  # the listing is complete enough to tell
    assert [name for name in imported if name.split(".")[0] in ("psycopg", "psycopg_pool", "aiokafka")] == []
    commands = [name for name in imported if name.startswith("room_outbox.cli.")]
    assert set(commands) <= {"room_outbox.cli.__main__", "room_outbox.cli.main", "room_outbox.cli.command",
                             "room_outbox.cli.registry", "room_outbox.cli.run"}, commands  # fmt: skip


async def test_sighup_stops_run_cleanly_as_sigterm_does(database_dsn: str, tmp_path: Path) -> None:
    """SIGHUP comes when the terminal or SSH session `room-outbox run` was started from goes
    away. Its default action ended the process at once, its leases held until they expired; it
    now stops as on SIGTERM, every step of the stop logged."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    log = tmp_path / "run.log"
    run = _run_logged(_migrated_config(tmp_path, database_dsn, env), log, env)
    await _sigterm_once(run, log, '"lifecycle": "worker_started"', signal.SIGHUP)
    assert _lifecycle(log)[-5:] == [
        "stop_requested",
        "worker_stopped",
        "membership_left",
        "sinks_closed",
        "pool_closed",
    ]
    assert '"signal": "SIGHUP"' in log.read_text()


async def test_sigterm_while_joining_the_membership_leaves_it_and_starts_no_worker(
    database_dsn: str, store: MySQLStore, tmp_path: Path
) -> None:
    """A SIGTERM that comes while the process waits to join (here: behind a member that never
    agrees on the membership) ends the wait: no worker starts, the process leaves the
    membership (its buckets free at once, not a node_timeout later), closes the pool and
    exits 0, not killed by the signal's default action."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    # Left alone, the wait would last 2 x node_timeout: a minute, longer than the test waits.
    config = _migrated_config(tmp_path, database_dsn, env, "cluster:\n  node_timeout: 30s\n")
    async with store.transaction() as cur:  # live for a minute and a half, its view never this process's
        await cur.execute(
            f"INSERT INTO {NODE_TABLE} (node_id, heartbeat_ms, joined_ms, view, view_since_ms)"
            " VALUES ('other~00000000', %s, %s, 'elsewhere', %s)",
            (now_ms() + 60_000, now_ms(), now_ms()),
        )
    log = tmp_path / "run.log"
    run = _run_logged(config, log, env)
    await _sigterm_once(run, log, '"buckets reassigned"')
    lifecycle = _lifecycle(log)
    assert "worker_started" not in lifecycle and "membership_joined" not in lifecycle, lifecycle
    assert lifecycle[-4:] == ["stop_requested", "membership_left", "sinks_closed", "pool_closed"], lifecycle
    async with store.transaction() as cur:
        await cur.execute(f"SELECT node_id FROM {NODE_TABLE}")
        assert [row[0] for row in await cur.fetchall()] == ["other~00000000"]  # its own row gone: it left


@pytest.mark.parametrize("command", ["run", "consume"])
async def test_sigterm_while_waiting_for_the_database_ends_the_wait(
    command: str, database_dsn: str, tmp_path: Path
) -> None:
    """`run` and `consume` wait for a database that does not answer (up to
    database.connect_wait); a SIGTERM meanwhile ends the wait at once and the process exits 0,
    not killed by the signal's default action."""
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    address = MySQLAddress.from_dsn(database_dsn)
    unreachable = f"mysql://{address.user}:{address.password}@127.0.0.1:{port}/{address.database}"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"mysql:\n  dsn: '{unreachable}'\n  connect_wait: 120s\nsinks:\n  tencent_im:\n    enabled: false\n"
        f"consumers:\n  feed:\n    bootstrap_servers: '127.0.0.1:{port}'\n    handlers: [activity]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    log = tmp_path / "run.log"
    run = _run_logged(config, log, env, command=command)
    await _sigterm_once(run, log, '"lifecycle": "waiting_for_database"')
    assert _lifecycle(log)[-1] == "stop_requested"


STUCK_SINK = '''
import asyncio
import threading
from pathlib import Path

from room_outbox import SinkSettings, SinkSpec, hookimpl

NEVER = threading.Event()


class StuckSettings(SinkSettings):
    started_file: str


class StuckSink:
    """A synchronous client's call, in a worker thread, that never returns."""

    def __init__(self, settings, context):
        self.settings = settings

    async def deliver(self, envelope):
        Path(self.settings.started_file).write_text(envelope.event_id)
        await asyncio.to_thread(NEVER.wait)

    async def aclose(self):
        pass


@hookimpl
def room_outbox_register_sinks():
    return [SinkSpec("stuck", StuckSink, settings_model=StuckSettings)]
'''


@pytest.mark.slow
async def test_a_sinks_thread_that_never_returns_does_not_hold_the_stop(
    database_dsn: str, store: MySQLStore, tmp_path: Path
) -> None:
    """A sink's blocking call in a worker thread never returns: publish_timeout cuts the
    delivery, and once SIGTERM has stopped the service the process exits 0 without the thread
    (the interpreter would wait for it at exit for ever), saying so."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    env.update(install_plugin(tmp_path / "site", "stuck_sink", STUCK_SINK))
    started = tmp_path / "started"
    sink = f"  stuck:\n    event_types: [RoomUserJoined]\n    started_file: '{started}'\n"
    extra = "outbox_worker:\n  publish_timeout: 1s\n  poll_interval: 100ms\n  claim_after: 0s\n"
    config = _migrated_config(tmp_path, database_dsn, env, extra)
    config.write_text(config.read_text() + sink)
    await insert_events(store, [envelope("e1")])
    log = tmp_path / "run.log"
    run = _run_logged(config, log, env)
    try:
        await wait_until(started.exists, timeout=60.0)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=20) == 0, log.read_text()[-2000:]
    finally:
        kill_if_running(run)
    lifecycle = _lifecycle(log)
    assert lifecycle.index("pool_closed") < lifecycle.index("exit_forced"), lifecycle
