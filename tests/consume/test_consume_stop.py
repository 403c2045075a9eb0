"""How long `room-outbox consume` takes to stop on SIGTERM while a handler hangs or the broker
does not answer: at most ``handler_timeout`` and a few seconds (docs/how-to/run-consumers.md),
the batch's unsettled (or uncommitted) messages left to be handled again. A real process on tansu and MariaDB, its handler a plugin
installed for it alone."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from consume.conftest import (
    ConsumeProcess,
    ConsumerBroker,
    cli,
    dlq_messages,
    encode,
    envelope,
    eventually,
    produce,
    query,
    write_config,
)
from support import install_plugin

pytestmark = pytest.mark.serial

HANDLER_TIMEOUT = 6.0
#: What the documentation promises on top of handler_timeout: the commit, leaving the group,
#: closing the handlers and the pool.
STOP_MARGIN = 5.0

PLUGIN = '''
import asyncio
from pathlib import Path

from room_outbox import (
    HandleContext, HandlerFactoryContext, HandlerSettings, HandlerSpec, ConsumedEvent, PermanentHandlerError, hookimpl,
)


class HangSettings(HandlerSettings):
    hang_ids: list[str] = []
    started_file: str = ""
    dead_ids: list[str] = []
    held_ids: list[str] = []
    go_file: str = ""


class Hang:
    """Records each event; one in hang_ids says so in started_file, then never returns. One in
    held_ids says so in started_file, then waits for go_file; one in dead_ids is a dead letter."""

    def __init__(self, settings):
        self.settings = settings

    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        async with ctx.transaction() as tx:
            await tx.execute("INSERT INTO hang_log (event_id) VALUES (%s)", (event.envelope.event_id,))
        if event.envelope.event_id in self.settings.hang_ids:
            Path(self.settings.started_file).write_text(event.envelope.event_id)
            await asyncio.sleep(3600)
        if event.envelope.event_id in self.settings.held_ids:
            Path(self.settings.started_file).write_text(event.envelope.event_id)
            while not Path(self.settings.go_file).exists():
                await asyncio.sleep(0.05)  # bounded by handler_timeout
        if event.envelope.event_id in self.settings.dead_ids:
            raise PermanentHandlerError("dead on purpose")

    async def aclose(self) -> None:
        pass


SCHEMA = {
    "mysql": ["CREATE TABLE IF NOT EXISTS hang_log (id BIGINT AUTO_INCREMENT PRIMARY KEY, event_id VARCHAR(64))"],
    "postgresql": ["CREATE TABLE IF NOT EXISTS hang_log (id BIGSERIAL PRIMARY KEY, event_id VARCHAR(64))"],
}


@hookimpl
def room_outbox_register_handlers():
    return [HandlerSpec("hang", lambda settings, context: Hang(settings), settings_model=HangSettings, schema=SCHEMA)]
'''


def test_sigterm_while_a_handler_hangs_stops_within_handler_timeout_and_a_few_seconds(
    tmp_path: Path,
    database_dsn: str,
    broker: ConsumerBroker,
    processes: list[ConsumeProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler hangs in its chunk's transaction; SIGTERM comes as it starts hanging. The
    handling times out after handler_timeout, the chunk is not settled again message by
    message (that took a second handler_timeout), and the process exits 0 within
    handler_timeout and a few seconds. The hung event was not committed past: another start
    handles it (its handler no longer hanging), and each other event once."""
    env = install_plugin(tmp_path / "site", "hang_handler", PLUGIN, name="hang")
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])  # for the migrate below (cli passes os.environ)
    started = tmp_path / "hang-started"
    handler = {"handlers": ["hang"], "handler_timeout": f"{HANDLER_TIMEOUT}s", "max_batch": 50}
    config = write_config(tmp_path / "c.yaml", database_dsn, broker, {
        "feed": {**handler, "handler_settings": {"hang": {"hang_ids": ["h1"], "started_file": str(started)}}},
    })  # fmt: skip
    assert cli(config, "migrate").returncode == 0
    events = [envelope("h1", "RoomUserJoined", "room_h", 1)]
    events += [envelope(f"e{n}", "RoomUserJoined", f"room_{n % 3}", n + 1) for n in range(9)]
    produce(broker.bootstrap, [encode(e) for e in events])
    member = ConsumeProcess(config, "m0", env=env)
    processes.append(member)
    eventually(started.exists, 60, "the handler hangs")
    t0 = time.monotonic()
    rc = member.terminate(timeout=60)
    took = time.monotonic() - t0
    assert rc == 0, member.log.read_text()[-2000:]
    assert took < HANDLER_TIMEOUT + STOP_MARGIN, f"SIGTERM took {took:.1f}s"
    assert member.said("stopping mid-batch: its offsets are not committed, and what it had not handled yet is"
                       " handled after (what it had is found processed)")  # fmt: skip

    again = write_config(tmp_path / "again.yaml", database_dsn, broker, {"feed": handler})
    processes.append(ConsumeProcess(again, "m1", env=env))

    def handled() -> dict[str, int]:
        return {e: int(n) for e, n in query(database_dsn, "SELECT event_id, COUNT(*) FROM room_consumer_processed"
                                            " GROUP BY event_id")}  # fmt: skip

    eventually(lambda: len(handled()) == len(events), 60, "every event handled after the restart")
    assert set(handled().values()) == {1}


def test_sigterm_while_the_broker_does_not_answer_stops_within_handler_timeout_and_a_few_seconds(
    tmp_path: Path, database_dsn: str, broker: ConsumerBroker, processes: list[ConsumeProcess]
) -> None:
    """Events flow, then the broker stops answering (SIGSTOP) and SIGTERM comes: the commits,
    fetches and the group's leave that aiokafka would retry until the broker answers are
    abandoned, and the process exits 0 within handler_timeout and a few seconds, its log free of
    tracebacks. What it had handled but not committed is read again by the next start and found
    processed."""
    handler = {"handlers": ["audit"], "handler_timeout": f"{HANDLER_TIMEOUT}s", "max_batch": 50}
    config = write_config(tmp_path / "c.yaml", database_dsn, broker, {"feed": handler})
    assert cli(config, "migrate").returncode == 0
    events = [envelope(f"e{n}", "RoomUserJoined", f"room_{n % 40}", n // 40 + 1) for n in range(6000)]
    produce(broker.bootstrap, [encode(e) for e in events])
    member = ConsumeProcess(config, "m0")
    processes.append(member)

    def audited() -> int:
        return int(query(database_dsn, "SELECT COUNT(*) FROM room_audit_log")[0][0])

    eventually(lambda: audited() >= 300, 60, "handling under way")
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGSTOP)
    try:
        assert audited() < len(events), "the consumer caught up before the broker stopped answering"
        t0 = time.monotonic()
        rc = member.terminate(timeout=60)
        took = time.monotonic() - t0
    finally:
        broker.proc.send_signal(signal.SIGCONT)
    assert rc == 0, member.log.read_text()[-2000:]
    assert took < HANDLER_TIMEOUT + STOP_MARGIN, f"SIGTERM took {took:.1f}s"
    assert member.said("consumer stopped")
    # The abandoned commit is told once, in the process's own words; aiokafka's request, given
    # up with it, says nothing (nor asyncio of its task).
    assert member.said("offset commit abandoned: the broker did not answer while the consumer stops; the"
                       " partitions' next owner reads these messages again and finds them processed")  # fmt: skip
    assert not [line for line in member.lines() if "OffsetCommitRequest" in line["msg"]]
    assert_no_traceback(member.log)

    processes.append(ConsumeProcess(config, "m1"))
    eventually(lambda: audited() == len(events), 120, "every event audited after the restart")
    processed = query(database_dsn, "SELECT COUNT(*), COUNT(DISTINCT event_id) FROM room_consumer_processed")
    assert processed == [(len(events), len(events))]


def test_sigterm_while_a_dead_letter_waits_on_a_broker_that_does_not_answer_stops_within_a_few_seconds(
    tmp_path: Path,
    database_dsn: str,
    broker: ConsumerBroker,
    processes: list[ConsumeProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead letter is being copied to its topic when the broker stops answering (SIGSTOP),
    and SIGTERM comes: the copy and the dead-letter producer's close are abandoned like the
    consumer's own broker operations, and the process exits 0 within handler_timeout and a few
    seconds, its log free of tracebacks. The dead letter is in room_consumer_retry all the same."""
    env = install_plugin(tmp_path / "site", "hang_handler", PLUGIN, name="hang")
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])  # for the migrate below (cli passes os.environ)
    started, go = tmp_path / "held-started", tmp_path / "go"
    dying = {"dead_ids": ["d0", "d1"], "held_ids": ["d1"], "started_file": str(started), "go_file": str(go)}
    config = write_config(tmp_path / "c.yaml", database_dsn, broker, {
        "feed": {"handlers": ["hang"], "handler_timeout": f"{HANDLER_TIMEOUT}s", "handler_settings": {"hang": dying}},
    })  # fmt: skip
    assert cli(config, "migrate").returncode == 0
    member = ConsumeProcess(config, "m0", env=env)
    processes.append(member)
    produce(broker.bootstrap, [encode(envelope("d0", "RoomUserJoined", "room_a", 1))])
    dlq_messages(broker.bootstrap, 1)  # the dead-letter producer is started and has sent a copy
    produce(broker.bootstrap, [encode(envelope("d1", "RoomUserJoined", "room_b", 1))])
    eventually(started.exists, 60, "d1 handled")

    def dead_letter(event_id: str) -> bool:
        return any(line["msg"] == "dead letter" and line.get("event_id") == event_id for line in member.lines())

    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGSTOP)
    try:
        go.touch()  # d1 dies now, its copy sent to a broker that does not answer
        eventually(lambda: dead_letter("d1"), 30, "d1 a dead letter")
        t0 = time.monotonic()
        rc = member.terminate(timeout=60)
        took = time.monotonic() - t0
    finally:
        broker.proc.send_signal(signal.SIGCONT)
    assert rc == 0, member.log.read_text()[-2000:]
    assert took < HANDLER_TIMEOUT + STOP_MARGIN, f"SIGTERM took {took:.1f}s"
    assert member.said("consumer stopped")
    assert member.said("dead letters not copied to their topic (they are in room_consumer_retry)")
    assert member.said("dead-letter producer abandoned: the broker did not answer while the consumer stops;"
                       " the dead letters stay in room_consumer_retry")  # fmt: skip
    assert_no_traceback(member.log)
    assert sorted(e for (e,) in query(database_dsn, "SELECT event_id FROM room_consumer_retry")) == ["d0", "d1"]


def assert_no_traceback(log: Path) -> None:
    """Only the process's own one-line records: no traceback, no asyncio report of a task whose
    failure nobody looked at, no resource left unclosed."""
    text = log.read_text()
    for noise in ("Traceback", "Task exception was never retrieved", "Unclosed"):
        assert noise not in text, f"{noise!r} in the log:\n{text[-3000:]}"
