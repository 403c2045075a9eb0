"""Errors the broker or the group raise from a member's fetch while it consumes, on tansu and
MariaDB: said once while they last, the member fetching again or joining again, never the end
of the process."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import anyio
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.consumer.group_coordinator import CoordinatorGroupRebalance, GroupCoordinator
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import GroupAuthorizationFailedError, InconsistentGroupProtocolError, InvalidSessionTimeoutError
from consume.conftest import TOPIC, ConsumeProcess, ConsumerBroker, cli, envelope, eventually, write_config
from consume.test_consume_group import _member
from consume.test_consume_inprocess import migrated, rows, send
from support import running, wait_until

from room_outbox.config import ConfigError
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.store.backends.mysql import MySQLStore

__all__ = ["migrated"]  # the fixture, shared with the in-process tests

pytestmark = pytest.mark.anyio

REFUSED = "the broker refuses the fetch or the group join (InconsistentGroupProtocolError)"


def test_a_rejoin_refused_while_consuming_is_named_and_the_process_goes_on(
    tmp_path: Path, database_dsn: str, broker: ConsumerBroker, processes: list[ConsumeProcess]
) -> None:
    """A member is paused (SIGSTOP) while the broker restarts empty and another application's
    member (another partition assignor) takes the group: resumed, the member must rejoin and
    the broker refuses it with InconsistentGroupProtocolError, which aiokafka raises from the
    fetch. The process says it, naming the fix, and goes on trying until it is stopped
    (before: the error ended the process)."""
    config = write_config(
        tmp_path / "config.yaml", database_dsn, broker, {"feed": {"handlers": ["audit"], "session_timeout": "3s"}}
    )
    assert cli(config, "migrate").returncode == 0
    member = ConsumeProcess(config, "node-1")
    processes.append(member)
    eventually(lambda: member.said("partitions assigned"), timeout=60, what="the member joined")

    group = ConsumerSettings(handlers=["audit"]).group("feed")

    async def take_the_group() -> None:
        foreign = AIOKafkaConsumer(
            TOPIC, bootstrap_servers=broker.bootstrap, group_id=group, session_timeout_ms=6000,
            heartbeat_interval_ms=2000, partition_assignment_strategy=(RangePartitionAssignor,),
        )  # fmt: skip
        with anyio.fail_after(30):
            await foreign.start()
        try:
            member.proc.send_signal(signal.SIGCONT)
            await wait_until(lambda: _refusals(member) >= 1, timeout=60, interval=0.2)
        finally:
            await foreign.stop()

    member.proc.send_signal(signal.SIGSTOP)
    try:
        broker.stop()
        broker.start()  # memory storage: the group is gone
        anyio.run(take_the_group)
    finally:
        member.proc.send_signal(signal.SIGCONT)
    assert member.alive(), member.log.read_text()[-3000:]
    assert _refusals(member) == 1, [line["msg"] for line in member.lines()]
    (said,) = [line for line in member.lines() if line["msg"].startswith(REFUSED)]
    assert said["level"] == "error" and said["consumer"] == "feed", said
    assert "another application uses this group id" in said["msg"] and "consumers.feed.group_id" in said["msg"]
    assert member.terminate() == 0, member.log.read_text()[-3000:]


def _refusals(member: ConsumeProcess) -> int:
    return sum(line["msg"].startswith(REFUSED) for line in member.lines())


async def test_a_refusal_lasting_many_fetches_is_said_once_and_the_member_goes_on_once_it_ends(
    migrated: MySQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker restarts empty, so the member must rejoin, and its rejoins are refused
    (InconsistentGroupProtocolError, as another application's member holding the group makes
    them: the refusal replaces the join's answer) try after try, each raised from a fetch. The
    consumer says it once, fetches again after each, and once the refusals end it rejoins, says
    it fetches again and consumes (before: the first refusal ended the consumer)."""
    settings = ConsumerSettings(bootstrap_servers=broker.bootstrap, handlers=["audit"], session_timeout=3)
    consumer = _member(migrated, settings, "node-1", [])
    join = CoordinatorGroupRebalance.perform_group_join
    tries: list[float] = []

    async def refused(self: CoordinatorGroupRebalance) -> None:
        tries.append(time.monotonic())
        raise InconsistentGroupProtocolError()

    with caplog.at_level(logging.INFO, logger="room_outbox.consume"), anyio.fail_after(120):
        async with running(consumer):
            monkeypatch.setattr(CoordinatorGroupRebalance, "perform_group_join", refused)
            await anyio.to_thread.run_sync(broker.stop)
            await anyio.to_thread.run_sync(broker.start)
            await wait_until(lambda: len(tries) >= 4, timeout=60)
            monkeypatch.setattr(CoordinatorGroupRebalance, "perform_group_join", join)
            await wait_until(lambda: _said(caplog, "fetching again") == 1, timeout=30)
            await send(broker.bootstrap, [envelope("after", "RoomUserJoined", "room_1", 1)])
            await wait_until(lambda: _processed(migrated, {"after"}), timeout=30)
    (said,) = [r for r in caplog.records if r.getMessage().startswith(REFUSED)]
    assert said.levelno == logging.ERROR and getattr(said, "consumer", None) == "feed"
    assert "consumers.feed.group_id" in said.getMessage()
    assert _said(caplog, "consumer started") == 1  # the same client all along: it rejoined by itself


async def test_a_refused_heartbeat_makes_the_member_join_again_as_a_new_one(
    migrated: MySQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One heartbeat refused (GroupAuthorizationFailedError, an ACL revoked and granted again:
    tansu has no ACLs, so the refusal replaces one heartbeat's answer) ends aiokafka's heartbeat
    routine: the client raises the refusal from every fetch after it and sends no heartbeat,
    so the broker drops it while it goes on fetching. The member leaves and joins again as a
    new one, saying so once, and consumes what comes after (before: the error ended the
    consumer)."""
    heartbeat = GroupCoordinator._do_heartbeat
    refused: list[float] = []

    async def refused_once(coordinator: GroupCoordinator) -> bool:
        if not refused:
            refused.append(time.monotonic())
            raise GroupAuthorizationFailedError(coordinator.group_id)
        return bool(await heartbeat(coordinator))

    settings = ConsumerSettings(bootstrap_servers=broker.bootstrap, handlers=["audit"], session_timeout=3)
    consumer = _member(migrated, settings, "node-1", [])
    with caplog.at_level(logging.INFO, logger="room_outbox.consume"), anyio.fail_after(90):
        async with running(consumer):
            await send(broker.bootstrap, [envelope("before", "RoomUserJoined", "room_1", 1)])
            await wait_until(lambda: _processed(migrated, {"before"}), timeout=30)
            monkeypatch.setattr(GroupCoordinator, "_do_heartbeat", refused_once)
            await wait_until(lambda: _said(caplog, "the Kafka client cannot go on") == 1, timeout=30)
            await send(broker.bootstrap, [envelope("after", "RoomUserJoined", "room_1", 2)])
            await wait_until(lambda: _processed(migrated, {"before", "after"}), timeout=60)
    assert _said(caplog, "consumer started") == 2
    (start_over,) = [r for r in caplog.records if r.getMessage().startswith("the Kafka client cannot go on")]
    assert start_over.getMessage().startswith(
        "the Kafka client cannot go on (GroupAuthorizationFailedError): leaving the group and joining it again"
    )
    assert start_over.levelno == logging.WARNING and getattr(start_over, "consumer", None) == "feed"


async def test_a_session_timeout_refused_at_a_rejoin_stops_the_consumer_naming_the_setting(
    migrated: MySQLStore, broker: ConsumerBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The member joined; the broker restarts empty (memory storage), so the member must
    rejoin, and the rejoin is refused with InvalidSessionTimeoutError, which aiokafka raises
    from the fetch. No join can ever succeed: the consumer stops with the ConfigError the first
    join gives, naming the setting (before: the bare Kafka error ended the consumer). tansu
    enforces no limit: the refusal replaces the rejoin's answer."""
    settings = ConsumerSettings(bootstrap_servers=broker.bootstrap, handlers=["audit"], session_timeout=3)
    consumer = _member(migrated, settings, "node-1", [])

    async def refused(self: CoordinatorGroupRebalance) -> None:
        raise InvalidSessionTimeoutError()

    with anyio.fail_after(60), pytest.raises(BaseExceptionGroup) as raised:
        async with anyio.create_task_group() as tasks:
            await tasks.start(consumer.run)
            monkeypatch.setattr(CoordinatorGroupRebalance, "perform_group_join", refused)
            await anyio.to_thread.run_sync(broker.stop)
            await anyio.to_thread.run_sync(broker.start)
    (error,) = _leaves(raised.value)
    assert isinstance(error, ConfigError), raised.value.exceptions
    assert str(error).startswith("consumers.feed.session_timeout: the broker refuses the group's session timeout")
    assert "consumers.feed.session_timeout is 3s (3000 ms)" in str(error)


def _said(caplog: pytest.LogCaptureFixture, start: str) -> int:
    return sum(r.getMessage().startswith(start) for r in caplog.records if r.name == "room_outbox.consume")


async def _processed(store: MySQLStore, events: set[str]) -> bool:
    return {row[0] for row in await rows(store, "SELECT event_id FROM room_consumer_processed")} == events


def _leaves(group: BaseException) -> list[BaseException]:
    """The errors in an exception group and the groups nested in it."""
    if isinstance(group, BaseExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in _leaves(inner)]
    return [group]
