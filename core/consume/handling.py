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
from typing import Any, Literal

import anyio
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from room_outbox.attempt.failure import describe, error_text
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
        record = self.record(message, handler)
        event = self.event(message, attempt)
        labels = {"consumer": self.consumer, "handler": handler.name}
        started = time.perf_counter()
        error: BaseException | None = None
        outcome = "handled"
        with self.span(message, handler.name, attempt) as span:
            try:
                with anyio.fail_after(self.settings.handler_timeout):
                    processing = batch.processing(record) if batch is not None else self.store.processing(record, retry)
                    async with processing as tx:
                        if tx is None:
                            outcome = "duplicate"
                        else:
                            await handler.handler.handle(event, HandleContext(tx, log))
            except TimeoutError:
                if batch is not None:
                    raise  # cancelled mid-statement: the shared transaction is lost, not just this savepoint
                error = TimeoutError(f"handling took longer than handler_timeout {self.settings.handler_timeout:g}s")
                if span is not None:
                    span.set_attribute("error.type", "TimeoutError")
                    span.set_status(Status(StatusCode.ERROR))
            except LeaseLost as exc:
                log.warning("retry lease lost; another process has the row", extra={**labels, "error": str(exc)})
                return "done"
            except Exception as exc:
                error = exc
                if span is not None:
                    span.set_attribute("error.type", type(exc).__name__)
                    span.set_status(Status(StatusCode.ERROR))
        self.metrics.duration.record(time.perf_counter() - started, labels)
        if error is None:
            self.metrics.handled.add(1, {**labels, "outcome": outcome})
            return "done"
        text = error_text(self.redactor, describe(error))
        permanent = isinstance(error, PermanentHandlerError)
        extra = {**labels, "event_id": envelope.event_id, "event_type": envelope.event_type,
                 "room_id": envelope.room_id, "attempt": attempt, "error": text}  # fmt: skip
        outcomes: ConsumerBatch | ConsumerStore = batch if batch is not None else self.store
        reason = "permanent" if permanent else "failed"
        if self.policy.parks(attempt, permanent):
            row = message.retry_row(self.consumer, handler.name, attempt, text)
            if retry is None:
                await outcomes.dead_letter(row)
                if dead is not None:
                    dead.append((row, reason))
                else:
                    await self.dead_letters.announce([(row, reason)])
            elif await self.store.retry_failed(retry, attempt, now_ms(), text, dead=True):
                await self.dead_letters.announce([(row, reason)])
            return "dead"
        due = now_ms() + int(self.policy.delay(attempt) * 1000)
        log.warning("handling failed; retry scheduled", extra={**extra, "retry_at_ms": due})
        self.metrics.retried.add(1, labels)
        if retry is None:
            await outcomes.schedule(message.retry_row(self.consumer, handler.name, attempt, text, due))
        else:
            await self.store.retry_failed(retry, attempt, due, text, dead=False)
        return "retry"

    async def handle_many(self, messages: list[Message], handler: BoundHandler) -> set[tuple[int, int, str]]:
        """``messages`` for the batch handler ``handler`` in one ``handle_batch`` call and one
        transaction; returns the (partition, offset, handler) handlings committed, none when
        the call or the transaction failed (then each message goes through ``handle`` on its
        own, so a bad one costs only itself)."""
        if not messages:
            return set()
        records = [self.record(m, handler) for m in messages]
        events = [self.event(m, 1) for m in messages]
        labels = {"consumer": self.consumer, "handler": handler.name}
        spans = [self._start_span(m, handler.name, 1) for m in messages] if self.telemetry.tracer else []
        started = time.perf_counter()
        try:
            with anyio.fail_after(self.settings.handler_timeout):
                async with self.store.processing_many(records) as (tx, fresh):
                    new = [event for event, first in zip(events, fresh, strict=True) if first]
                    if new:
                        assert isinstance(handler.handler, BatchHandler)
                        await handler.handler.handle_batch(new, HandleContext(tx, log))
        except Exception as exc:
            log.info(
                "handle_batch failed; handling one by one",
                extra={**labels, "messages": len(messages), "error": error_text(self.redactor, describe(exc))},
            )
            for span in spans:
                span.end()
            return set()
        elapsed = time.perf_counter() - started
        for span in spans:
            span.end()
        self.metrics.handled.add(len(new), {**labels, "outcome": "handled"})
        if len(new) < len(messages):
            self.metrics.handled.add(len(messages) - len(new), {**labels, "outcome": "duplicate"})
        for _ in messages:  # the call's time, shared out: what one handling cost
            self.metrics.duration.record(elapsed / len(messages), labels)
        return {(m.partition, m.offset, handler.name) for m in messages}

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

    def span(self, message: Message, handler: str, attempt: int) -> AbstractContextManager[Any]:
        """A span per handling, current while it runs, child of the message's
        ``traceparent`` (no tracer: none)."""
        if self.telemetry.tracer is None:
            return nullcontext()
        return trace.use_span(self._start_span(message, handler, attempt), end_on_exit=True)

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
