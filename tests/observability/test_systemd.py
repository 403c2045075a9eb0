"""room-outbox under systemd: the notifications of a ``Type=notify`` unit (READY=1 once the
worker runs, the watchdog pinged while the process is live, STOPPING=1), received on a real
Unix socket as systemd would, and the shipped unit file as systemd reads it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from support import kill_if_running, wait_until

from room_outbox.observability.health import Health
from room_outbox.observability.systemd import Notifier, notify_systemd, watchdog_interval
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio

UNIT = Path(__file__).parents[2] / "config" / "room-outbox.service"


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket as systemd's NOTIFY_SOCKET, and its path."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    try:
        yield sock, path
    finally:
        sock.close()


def receive_until(sock: socket.socket, wanted: str, timeout: float = 60.0) -> list[str]:
    """The messages received up to the first holding the line ``wanted`` (it included)."""
    received: list[str] = []
    deadline = time.monotonic() + timeout
    while not received or wanted not in received[-1].splitlines():
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {wanted} within {timeout}s; received {received}")
        sock.settimeout(left)
        received.append(sock.recv(4096).decode())
    return received


def drained(sock: socket.socket) -> list[str]:
    """The messages waiting on ``sock``, without waiting for more."""
    sock.setblocking(False)
    messages = []
    try:
        while True:
            messages.append(sock.recv(4096).decode())
    except BlockingIOError:
        return messages
    finally:
        sock.setblocking(True)


async def test_run_says_ready_once_its_worker_runs_pings_the_watchdog_and_says_stopping(
    store: MySQLStore, database_dsn: str, tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    config = tmp_path / "config.yaml"
    config.write_text(f"mysql:\n  dsn: '{database_dsn}'\nsinks:\n  tencent_im:\n    enabled: false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROOM_OUTBOX", "WATCHDOG", "NOTIFY"))}
    env |= {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}  # WatchdogSec=0.4s: a ping every 0.2s
    log = tmp_path / "run.log"
    with log.open("w") as stderr:
        run = subprocess.Popen(
            [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "run"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        started = await anyio.to_thread.run_sync(receive_until, sock, "READY=1")
        assert '"lifecycle": "worker_started"' in log.read_text()  # ready means delivering
        assert f"MAINPID={run.pid}" in started[-1].splitlines()
        pings = await anyio.to_thread.run_sync(receive_until, sock, "WATCHDOG=1", 10.0)
        pings += await anyio.to_thread.run_sync(receive_until, sock, "WATCHDOG=1", 10.0)
        assert [m for m in pings if m != "WATCHDOG=1"] == []
        run.send_signal(signal.SIGTERM)
        stopping = await anyio.to_thread.run_sync(receive_until, sock, "STOPPING=1", 30.0)
        assert [m for m in stopping[:-1] if m != "WATCHDOG=1"] == []
        assert await anyio.to_thread.run_sync(lambda: run.wait(timeout=30)) == 0
    finally:
        kill_if_running(run)


class CountedHealth(Health):
    """A Health whose liveness checks are counted."""

    asked = 0

    def liveness(self) -> tuple[bool, dict[str, str]]:
        self.asked += 1
        return super().liveness()


async def test_a_process_whose_lane_stalled_stops_pinging_the_watchdog(
    notify_socket: tuple[socket.socket, str],
) -> None:
    """Not live (a lane made no progress for longer than allowed): no ping, so that systemd
    restarts the process; pings come again once the lane moves."""
    sock, path = notify_socket
    health = CountedHealth(worker="running", stalled_after=1.0)
    health.lane("main").last_progress = time.monotonic() - 60  # stalled
    environ = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"}  # a ping due every 10 ms
    async with anyio.create_task_group() as group:
        group.start_soon(notify_systemd, health, environ)
        await anyio.to_thread.run_sync(receive_until, sock, "READY=1", 10.0)
        await wait_until(lambda: health.asked >= 5, timeout=10)  # five pings were due meanwhile
        assert [m for m in drained(sock) if "WATCHDOG=1" in m] == []
        health.lane("main").progressed()
        await anyio.to_thread.run_sync(receive_until, sock, "WATCHDOG=1", 10.0)
        group.cancel_scope.cancel()
    assert drained(sock)[-1:] == ["STOPPING=1\nSTATUS=stopping"]


async def test_nothing_is_sent_outside_systemd() -> None:
    with anyio.fail_after(5):
        await notify_systemd(Health(worker="running"), {})  # returns at once: no socket named


def test_an_abstract_socket_address_is_reached() -> None:
    name = f"room-outbox-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        Notifier("@" + name).send("READY=1")
        sock.settimeout(5)
        assert sock.recv(100) == b"READY=1"


def test_the_watchdog_interval_is_half_the_units_and_only_for_this_process() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}) is None  # another process
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({}) is None


def test_the_shipped_unit_file_is_one_systemd_reads_without_a_warning(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: install Debian's systemd package (scripts/test.sh does)"
    unit = tmp_path / "room-outbox.service"
    # the paths of this checkout: verify checks that the command exists
    command = str(Path(sys.executable).parent / "room-outbox")
    unit.write_text(UNIT.read_text().replace("/opt/room-outbox/.venv/bin/room-outbox", command))
    verified = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert (verified.returncode, verified.stderr) == (0, "")
    assert "Type=notify" in UNIT.read_text() and "WatchdogSec=" in UNIT.read_text()
