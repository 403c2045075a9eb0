"""The tailing relay: the scan loop of a lane whose sink keeps order by itself.

Each round (:meth:`TailStore.round <room_outbox.store.lanes.tail.TailStore.round>`, one
transaction) reads up to ``batch_size`` rows after the lane's cursor, hands the envelopes the
sink takes to its ``publish`` at once (many in flight, order kept per key by the sink), parks
the ones that can never be delivered (bad envelope, too large) and moves the cursor with one
write, made while the batch is on its way (with the next round's read) and committed once the
sink has answered. A batch that fails as a whole (the broker is down, a timeout) is rolled back
and read again, in the same order, so nothing is skipped and a room's events never overtake
each other; what the failed attempt did send is sent again (at least once).

Only the process holding the cursor row's lock runs a round; the others find it locked, wait
``poll_interval`` and try again, so ownership fails over as soon as the owner's connection
drops.

A round's transaction holds ``room_outbox`` (its metadata lock on MySQL/MariaDB, a share lock
on PostgreSQL) while its batch is on its way, so room-service's own schema changes wait for it,
and its writes behind them. So a batch the sink failed as a whole is rolled back at once, and
the process keeps the lane, the cursor row locked again in a transaction that reads nothing
else, while it asks the sink (``OrderedLogSink``'s optional ``reachable``) each
``poll_interval`` whether it answers again; then it sends the batch again at once. The other
processes skip the lane meanwhile, as they would send the batch too, and a batch cut off by a
hanging broker stays queued in its process's producer, to be written once the broker is back:
so an outage repeats a batch once. For ``SINK_WAIT_HOLDS_LANE`` publish timeouts at most: then
the process lets the lane go, to one that may reach the sink (this one may be cut off from it
alone), and waits for the sink outside any transaction before any round of its own. A broker
that hangs thus holds the table for one round's ``publish_timeout`` per such period, not for
every round of the outage. (Reading room_outbox in a short transaction of its own beside the
round's would hold it by none, for a transaction more per round: a tenth of the lane's speed
at small batches.)
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from room_outbox.attempt.failure import ErrorClass, Failure, describe, describe_round_failure, error_text
from room_outbox.attempt.pipeline import Attempts
from room_outbox.delivery.routing import Router
from room_outbox.envelope import (
    OTHER_EVENT_TYPE,
    ROW_COLUMNS,
    ROW_COLUMNS_SEPARATOR,
    EnvelopeError,
    EventEnvelope,
    joined_columns_differ,
    parse_envelope,
)
from room_outbox.observability.health import LaneHealth
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.repeated import RepeatedFailure
from room_outbox.observability.telemetry import Telemetry
from room_outbox.observability.tracing import end_attempt_span, sent_in_batch_span
from room_outbox.sink import OrderedLogSink, PermanentSinkError
from room_outbox.store.deadline import database_deadline_paused
from room_outbox.store.lanes.tail import KeptLane, TailRow, TailStore

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger("room_outbox.tail")

#: Delivery settings a lane-table lane honours and this relay never reads: a batch fails or is
#: sent as a whole (no per-row retries, back-off or attempt count), a sink that can never take a
#: row has it parked at once, order is the sink's (by key), and no row is claimed or leased. The
#: relay reads ``batch_size``, ``poll_interval`` and ``publish_timeout`` only.
LANE_TABLE_ONLY_SETTINGS = ("retry_strategy", "retry", "parking", "ordering", "concurrency", "lease")


#: How long, in publish timeouts, a process whose batch the sink failed keeps the lane while it
#: waits for the sink: long enough to span a broker's usual outage, short enough that a
#: process cut off from the broker alone soon lets one that can reach it take over.
SINK_WAIT_HOLDS_LANE = 5


class BatchFailed(Exception):
    """The sink failed a batch as a whole: the round is rolled back and read again."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.error)
        self.failure = failure
        #: The sink answered again while the lane was kept for it: the round goes again at once.
        self.sink_answered = False


class SinkUnreachable(Exception):
    """After a failed batch, the sink did not answer within ``publish_timeout``: no round ran."""


class TailRelay:
    def __init__(
        self,
        store: TailStore,
        router: Router,
        *,
        poll_interval: float,
        publish_timeout: float,
        redactor: Redactor,
        health: LaneHealth | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.store = store
        self.router = router
        self.lane = store.lane
        self.poll_interval = poll_interval
        self.publish_timeout = publish_timeout
        self.redactor = redactor
        self.health = health or LaneHealth(store.lane)
        self.telemetry = telemetry or Telemetry()
        #: Each batch sent: its deadline, and what its failure means.
        self.attempts = Attempts(redactor, publish_timeout)
        #: Rounds failing one after another: the first logged, then a line a minute while it lasts.
        self.failing_rounds = RepeatedFailure(
            log,
            "tailing round failed; the batch is read again, in order, after poll_interval",
            "tailing rounds succeed again",
            lane=self.lane,
        )
        self._stopping = anyio.Event()

    def stop(self) -> None:
        """Start no new round; the round in flight finishes (within ``publish_timeout``)."""
        self._stopping.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        log.info("tailing relay started", extra={"lifecycle": "worker_started", "lane": self.lane})
        task_status.started()
        sink_failed = False  # the last round's batch failed as a whole: wait for the sink first
        while not self._stopping.is_set():
            try:
                if sink_failed:
                    await self._sink_reachable()
                full = await self.run_once()
                sink_failed = False
                self.health.round_ended()
                self.failing_rounds.succeeded()
                if full:
                    continue  # a backlog drains at full speed
            except BatchFailed as exc:  # said when it failed, before the sink was waited for
                sink_failed = not exc.sink_answered
                if exc.sink_answered:
                    continue  # the batch goes again at once
            except Exception as exc:
                sink_failed = isinstance(exc, SinkUnreachable)
                self._round_failed(exc)
            with anyio.move_on_after(self.poll_interval):
                await self._stopping.wait()
        log.info("worker stopped", extra={"lifecycle": "worker_stopped", "lane": self.lane})

    async def run_once(self) -> bool:
        """One round; True when it read a full batch (more may be waiting). Its outcomes are
        counted once the round's transaction has committed, as the dispatcher counts what the
        database shows."""
        async with self.store.round() as tail:
            if tail is None:
                return False  # another process owns the lane
            to_send: list[tuple[TailRow, EventEnvelope]] = []
            for row in tail.rows:
                try:
                    envelope = parse_envelope(row.envelope)
                except EnvelopeError as exc:
                    tail.park(row, self._short(str(exc)))
                    self._count(self._row_label(row), "bad_envelope")
                    continue
                if row.columns is not None:
                    mismatch = joined_columns_differ(envelope, row.columns)
                    if mismatch is not None:  # the sink would go by the envelope, ordering by the row
                        tail.park(row, self._short(mismatch))
                        self._count(self._row_label(row), "bad_envelope")
                        continue
                if self.router.sink_for(envelope.event_type) is not None:
                    to_send.append((row, envelope))
            if to_send:
                traced = self._traced(to_send) if self.telemetry.tracer is not None else []
                try:
                    outcomes = await self._publish([envelope for _, envelope in to_send], tail.while_sending)
                except BatchFailed as failed:
                    for _, span in traced:
                        end_attempt_span(span, str(failed.failure.error_class), failed.failure.error)
                    self._round_failed(failed)
                    failed.sink_answered = await self._keep_lane_until_sink_answers(await tail.roll_back_keeping_lane())
                    raise
                published: Counter[str] = Counter()
                for (row, envelope), outcome in zip(to_send, outcomes, strict=True):
                    label = self.router.event_label(envelope.event_type)
                    if isinstance(outcome, PermanentSinkError):
                        tail.park(row, self._short(str(outcome)))
                        self._count(label, "permanent")
                    else:
                        published[label] += 1
                for label, events in published.items():
                    self._count(label, None, events)
                for index, span in traced:
                    outcome = outcomes[index]
                    if isinstance(outcome, PermanentSinkError):
                        end_attempt_span(span, str(ErrorClass.PERMANENT), self._short(str(outcome)))
                    else:
                        end_attempt_span(span, None, None)
        self.telemetry.flush_counts()
        return tail.full

    def _row_label(self, row: TailRow) -> str:
        """The event label of a row whose envelope is not to be trusted: its ``event_type``
        column's, as the main lane counts it, where the round read it; else ``other``."""
        if row.columns is None:
            return OTHER_EVENT_TYPE
        columns = row.columns if isinstance(row.columns, str) else bytes(row.columns).decode("utf-8", "replace")
        values = columns.split(ROW_COLUMNS_SEPARATOR)
        return self.router.event_label(values[ROW_COLUMNS.index("event_type")])

    def _traced(self, to_send: list[tuple[TailRow, EventEnvelope]]) -> list[tuple[int, Span]]:
        """A span, started now, for each event of the batch whose envelope carries a sampled
        ``traceparent`` (with its index in the batch); none for the others, which would cost
        the relay more than the rest of their path."""
        tracer = self.telemetry.tracer
        assert tracer is not None
        traced: list[tuple[int, Span]] = []
        for index, (_, envelope) in enumerate(to_send):
            if envelope.traceparent:
                label = self.router.event_label(envelope.event_type)
                span = sent_in_batch_span(tracer, envelope, label, self._sink_name)
                if span is not None:
                    traced.append((index, span))
        return traced

    def _round_failed(self, exc: Exception) -> None:
        sink_failed = isinstance(exc, BatchFailed | SinkUnreachable)
        error = str(exc) if sink_failed else self._short(describe_round_failure(exc))
        self.health.round_ended(error, sink_failed=sink_failed)
        self.telemetry.round_failed(self.lane)
        self.failing_rounds.failed(error)

    async def _publish(
        self, envelopes: list[EventEnvelope], while_sending: Callable[[], Coroutine[Any, Any, None]]
    ) -> list[PermanentSinkError | None]:
        """The sink's outcome for each envelope; raises :class:`BatchFailed` when the batch
        failed as a whole. The store works meanwhile (``while_sending``, which never raises:
        the cursor's write, the next round's read) while this batch waits for the broker."""
        outcomes: list[PermanentSinkError | None] = []

        async def publish(batch: list[EventEnvelope]) -> None:
            outcomes.extend(await self._sink.publish(batch))

        async with anyio.create_task_group() as database:
            database.start_soon(while_sending)
            await anyio.lowlevel.checkpoint()  # its statement is sent before the batch is built
            # The broker's time, bounded by publish_timeout: not the round's query_timeout.
            with database_deadline_paused():
                failure = await self.attempts.run(self._sink_name, publish, envelopes)
        if failure is not None:
            raise BatchFailed(failure)
        return outcomes

    async def _keep_lane_until_sink_answers(self, kept: KeptLane | None) -> bool:
        """After a batch the sink failed, with the round rolled back and the lane ``kept``
        (None: another process took it in between): ask the sink again each ``poll_interval``
        while the other processes find the lane taken (each would send the batch again, a copy
        queued in its producer and written once the broker is back). True once the sink
        answers; False when it has not within ``SINK_WAIT_HOLDS_LANE`` publish timeouts, or the
        relay stops, letting the lane go to a process that may reach the sink (this one may be
        cut off from it alone)."""
        if kept is None or getattr(self._sink, "reachable", None) is None:
            return False
        give_up_at = anyio.current_time() + SINK_WAIT_HOLDS_LANE * self.publish_timeout
        while True:
            try:
                with database_deadline_paused():  # each wait has a bound of its own
                    await self._sink_reachable()
                return True
            except SinkUnreachable as exc:
                self._round_failed(exc)  # counted as the waits outside a round are
            if anyio.current_time() >= give_up_at:
                return False
            with database_deadline_paused(), anyio.move_on_after(self.poll_interval):
                await self._stopping.wait()
            if self._stopping.is_set():
                return False
            await kept()

    async def _sink_reachable(self) -> None:
        """Return once the sink answers (its optional ``reachable``), within ``publish_timeout``;
        raise :class:`SinkUnreachable` otherwise."""
        reachable = getattr(self._sink, "reachable", None)
        if reachable is None:
            return
        try:
            with anyio.fail_after(self.publish_timeout):
                await reachable()
        except TimeoutError:
            raise SinkUnreachable(
                f"sink {self._sink_name} did not answer within publish_timeout ({self.publish_timeout:g}s);"
                " no round runs until it does"
            ) from None
        except Exception as exc:
            raise SinkUnreachable(self._short(f"sink {self._sink_name} unreachable: {describe(exc)}")) from None

    def _count(self, event_label: str, error_class: str | None, events: int = 1) -> None:
        """``events`` published (``error_class`` None) or parked (a failure: this relay parks
        every row it does not send), on the delivery counters."""
        if not self.telemetry.metrics_enabled:
            return
        metrics = self.telemetry.metrics
        labels = {"sink": self._sink_name, "event_type": event_label}
        if error_class is None:
            self.telemetry.count(metrics.success, labels, events)
        else:
            self.telemetry.count(metrics.failure, {**labels, "error_class": error_class}, events)
            self.telemetry.count(metrics.parked, {**labels, "error_class": error_class}, events)

    @property
    def _sink_name(self) -> str:
        (name,) = self.router.sinks  # a lane of its own has one sink
        return name

    @property
    def _sink(self) -> OrderedLogSink:
        (sink,) = self.router.sinks.values()  # a lane of its own has one sink
        assert isinstance(sink, OrderedLogSink)
        return sink

    def _short(self, text: str) -> str:
        return error_text(self.redactor, text)


__all__ = ["TailRelay"]
