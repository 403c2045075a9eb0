"""Handling a message by one handler: its processed record committed in the same transaction
as the handler's writes, so a message handled once is never handled again (a duplicate finds
its record and is skipped).

Every handling has a deadline (``handler_timeout``), a span (when tracing is on) and its
metrics. A failure is recorded before the handling returns: a row in the retry table, due
after the retry policy's delay, or a dead letter once the policy gives up (at once for a
:class:`PermanentHandlerError`).
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from room_outbox.attempt.failure import ErrorClass, Failure, describe, error_text, plugin_call
from room_outbox.attempt.pipeline import Attempts
from room_outbox.attempt.retry import RetryPolicy
from room_outbox.consume.dead_letters import DeadLetters
from room_outbox.consume.messages import Message
from room_outbox.consume.registry import BoundHandler
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.handler import BatchHandler, ConsumedEvent, HandleContext, PermanentHandlerError
from room_outbox.observability.metrics import ConsumerMetrics
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.telemetry import Telemetry
from room_outbox.observability.tracing import producer_context
from room_outbox.store.clock import now_ms
from room_outbox.store.consumers.protocol import ConsumerBatch, ConsumerStore, LeaseLost, Processed, RetryRow

log = logging.getLogger("room_outbox.consume")

#: How one handling ended: done (handled, a duplicate, or its retry lease lost to another
#: process), scheduled for a retry, or a dead letter.
Result = Literal["done", "retry", "dead"]


class Handling:
    """Handles one consumer's messages, one handler at a time."""

    def __init__(
        self,
        consumer: str,
        settings: ConsumerSettings,
        store: ConsumerStore,
        telemetry: Telemetry,
        metrics: ConsumerMetrics,
        redactor: Redactor,
        dead_letters: DeadLetters,
    ) -> None:
        self.consumer = consumer
        self.settings = settings
        self.store = store
        self.telemetry = telemetry
        self.metrics = metrics
        self.redactor = redactor
        self.dead_letters = dead_letters
        #: Each handling: its deadline, what its failure means, its span and duration.
        self.attempts = Attempts(redactor, settings.handler_timeout, "handler_timeout", explain_handler_error)
        retry = settings.retry
        self.policy = RetryPolicy(
            strategy="exponential", base=retry.base, factor=retry.factor, cap=retry.cap, jitter=retry.jitter,
            max_attempts=retry.max_attempts, parking=True,
        )  # fmt: skip

    async def handle(
        self,
        message: Message,
        handler: BoundHandler,
        attempt: int,
        retry: RetryRow | None,
        batch: ConsumerBatch | None = None,
        dead: list[tuple[RetryRow, str]] | None = None,
    ) -> Result:
        """Handle ``message`` with ``handler`` once, in ``batch`` (a savepoint of a shared
        transaction) or in a transaction of its own; ``retry``: the retry-table row it comes
        from, if any. A failure is recorded (retry or dead letter) before this returns; dead
        letters to announce once committed go to ``dead``, else are announced at once."""
        assert message.envelope is not None
        envelope = message.envelope
        labels = {"consumer": self.consumer, "handler": handler.name}
        one = _One(self.record(message, handler), self.event(message, attempt), handler, retry, batch)
        observer = _Observed(self._span(message, handler.name, attempt), self.metrics, labels)
        failure = await self.attempts.run(handler.name, self._process, one, observer)
        if failure is not None and failure.error_class is ErrorClass.TIMEOUT and batch is not None:
            # Cancelled mid-statement: the shared transaction is lost, not just this savepoint.
            raise TimeoutError(failure.error)
        if one.lease_lost is not None:
            log.warning("retry lease lost; another process has the row", extra={**labels, "error": one.lease_lost})
            return "done"
        if failure is None:
            self.metrics.handled.add(1, {**labels, "outcome": one.outcome})
            return "done"
        text = failure.error
        extra = {**labels, "event_id": envelope.event_id, "event_type": envelope.event_type,
                 "room_id": envelope.room_id, "attempt": attempt, "error": text}  # fmt: skip
        outcomes: ConsumerBatch | ConsumerStore = batch if batch is not None else self.store
        reason = "permanent" if failure.permanent else "failed"
        if self.policy.parks(attempt, failure.permanent):
            row = message.retry_row(self.consumer, handler.name, attempt, text)
            if retry is None:
                row = await self.write_row(outcomes, row, dead=True) or row
                if dead is not None:
                    dead.append((row, reason))
                else:
                    await self.dead_letters.announce([(row, reason)])
            elif await self.store.retry_failed(retry, attempt, now_ms(), text, dead=True):
                await self.dead_letters.announce([(row, reason)])
            return "dead"
        due = now_ms() + int(self.policy.delay(attempt) * 1000)
        if retry is None:
            refused = await self.write_row(outcomes, message.retry_row(self.consumer, handler.name, attempt, text, due))
            if refused is not None:
                if dead is not None:
                    dead.append((refused, reason))
                else:
                    await self.dead_letters.announce([(refused, reason)])
                return "dead"
        else:
            await self.store.retry_failed(retry, attempt, due, text, dead=False)
        log.warning("handling failed; retry scheduled", extra={**extra, "retry_at_ms": due})
        self.metrics.retried.add(1, labels)
        return "retry"

    async def write_row(
        self, outcomes: ConsumerBatch | ConsumerStore, row: RetryRow, dead: bool = False
    ) -> RetryRow | None:
        """Write ``row`` to the retry table, as a dead letter or (not ``dead``) a retry. When
        the database refuses the row's values in a transaction of the row's own, the message
        becomes the dead letter :func:`minimal_dead_letter` makes of it, which always fits, and
        that row is returned: one message's row must never hold its partition for ever. The
        database unreachable, that write fails too and the error propagates (the batch is
        fetched again). In a shared transaction (``outcomes`` is a batch) any error propagates:
        its messages are then settled again one at a time, each in its own."""
        try:
            if dead:
                await outcomes.dead_letter(row)
            else:
                await outcomes.schedule(row)
            return None
        except Exception as exc:
            if outcomes is not self.store or not self.store.refused(exc):
                raise
            cause = describe(exc)
        minimal = minimal_dead_letter(row, error_text(self.redactor, cause))
        await self.store.dead_letter(minimal)
        return minimal

    async def _process(self, one: _One) -> None:
        """The handling itself: the processed record and the handler's writes, one transaction."""
        store, batch = self.store, one.batch
        processing = batch.processing(one.record) if batch is not None else store.processing(one.record, one.retry)
        try:
            async with processing as tx:
                if tx is None:
                    one.outcome = "duplicate"
                else:
                    with plugin_call():  # its KeyboardInterrupt, say, rolls back like any failure
                        await one.handler.handler.handle(one.event, HandleContext(tx, log))
        except LeaseLost as exc:  # not a failure of this handling: another process has it
            one.lease_lost = str(exc)

    async def handle_many(self, messages: list[Message], handler: BoundHandler) -> set[tuple[int, int, str]]:
        """``messages`` for the batch handler ``handler`` in one ``handle_batch`` call and one
        transaction; returns the (partition, offset, handler) handlings committed, none when
        the call or the transaction failed (then each message goes through ``handle`` on its
        own, so a bad one costs only itself)."""
        if not messages:
            return set()
        many = _Many([self.record(m, handler) for m in messages], [self.event(m, 1) for m in messages], handler)
        labels = {"consumer": self.consumer, "handler": handler.name}
        spans = [self._start_span(m, handler.name, 1) for m in messages] if self.telemetry.tracer else []
        observer = _ObservedMany(spans, self.metrics, labels, len(messages))
        failure = await self.attempts.run(handler.name, self._process_many, many, observer)
        if failure is not None:
            log.info(
                "handle_batch failed; handling one by one",
                extra={**labels, "messages": len(messages), "error": failure.error},
            )
            return set()
        self.metrics.handled.add(many.new, {**labels, "outcome": "handled"})
        if many.new < len(messages):
            self.metrics.handled.add(len(messages) - many.new, {**labels, "outcome": "duplicate"})
        return {(m.partition, m.offset, handler.name) for m in messages}

    async def _process_many(self, many: _Many) -> None:
        async with self.store.processing_many(many.records) as (tx, fresh):
            new = [event for event, first in zip(many.events, fresh, strict=True) if first]
            if new:
                assert isinstance(many.handler.handler, BatchHandler)
                with plugin_call():
                    await many.handler.handler.handle_batch(new, HandleContext(tx, log))
        many.new = len(new)

    def record(self, message: Message, handler: BoundHandler) -> Processed:
        """The processed record that marks ``message`` handled by ``handler``."""
        assert message.envelope is not None
        return Processed(
            self.consumer, handler.name, message.envelope.app_code, message.envelope.event_id, message.topic,
            message.partition, message.offset,
        )  # fmt: skip

    def event(self, message: Message, attempt: int) -> ConsumedEvent:
        """``message`` as the handler is given it."""
        assert message.envelope is not None
        return ConsumedEvent(
            envelope=message.envelope, consumer=self.consumer, topic=message.topic, partition=message.partition,
            offset=message.offset, key=message.key, headers=message.headers, attempt=attempt, value=message.value,
        )  # fmt: skip

    def _span(self, message: Message, handler: str, attempt: int) -> trace.Span | None:
        """The span of one handling, a child of the message's ``traceparent`` (no tracer: none)."""
        return self._start_span(message, handler, attempt) if self.telemetry.tracer is not None else None

    def _start_span(self, message: Message, handler: str, attempt: int) -> trace.Span:
        tracer = self.telemetry.tracer
        assert tracer is not None
        attributes: dict[str, str | int] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.destination.name": message.topic,
            "messaging.destination.partition.id": str(message.partition),
            "messaging.kafka.offset": message.offset,
            "messaging.consumer.group.name": self.settings.group(self.consumer),
            "room_outbox.consumer": self.consumer,
            "room_outbox.handler": handler,
            "room_outbox.event_id": message.event_id,
            "room_outbox.event_type": message.event_type,
            "room_outbox.attempt": attempt,
        }
        return tracer.start_span(
            f"process {message.topic} {handler}", context=producer_context(message.traceparent),
            kind=SpanKind.CONSUMER, attributes=attributes, record_exception=False, set_status_on_exception=False,
        )  # fmt: skip


def minimal_dead_letter(row: RetryRow, cause: str) -> RetryRow:
    """The dead letter of a message whose row the database refused: where the message is
    (topic, partition, offset: the whole of it is still there) and why, its handler, and
    nothing else that came from the message, so that it fits whatever the message holds. Its
    event id is made of where it is: one per message."""
    where = f"{row.topic}:{row.partition}:{row.offset}"
    return RetryRow(
        consumer=row.consumer, handler=row.handler, app_code="", event_id=where, event_type="",
        room_key=f"@{row.partition}:{row.offset}", topic=row.topic, partition=row.partition, offset=row.offset,
        value=b"", headers={}, attempts=row.attempts, due_at_ms=0,
        last_error=f"the database refused this message's row ({cause}); its value and headers are left out:"
        f" the message is at topic {row.topic} partition {row.partition} offset {row.offset}",
    )  # fmt: skip


def explain_handler_error(handler: str, exc: Exception) -> tuple[ErrorClass, str, float | None]:
    """A handler's exception: a :class:`PermanentHandlerError` is a dead letter at once,
    anything else is retried."""
    error_class = ErrorClass.PERMANENT if isinstance(exc, PermanentHandlerError) else ErrorClass.RETRYABLE
    return error_class, f"{handler}: {describe(exc)}", None


@dataclass
class _One:
    """One handling under way, and what it found out."""

    record: Processed
    event: ConsumedEvent
    handler: BoundHandler
    retry: RetryRow | None
    batch: ConsumerBatch | None
    outcome: str = "handled"  # or "duplicate": its record was there already
    #: Set when the retry row's lease was lost (another process has the row): why.
    lease_lost: str | None = None


@dataclass
class _Many:
    """One ``handle_batch`` call under way: how many of its messages were new."""

    records: list[Processed]
    events: list[ConsumedEvent]
    handler: BoundHandler
    new: int = 0


class _Observed:
    """The span and the duration of one handling (an attempt's observer)."""

    def __init__(self, span: trace.Span | None, metrics: ConsumerMetrics, labels: dict[str, str]) -> None:
        self.span = span
        self.metrics = metrics
        self.labels = labels
        self.started = time.perf_counter()

    def current(self, name: str) -> AbstractContextManager[Any]:
        if self.span is None:
            return nullcontext()
        return trace.use_span(self.span, end_on_exit=False, record_exception=False, set_status_on_exception=False)

    def finish(self, failure: Failure | None) -> None:
        self.metrics.duration.record(time.perf_counter() - self.started, self.labels)
        if self.span is None:
            return
        if failure is not None:
            self.span.set_attribute("error.type", str(failure.error_class))
            self.span.set_status(Status(StatusCode.ERROR, failure.error))
        self.span.end()


class _ObservedMany:
    """The spans of a ``handle_batch`` call's messages, and its time shared out among them."""

    def __init__(self, spans: list[trace.Span], metrics: ConsumerMetrics, labels: dict[str, str], count: int) -> None:
        self.spans = spans
        self.metrics = metrics
        self.labels = labels
        self.count = count
        self.started = time.perf_counter()

    def current(self, name: str) -> AbstractContextManager[None]:
        return nullcontext()

    def finish(self, failure: Failure | None) -> None:
        for span in self.spans:
            span.end()
        if failure is None:  # a failed call's messages are handled again one by one, and timed then
            share = (time.perf_counter() - self.started) / self.count
            for _ in range(self.count):
                self.metrics.duration.record(share, self.labels)
