"""Consumers on a real broker (tansu, memory only) and a real MariaDB or PostgreSQL, as real processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest
import yaml
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from lanes.conftest import Broker

from room_outbox.store.backends.mysql import MySQLAddress

TOPIC = "room-events"


class ConsumerBroker(Broker):
    """The broker with the dead-letter topic created too."""

    def start(self) -> None:
        super().start()
        created = subprocess.run(
            [str(self.binary), "topic", "create", f"{TOPIC}.dlq", "--broker", f"tcp://127.0.0.1:{self.port}",
             "--partitions", "1"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        assert created.returncode == 0, created.stderr[-500:]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ConsumerBroker]:
    broker = ConsumerBroker(tmp_path / "tansu.log", topic=TOPIC, partitions=3)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def envelope(event_id: str, event_type: str, room: str, version: int, **payload: Any) -> dict[str, Any]:
    return {
        "event_id": event_id, "event_type": event_type, "room_id": room, "app_code": "app1",
        "room_version": version, "payload": {"user_id": f"u_{event_id}", **payload},
    }  # fmt: skip


def produce(bootstrap: str, messages: list[tuple[bytes, bytes]], topic: str = TOPIC) -> None:
    """Send (key, value) pairs in order and wait for the broker's acknowledgements."""

    async def send() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", request_timeout_ms=10_000)
        await producer.start()
        try:
            for key, value in messages:
                headers = []
                if value.startswith(b"{"):
                    doc = json.loads(value)
                    headers = [("event_id", doc["event_id"].encode()), ("event_type", doc["event_type"].encode())]
                await producer.send(topic, value, key=key, headers=headers)
            await producer.flush()
        finally:
            await producer.stop()

    asyncio.run(asyncio.wait_for(send(), 60))


def dlq_messages(bootstrap: str, expected: int) -> list[Any]:
    """The first ``expected`` copies on the dead-letter topic (waiting up to 60 s for them)."""

    async def read() -> list[Any]:
        consumer = AIOKafkaConsumer(
            f"{TOPIC}.dlq", bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
        )
        await consumer.start()
        found: list[Any] = []
        try:
            while len(found) < expected:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    found.extend(records)
        finally:
            await consumer.stop()
        return found

    return asyncio.run(asyncio.wait_for(read(), 60))


def encode(env: dict[str, Any]) -> tuple[bytes, bytes]:
    return f"{env['app_code']}:{env['room_id']}".encode(), json.dumps(env).encode()


def query(dsn: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run one statement on the test's database (MariaDB or PostgreSQL) and return its rows."""
    if dsn.startswith("postgresql"):
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5, options="-c statement_timeout=30000") as conn:
            cur = conn.execute(sql, params or None)
            return list(cur.fetchall()) if cur.description is not None else []
    address = MySQLAddress.from_dsn(dsn)
    conn = pymysql.connect(
        host=address.host, port=address.port, user=address.user, password=address.password,
        database=address.database, autocommit=True, read_timeout=30, write_timeout=30, connect_timeout=5,
    )  # fmt: skip
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params or None)
            return list(cur.fetchall())
    finally:
        conn.close()


def write_config(path: Path, dsn: str, broker: Broker, consumers: dict[str, Any]) -> Path:
    defaults = {"bootstrap_servers": broker.bootstrap, "topic": TOPIC, "session_timeout": "6s"}
    config = {
        "database": {"dsn": dsn, "pool_size": 8},
        "sinks": {"tencent_im": {"enabled": False}},
        "consumers": {name: {**defaults, **section} for name, section in consumers.items()},
        "log": {"level": "INFO"},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def cli(config: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "room_outbox.cli", "--config", str(config), *args],
        capture_output=True, text=True, timeout=timeout, env=_env(),
    )  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("ROOM_OUTBOX", "OTEL_"))}


class ConsumeProcess:
    """``room-outbox consume`` as a process; its JSON log lines land in ``log``."""

    def __init__(self, config: Path, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = config.parent / f"{name}.log"
        environment = {**_env(), "ROOM_OUTBOX__NODE_ID": name, **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "consume", *args],
            stdout=subprocess.DEVNULL, stderr=self.log.open("w"), env=environment,
        )  # fmt: skip

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def said(self, msg: str) -> bool:
        return any(line.get("msg") == msg for line in self.lines())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30, signum: signal.Signals = signal.SIGTERM) -> int:
        self.proc.send_signal(signum)
        return self.proc.wait(timeout=timeout)


@pytest.fixture(params=["mysql", "postgresql"])
def server_dsn(request: pytest.FixtureRequest) -> str:
    """A fresh database on each server the consumers run on."""
    return str(request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn"))


@pytest.fixture
def processes() -> Iterator[list[ConsumeProcess]]:
    started: list[ConsumeProcess] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.alive():
                proc.kill()


def eventually(predicate: Any, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not met within {timeout}s")
        time.sleep(0.2)  # polling other processes' progress; the deadline bounds it
