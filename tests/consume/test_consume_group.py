"""A consumer's place in its group, on tansu and MariaDB: readiness while it has no broker,
its member id while a rebalance is held, and the joins the broker refuses."""

from __future__ import annotations

import logging
import signal
from typing import Any

import anyio
import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.consumer.group_coordinator import CoordinatorGroupRebalance
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import InvalidSessionTimeoutError
from consume.conftest import TOPIC, ConsumerBroker, envelope
from consume.test_consume_inprocess import StuckPlugin, migrated, send
from support import free_port, running, wait_until
from telemetry_support import capture

from room_outbox.config import ConfigError, Settings
from room_outbox.consume.engine import Consumer
from room_outbox.consume.registry import build_handlers
from room_outbox.consume.service import run_consumers
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.consumers.sql import SQLConsumerStore

pytestmark = pytest.mark.anyio

__all__ = ["migrated"]  # the fixture, shared with the in-process tests


@pytest.mark.parametrize("outage", ["stopped", "killed"])
async def test_readyz_turns_unready_while_the_broker_does_not_answer_and_ready_again_once_it_does(
    migrated: MySQLStore, broker: ConsumerBroker, database_dsn: str, outage: str
) -> None:
    """The broker stops answering (SIGSTOP) or is gone (killed): within about session_timeout
    ``/readyz`` says not ready, its ``broker feed`` check naming the broker; once the broker
    answers again it is ready again (before: ready all along, the client retrying quietly)."""
    port = free_port()
    settings = Settings(
        database={"dsn": database_dsn},
        telemetry={"http_listen": f"127.0.0.1:{port}"},
        consumers={"feed": {"bootstrap_servers": broker.bootstrap, "handlers": ["audit"], "session_timeout": "3s"}},
    )
    stop = anyio.Event()
    assert broker.proc is not None
    async with (
        anyio.create_task_group() as tasks,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http,
    ):
        tasks.start_soon(lambda: run_consumers(settings, None, stop, False))

        async def readiness() -> dict[str, Any]:
            try:
                return dict((await http.get("/readyz")).json())
            except httpx.TransportError:
                return {}

        try:
            await wait_until(lambda: _ready(readiness), timeout=60)
            assert (await readiness())["broker feed"] == "ok"
            if outage == "stopped":
                broker.proc.send_signal(signal.SIGSTOP)
            else:
                await anyio.to_thread.run_sync(broker.stop)
            await wait_until(lambda: _unready(readiness), timeout=30)
            check = (await readiness())["broker feed"]
            assert check.startswith(f"no answer from the broker {broker.bootstrap} for "), check
            assert check.endswith("(session_timeout 3s)"), check
            if outage == "stopped":
                broker.proc.send_signal(signal.SIGCONT)
            else:
                await anyio.to_thread.run_sync(broker.start)
            await wait_until(lambda: _ready(readiness), timeout=60)
        finally:
            if outage == "stopped" and broker.proc is not None:
                broker.proc.send_signal(signal.SIGCONT)
            stop.set()


async def _ready(readiness: Any) -> bool:
    return (await readiness()).get("ready") is True


async def _unready(readiness: Any) -> bool:
    answer = await readiness()
    return answer.get("ready") is False and answer.get("broker feed", "ok") != "ok"


def _member(store: MySQLStore, settings: ConsumerSettings, node: str, plugins: list[object]) -> Consumer:
    return Consumer(
        "feed", settings, SQLConsumerStore(store, settings.handler_timeout),
        build_handlers(make_plugin_manager(extra_plugins=plugins), "feed", settings, node, Redactor()), node,
        Redactor(), capture().telemetry,
    )  # fmt: skip


async def _member_ids(bootstrap: str, group: str) -> set[str]:
    """The members of ``group`` as the broker describes them."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (response,) = await admin.describe_consumer_groups([group])
        return {member[0] for described in response.groups for member in described[5]}
    finally:
        await admin.close()


async def test_a_member_waiting_on_a_held_rebalance_keeps_its_member_id(
    migrated: MySQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member's handler hangs, so the rebalance a second member's join starts is held (the
    first rejoins only once its batch is settled). The second waits as one member, the same
    id window after window (before: it gave up its join every JOIN_TIMEOUT and joined again
    as a new member, one more for the rebalance to wait for)."""
    from room_outbox.consume import engine

    plugin = StuckPlugin()
    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["stuck"], session_timeout=6, handler_timeout=60
    )
    first, second = _member(migrated, settings, "node-1", [plugin]), _member(migrated, settings, "node-2", [plugin])
    group = settings.group("feed")
    seen: set[str] = set()

    def windows() -> int:
        return sum(r.getMessage().startswith("group rebalance did not complete") for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="room_outbox.consume"), anyio.fail_after(120):
        async with running(first), anyio.create_task_group() as tasks:
            try:
                await send(broker.bootstrap, [envelope("held", "RoomUserJoined", "room_1", 1)])
                await plugin.entered.wait()
                held_by = await _member_ids(broker.bootstrap, group)
                monkeypatch.setattr(engine, "JOIN_TIMEOUT", 3.0)
                tasks.start_soon(second.run)

                async def three_windows_seen() -> bool:
                    seen.update(await _member_ids(broker.bootstrap, group) - held_by)
                    return windows() >= 3

                await wait_until(three_windows_seen, timeout=60, interval=0.5)
            finally:
                second.stop()
                plugin.released.set()  # else the first member's stop waits for the handling's timeout
    assert len(seen) == 1, seen


async def test_a_join_refused_for_the_groups_protocol_is_named_once_not_as_the_broker_unavailable(
    migrated: MySQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another application's member (another partition assignor) holds the consumer's group:
    the broker refuses every join with InconsistentGroupProtocolError. The log names it and
    the fix, once however often the consumer tries again (before: "broker unavailable;
    trying again" at every try)."""
    from room_outbox.consume import engine

    monkeypatch.setattr(engine, "JOIN_RETRY_PAUSE", 0.1)
    settings = ConsumerSettings(bootstrap_servers=broker.bootstrap, handlers=["audit"], session_timeout=6)
    foreign = AIOKafkaConsumer(
        TOPIC, bootstrap_servers=broker.bootstrap, group_id=settings.group("feed"), session_timeout_ms=6000,
        heartbeat_interval_ms=2000, partition_assignment_strategy=(RangePartitionAssignor,),
    )  # fmt: skip
    with anyio.fail_after(30):
        await foreign.start()
    consumer = _member(migrated, settings, "node-1", [])

    def refusals() -> int:
        said = "Attempt to join group failed due to fatal error"  # aiokafka's line, at each try
        return sum(r.getMessage().startswith(said) for r in caplog.records)

    try:
        with caplog.at_level(logging.INFO), anyio.fail_after(60):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(consumer.run)
                try:
                    await wait_until(lambda: refusals() >= 3, timeout=45)
                finally:
                    consumer.stop()
    finally:
        await foreign.stop()
    ours = [r.getMessage() for r in caplog.records if r.name == "room_outbox.consume" and r.levelno >= logging.WARNING]
    named = "the broker refuses the group join (InconsistentGroupProtocolError): the group's members use another"
    assert [line for line in ours if line.startswith(named)] == [ours[0]], ours
    assert "consumers.feed.group_id" in ours[0]
    assert not [line for line in ours if line.startswith("broker unavailable")], ours


async def test_a_session_timeout_the_broker_refuses_stops_the_consumer_naming_the_setting_and_both_values(
    migrated: MySQLStore, broker: ConsumerBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker refuses a session timeout above its group.max.session.timeout.ms: every join
    fails with InvalidSessionTimeoutError. The consumer stops with a ConfigError naming the
    setting, its value and the broker's limits (before: "broker unavailable; trying again",
    for ever). tansu enforces no limit and reports none: its JoinGroup answer is replaced by
    that refusal, and the broker's configuration is read from tansu as it is."""

    async def refused(self: CoordinatorGroupRebalance) -> None:
        raise InvalidSessionTimeoutError()

    monkeypatch.setattr(CoordinatorGroupRebalance, "perform_group_join", refused)
    settings = ConsumerSettings(bootstrap_servers=broker.bootstrap, handlers=["audit"], session_timeout=3600)
    consumer = _member(migrated, settings, "node-1", [])
    with anyio.fail_after(30), pytest.raises(BaseExceptionGroup) as raised:
        await consumer.run()
    (error,) = raised.value.exceptions
    assert isinstance(error, ConfigError)
    message = str(error)
    assert message.startswith("consumers.feed.session_timeout: the broker refuses the group's session timeout"), message
    assert "consumers.feed.session_timeout is 3600s (3600000 ms)" in message
    assert "group.max.session.timeout.ms" in message
