"""A failure that comes back every round is logged when it begins, once per interval while it
lasts, and once when it ends: not once a round (the backlog gauges' samples too)."""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace
from typing import cast

import anyio
import pytest
from telemetry_support import capture

from room_outbox.config import LanePlan
from room_outbox.consume.offsets import LagWatch
from room_outbox.consume.retries import RetryBacklogWatch
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.observability import service
from room_outbox.observability.metrics import ConsumerMetrics
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.repeated import RepeatedFailure
from room_outbox.observability.telemetry import Telemetry
from room_outbox.store.consumers.protocol import ConsumerStore
from room_outbox.store.schema.profiles import V1


def test_a_failure_each_round_makes_a_line_when_it_begins_one_a_minute_and_one_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    failing = RepeatedFailure(
        logging.getLogger("test.repeated"), "round failed", "rounds succeed again", 60.0, lambda: now[0], lane="main"
    )
    with caplog.at_level(logging.INFO, logger="test.repeated"):
        for second in range(150):  # a round a second for two and a half minutes
            now[0] = 100.0 + second
            failing.failed(f"error {second}")
        failing.succeeded()
        failing.succeeded()  # nothing more to say
        now[0] = 300.0
        failing.failed("again")
    lines = [(r.levelname, r.message, {k: getattr(r, k, None) for k in ("error", "failed_rounds", "lane")})
             for r in caplog.records]  # fmt: skip
    assert lines == [
        ("ERROR", "round failed", {"error": "error 0", "failed_rounds": None, "lane": "main"}),
        ("ERROR", "round failed", {"error": "error 60", "failed_rounds": 61, "lane": "main"}),
        ("ERROR", "round failed", {"error": "error 120", "failed_rounds": 121, "lane": "main"}),
        ("WARNING", "rounds succeed again", {"error": None, "failed_rounds": 150, "lane": "main"}),
        ("ERROR", "round failed", {"error": "again", "failed_rounds": None, "lane": "main"}),  # news again
    ]
    assert caplog.records[2].failing_for_s == 120.0 and caplog.records[3].failing_for_s == 149.0


def test_an_error_of_another_kind_is_logged_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """A transient error (a deadlock as a table is swapped) and then a lasting one of another
    kind (the swapped table lacks an index): the lasting one is logged as it begins, not a
    minute later; its repeats, and a kind logged already, wait for the minute as before."""
    now = [100.0]
    failing = RepeatedFailure(logging.getLogger("test.repeated"), "round failed", "ok again", 60.0, lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.repeated"):
        failing.failed("OperationalError: (1213, 'Deadlock found')")
        for second in range(1, 30):
            now[0] = 100.0 + second
            failing.failed("SchemaError: room_outbox lacks the index idx_room_outbox_claim")
        failing.failed("OperationalError: (1213, 'Deadlock found')")  # a kind logged already: no line
    assert [(r.error, getattr(r, "failed_rounds", None)) for r in caplog.records] == [
        ("OperationalError: (1213, 'Deadlock found')", None),
        ("SchemaError: room_outbox lacks the index idx_room_outbox_claim", 2),
    ]


@pytest.mark.anyio
async def test_backlog_samples_failing_while_the_database_is_down_are_logged_once_then_their_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The backlog gauges' samples (every telemetry.backlog_interval) during an outage: one
    warning when they start failing and one when they succeed again, not one per sample."""
    samples = [0]

    class DownStore:
        profile = V1

        def transaction(self) -> object:
            samples[0] += 1
            raise ConnectionRefusedError("the database is down")

    def recovered() -> bool:
        return any(r.getMessage() == "backlog samples succeed again" for r in caplog.records)

    lanes_known = anyio.Event()
    lanes_known.set()
    obs = SimpleNamespace(_lanes_known=lanes_known, lanes=LanePlan(main=True, own=()), telemetry=Telemetry())
    with caplog.at_level(logging.INFO, logger="room_outbox.observability"), anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(service._sample_backlog, DownStore(), obs, 0.001, Redactor())
            while samples[0] < 50:
                await anyio.sleep(0.001)
            obs.lanes = LanePlan(main=False, own=())  # nothing left to read: the next sample succeeds
            while not recovered():
                await anyio.sleep(0.001)
            tasks.cancel_scope.cancel()
    lines = [(r.levelname, r.getMessage(), getattr(r, "failed_rounds", None)) for r in caplog.records]
    assert lines[0] == ("WARNING", "backlog sample failed", None)
    assert lines[1][:2] == ("WARNING", "backlog samples succeed again") and lines[1][2] >= 50
    assert len(lines) == 2, lines


@pytest.mark.anyio
async def test_failed_backlog_samples_are_counted_and_the_gauges_age_is_exported() -> None:
    """The backlog gauges keep their last values while samples fail: /metrics counts the failed
    samples and says how old the gauges are, which a successful sample brings back to 0."""

    class DownStore:
        profile = V1

        def transaction(self) -> object:
            raise ConnectionRefusedError("the database is down")

    captured = capture()
    lanes_known = anyio.Event()
    lanes_known.set()
    obs = SimpleNamespace(_lanes_known=lanes_known, lanes=LanePlan(main=True, own=()), telemetry=captured.telemetry)

    def age() -> float:
        return captured.value("room_outbox.backlog.sample.age")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(service._sample_backlog, DownStore(), obs, 0.001, Redactor())
            while captured.value("room_outbox.backlog.sample.failures") < 5 or age() < 0.2:
                await anyio.sleep(0.001)
            text = captured.telemetry.prometheus_text()
            obs.lanes = LanePlan(main=False, own=())  # nothing left to read: the next sample succeeds
            while age() >= 0.2:
                await anyio.sleep(0.001)
            tasks.cancel_scope.cancel()
    assert "room_outbox_backlog_sample_failures_total" in text
    assert "room_outbox_backlog_sample_age_seconds" in text


@pytest.mark.anyio
async def test_a_consumers_gauges_read_in_vain_make_a_line_when_it_begins_and_one_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The lag (read from the broker) and the retry backlog (from the database) fail reading
    after reading while the broker or the database is away: a warning when it begins, none for
    the readings after it, and one when a reading succeeds again."""
    with socket.socket() as closed:  # a port nothing listens on: the broker is away
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    settings = ConsumerSettings(handlers=["stats"], bootstrap_servers=f"127.0.0.1:{port}")
    metrics = ConsumerMetrics(Telemetry().meter, "gifts", ["stats"])
    lag = LagWatch("gifts", settings, metrics, Redactor(), interval=60.0)
    down = [True]

    class Store:
        async def count_retrying(self, consumer: str, limit: int) -> int:
            if down[0]:
                raise ConnectionRefusedError("the database is down")
            return 3

    backlog = RetryBacklogWatch("gifts", cast(ConsumerStore, Store()), metrics, Redactor(), interval=60.0)
    with caplog.at_level(logging.INFO, logger="room_outbox"), anyio.fail_after(30):
        for _ in range(3):
            await lag.read_once()
            await backlog.read_once()
        down[0] = False
        await backlog.read_once()
        await backlog.read_once()
    ours = [r for r in caplog.records if r.name.startswith("room_outbox")]  # not the driver's own
    lines = [(r.levelname, r.getMessage(), getattr(r, "failed_rounds", None)) for r in ours]
    assert lines == [
        ("WARNING", "consumer lag not read; its metric keeps its last values until it is", None),
        ("WARNING", "retry backlog not read; its metric keeps its last value until it is", None),
        ("WARNING", "retry backlog read again", 3),
    ]
    assert all(r.consumer == "gifts" for r in ours)
    assert "KafkaConnectionError" in ours[0].error and "database is down" in ours[1].error
