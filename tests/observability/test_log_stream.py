"""A log stream that stops taking lines (a collector that stopped reading, Docker's log driver
in its blocking mode with its backend down, a terminal paused with Ctrl-S) never stops
delivery: the process writes its log from a thread of its own, drops what does not fit while
the stream is blocked, and says how many lines it lost once the stream takes lines again."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest
from support import envelope, fetch_rows, insert_events, kill_if_running, wait_until, wait_until_sync

from room_outbox.observability.logs import BackgroundHandler, JsonFormatter
from room_outbox.observability.redaction import Redactor
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio


def full_pipe() -> tuple[int, int, int]:
    """A pipe of the smallest size, filled up: the next write to it blocks. Its read end, its
    write end, and the bytes it holds."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(write_end, False)
    held = 0
    try:
        while True:
            held += os.write(write_end, b"x" * 512)
    except BlockingIOError:
        pass
    os.set_blocking(write_end, True)
    return read_end, write_end, held


class Drain(threading.Thread):
    """Reads a pipe to its end, as a log collector that came back does."""

    def __init__(self, read_end: int) -> None:
        super().__init__(daemon=True)
        self.read_end = read_end
        self.data = b""

    def run(self) -> None:
        while chunk := os.read(self.read_end, 65536):
            self.data += chunk
        os.close(self.read_end)


async def test_run_delivers_while_its_log_stream_is_blocked(
    store: MySQLStore, database_dsn: str, tmp_path: Path
) -> None:
    read_end, write_end, held = full_pipe()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"mysql:\n  dsn: '{database_dsn}'\noutbox_worker:\n  poll_interval: 100ms\n"
        "sinks:\n  tencent_im:\n    enabled: false\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    run = subprocess.Popen(
        [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "run"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=write_end,
    )
    os.close(write_end)
    drain = Drain(read_end)
    try:
        await insert_events(store, [envelope(f"e{i}", "RoomCreated") for i in range(20)])

        async def all_published() -> bool:
            return {r["status"] for r in (await fetch_rows(store)).values()} == {"published"}

        await wait_until(all_published, timeout=60)  # every log line so far is waiting
        drain.start()  # the collector is back
        run.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: run.wait(timeout=30)) == 0
    finally:
        kill_if_running(run)
    await anyio.to_thread.run_sync(lambda: drain.join(timeout=30))
    lines = [json.loads(line) for line in drain.data[held:].decode().splitlines()]
    lifecycle = [line["lifecycle"] for line in lines if "lifecycle" in line]
    assert lifecycle[0] == "pool_opened" and "worker_started" in lifecycle, lifecycle
    assert lifecycle[-1] == "pool_closed", lifecycle  # nothing lost, the last line included


def test_lines_that_find_the_queue_full_are_dropped_counted_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BackgroundHandler, "capacity", 10)
    read_end, write_end, held = full_pipe()
    stream = os.fdopen(write_end, "w")
    handler = BackgroundHandler(stream, JsonFormatter("node-1", Redactor()))
    log = logging.getLogger("test.log_stream")
    log.propagate = False
    log.addHandler(handler)
    try:
        done = threading.Event()

        def emit_many() -> None:
            for n in range(100):
                log.warning("line %d", n)
            done.set()

        threading.Thread(target=emit_many, daemon=True).start()
        wait_until_sync(done.is_set, timeout=10)  # never waits for the stream
        drain = Drain(read_end)
        drain.start()
        handler.flush(timeout=10)
        wait_until_sync(lambda: b"log lines dropped" in drain.data, timeout=10)
    finally:
        log.removeHandler(handler)
        log.propagate = True
        handler.close()
        stream.close()
    drain.join(timeout=10)
    lines = [json.loads(line) for line in drain.data[held:].decode().splitlines()]
    written = [line["msg"] for line in lines if line["msg"].startswith("line ")]
    said = [line for line in lines if line["msg"].endswith("the log stream did not take them in time")]
    # The queue holds ten: the first ten lines always find room, and are written. Every later
    # line either finds room (the writer took one meanwhile) and is written, in order, or is
    # dropped and counted. A count is said after the next line written: drops on either side
    # of a line the writer took are said in two lines.
    numbers = [int(message.removeprefix("line ")) for message in written]
    assert numbers[:10] == list(range(10)) and numbers == sorted(set(numbers)) and len(numbers) < 100
    assert said and all(line["level"] == "warning" for line in said)
    counts = [int(line["msg"].split(" ", 1)[0]) for line in said]
    assert [line["msg"] for line in said] == [
        f"{n} log lines dropped: the log stream did not take them in time" for n in counts
    ]
    assert sum(counts) == 100 - len(written)
