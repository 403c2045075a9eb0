"""`room-outbox consumers describe` against the real broker: members, partitions, committed and
end offsets, and the lag that builds up once the group's consumer has stopped."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaProducer
from consume.conftest import TOPIC, ConsumerBroker, envelope
from support import wait_until

from room_outbox.cli.consume import migrate_consumers
from room_outbox.cli.consumers import describe_command, describe_group
from room_outbox.config import Settings
from room_outbox.consume.service import run_consumers
from room_outbox.consume.settings import consumer_settings
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.testing import closed_port

pytestmark = pytest.mark.anyio


@pytest.fixture
async def migrated(store: MySQLStore) -> MySQLStore:
    await store.migrate()
    await migrate_consumers(store, make_plugin_manager(), handlers=["audit"])
    return store


async def send(bootstrap: str, events: list[dict[str, Any]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", request_timeout_ms=10_000)
    await producer.start()
    try:
        for e in events:
            await producer.send(TOPIC, json.dumps(e).encode(), key=f"app1:{e['room_id']}".encode())
        await producer.flush()
    finally:
        await producer.stop()


def events(prefix: str, count: int) -> list[dict[str, Any]]:
    return [envelope(f"{prefix}{n}", "RoomGiftSent", f"r{n % 5}", n) for n in range(count)]


async def test_describe_shows_members_while_running_and_lag_after_the_consumer_stops(
    migrated: MySQLStore, broker: ConsumerBroker, database_dsn: str
) -> None:
    settings = Settings(
        database={"dsn": database_dsn},
        consumers={"feed": {"bootstrap_servers": broker.bootstrap, "handlers": ["audit"], "session_timeout": "6s"}},
    )
    feed = consumer_settings(settings)["feed"]
    stop = anyio.Event()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lambda: run_consumers(settings, None, stop, False))
        try:
            await send(broker.bootstrap, events("a", 12))

            async def caught_up() -> bool:
                described = await describe_group("feed", feed)
                return sum(p.committed or 0 for p in described.partitions) == 12

            await wait_until(caught_up, timeout=60)
            running = await describe_group("feed", feed)
            assert (running.state, len(running.members), running.lag) == ("Stable", 1, 0)
            assert [p.partition for p in running.partitions] == [0, 1, 2]
            assert sum(p.end for p in running.partitions) == 12
        finally:
            stop.set()

    await send(broker.bootstrap, events("b", 7))  # nobody reads them now
    # (The test broker keeps a stopped member listed and reports no assignments, so only the
    # offsets are asserted from here on; Kafka empties the group when its member leaves.)
    stopped = await describe_group("feed", feed)
    assert stopped.lag == 7
    assert [p.committed for p in stopped.partitions] == [p.committed for p in running.partitions]
    assert sum(p.end for p in stopped.partitions) == 19
    assert all(p.lag == p.end - (p.committed or 0) for p in stopped.partitions)

    out = io.StringIO()
    assert await describe_command(settings, "feed", True, out) == 0
    (group,) = json.loads(out.getvalue())
    assert (group["consumer"], group["group"], group["lag"]) == ("feed", "room-outbox.feed", 7)
    assert sum(p["lag"] for p in group["partitions"]) == 7

    out = io.StringIO()
    assert await describe_command(settings, None, False, out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("consumer feed: group room-outbox.feed (") and lines[0].endswith(", lag 7")
    assert lines[1].split() == ["topic", "partition", "committed", "end", "lag", "member"]
    assert [line.split()[1] for line in lines[2:5]] == ["0", "1", "2"]


def describe_process(config: Path) -> subprocess.CompletedProcess[str]:
    """`room-outbox consumers describe` as an operator runs it."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("ROOM_OUTBOX")}
    return subprocess.run(
        [sys.executable, "-m", "room_outbox.cli", "consumers", "describe", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
    )


def test_describe_with_the_broker_unreachable_names_it_in_one_line(tmp_path: Path) -> None:
    """It was an uncaught KafkaConnectionError: aiokafka's own error line, then a traceback,
    exit 1."""
    port = closed_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        "sinks: {tencent_im: {enabled: false}}\n"
        f"consumers: {{feed: {{bootstrap_servers: '127.0.0.1:{port}', handlers: [audit]}}}}\n"
    )
    done = describe_process(config)
    assert (done.returncode, done.stdout) == (3, "")
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"room-outbox: consumers describe: cannot reach the Kafka broker 127.0.0.1:{port}")
    assert line.endswith("is it running, and is consumers.feed.bootstrap_servers right?")


def test_describe_without_an_enabled_consumer_says_so_once(tmp_path: Path) -> None:
    """The message carried the prefix the CLI adds to every error: it was printed twice."""
    config = tmp_path / "config.yaml"
    config.write_text("sinks: {tencent_im: {enabled: false}}\n")
    done = describe_process(config)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "room-outbox: consumers describe: no enabled consumer in the configuration (consumers.<name>)\n"
    )
