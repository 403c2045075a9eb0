"""One consumer (``consumers.<name>``) in one process: a Kafka consumer-group member handling
the partitions it is assigned, and a retry worker on the shared retry table.

**Settling a fetched batch.** Messages are grouped by key (a room): groups run in parallel up
to ``concurrency``, a group's messages one after another in offset order. Each message goes to
every handler that takes its type and ends *settled*: handled (its processed record committed
with the handler's writes), scheduled for a retry, or a dead letter, each durable in the
database. Handlers that take many events at once (``handle_batch``) get the whole batch, every
room in offset order, in one transaction per handler first; the rest runs per message. Only
when the whole batch is settled are its offsets committed, so a crash re-delivers and never
skips; what was handled before the crash finds its record and is not handled again.

**Reading ahead.** While a batch settles, the next one is taken from what the broker has sent
already, routed, and its rooms held back by retries looked up; what the settling batch puts in
the retry table is added to those once it has settled. It is only read ahead: when the batch
before is not settled it is dropped and its partitions sought back; when partitions were
revoked meanwhile it is dropped (the new assignment reads from the committed offsets).

**Rebalances.** The batch in progress holds a lock that the revocation callback waits for:
partitions move to another member only after this member's batch is settled and committed,
so no message is handled by two members at the same time.

**Retries keep a room's order.** A failed handling goes to ``room_consumer_retry`` and the
partition moves on. With ``ordering: per_room`` later messages of the same room and handler
queue behind it in the table, and the retry worker takes only each room's first row: the room
is handled in order, the rest of the partition is not held up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from anyio.abc import TaskStatus
from anyio.lowlevel import checkpoint
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from room_outbox.consume.registry import BoundHandler
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.delivery.retry import RetryPolicy
from room_outbox.envelope import KNOWN_EVENT_TYPES, EnvelopeError, EventEnvelope, parse_envelope
from room_outbox.handler import BatchHandler, ConsumedEvent, HandleContext, PermanentHandlerError
from room_outbox.observability.metrics import ConsumerMetrics
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.telemetry import Telemetry
from room_outbox.observability.tracing import producer_context
from room_outbox.store.clock import now_ms
from room_outbox.store.consumers.protocol import (
    NO_HANDLER,
    ROOM_KEY_MAX,
    ConsumerBatch,
    ConsumerStore,
    LeaseLost,
    Processed,
    RetryRow,
)

log = logging.getLogger("room_outbox.consume")

FETCH_TIMEOUT_MS = 500
#: Pause after a batch could not be settled (the database is down, say) before it is tried again.
BATCH_RETRY_PAUSE = 1.0
#: How long a batch's dead-letter copies may take, together (not each: a topic that refuses
#: them would hold the partition this long once per copy).
DLQ_SEND_TIMEOUT = 10.0
#: The last offset commit, when the consumer stops.
COMMIT_TIMEOUT = 10.0
#: Messages routed between two checkpoints, so that routing a batch read ahead holds up the
#: settling batch's database statements by no more than this many messages' parsing.
ROUTE_SLICE = 50
#: Event types whose handlers are remembered: a topic full of made-up types stays bounded.
MAX_EVENT_TYPES_KEPT = 1000
#: One attempt to reach the broker and join the group; then a pause before the next.
JOIN_TIMEOUT = 30.0
JOIN_RETRY_PAUSE = 2.0


@dataclass
class Message:
    """A fetched message, parsed and routed once."""

    topic: str
    partition: int
    offset: int
    key: str
    value: bytes
    headers: dict[str, str]
    envelope: EventEnvelope | None = None
    #: Why it is a dead letter before any handler (unparsable, unknown type); None otherwise.
    rejected: str | None = None
    handlers: list[BoundHandler] = field(default_factory=list)

    @property
    def room(self) -> str:
        # No key: nothing to keep in order with; each such message is a group of its own.
        return self.key or f"@{self.partition}:{self.offset}"

    @property
    def held_key(self) -> str:
        """The room as the retry table keeps it (and so as held-back rooms are compared)."""
        return self.room[:ROOM_KEY_MAX]

    @property
    def app_code(self) -> str:
        if self.envelope is not None:
            return self.envelope.app_code
        return self.key.split(":", 1)[0] if ":" in self.key else ""

    @property
    def event_id(self) -> str:
        if self.envelope is not None:
            return self.envelope.event_id
        return self.headers.get("event_id") or f"{self.topic}:{self.partition}:{self.offset}"

    @property
    def traceparent(self) -> str | None:
        """The producer's trace: the header the Kafka sink sets, else the envelope's own."""
        return self.headers.get("traceparent") or (self.envelope.traceparent if self.envelope is not None else None)

    @property
    def event_type(self) -> str:
        return self.envelope.event_type if self.envelope is not None else self.headers.get("event_type", "")


@dataclass
class Fetched:
    """A fetched batch, routed: its messages by room, each partition's first offset (to
    fetch it again) and the offsets to commit once it is settled."""

    rooms: dict[str, list[Message]]
    first: dict[TopicPartition, int]
    offsets: dict[TopicPartition, int]
    #: :attr:`Consumer._generation` when fetched: a revocation since makes it stale.
    generation: int
    #: (handler, room) pairs with rows retrying when looked up while the batch before
    #: settled; None: not looked up yet.
    blocked: set[tuple[str, str]] | None = None
    #: Its (message, handler) handlings and its messages rejected before any handler: when
    #: the batch handlers have done every handling and none is rejected, nothing is left.
    handlings: int = 0
    rejected: int = 0


def _headers(raw: Any) -> dict[str, str]:
    return {str(k): (v or b"").decode("utf-8", "replace") for k, v in (raw or ())}


class Consumer:
    def __init__(
        self,
        name: str,
        settings: ConsumerSettings,
        store: ConsumerStore,
        handlers: dict[str, BoundHandler],
        node_id: str,
        redactor: Redactor,
        telemetry: Telemetry,
    ) -> None:
        self.name = name
        self.settings = settings
        self.store = store
        self.handlers = handlers
        self.owner = f"{node_id}#{name}"
        self.redactor = redactor
        self.telemetry = telemetry
        self.metrics = ConsumerMetrics(telemetry.meter, name, handlers)
        self.ordered = settings.ordering == "per_room"
        retry = settings.retry
        self.policy = RetryPolicy(
            strategy="exponential", base=retry.base, factor=retry.factor, cap=retry.cap, jitter=retry.jitter,
            max_attempts=retry.max_attempts, parking=True,
        )  # fmt: skip
        self.lease_ms = int((2 * settings.handler_timeout + 5) * 1000)
        self.running = False
        self._stop = anyio.Event()
        self._batch_lock = anyio.Lock()
        #: Counts revocations; a batch fetched under an older count is not settled.
        self._generation = 0
        #: Offsets of batches settled and not committed yet, and where they are committed.
        self._settled: dict[TopicPartition, int] = {}
        self._kafka: AIOKafkaConsumer | None = None
        #: (handler, room) pairs the settling batch has put in the retry table.
        self._retrying: set[tuple[str, str]] = set()
        self._limiter = anyio.CapacityLimiter(settings.concurrency)
        self._dlq: AIOKafkaProducer | None = None
        self._batch_handlers = [h for h in handlers.values() if isinstance(h.handler, BatchHandler)]
        #: The handlers that take each event type met so far (the handlers never change).
        self._handlers_of: dict[str, list[BoundHandler]] = {}

    def stop(self) -> None:
        self._stop.set()

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Join the group (again and again while the broker does not answer) and consume
        until :meth:`stop`; the retry worker runs from the start, broker or not."""
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._retry_loop)
                kafka = await self._join()
                if kafka is not None:
                    self.running = True
                    task_status.started()
                    try:
                        await self._live_loop(kafka)
                    finally:
                        self.running = False
                        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                            await kafka.stop()  # leaves the group: the others take over at once
                tasks.cancel_scope.cancel()
        finally:
            if self._dlq is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                    await self._dlq.stop()
            log.info("consumer stopped", extra={"lifecycle": "consumer_stopped", "consumer": self.name})

    async def _join(self) -> AIOKafkaConsumer | None:
        """A started group member; None when stopped before the broker answered."""
        s = self.settings
        while not self._stop.is_set():
            kafka = AIOKafkaConsumer(
                bootstrap_servers=s.bootstrap_servers,
                group_id=s.group(self.name),
                client_id=s.client_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                session_timeout_ms=int(s.session_timeout * 1000),
                heartbeat_interval_ms=max(100, int(s.session_timeout * 1000 / 3)),
                rebalance_timeout_ms=int(rebalance_timeout(s, len(self._batch_handlers)) * 1000),
                max_poll_records=s.max_batch,
                **s.security.client_kwargs(),
            )
            kafka.subscribe([s.topic], listener=_SettleBeforeRevoke(self))
            try:
                with anyio.fail_after(JOIN_TIMEOUT):
                    await kafka.start()
            except (KafkaError, TimeoutError, OSError) as exc:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await kafka.stop()
                log.warning(
                    "broker unavailable; trying again",
                    extra={"consumer": self.name, "bootstrap_servers": s.bootstrap_servers, "error": self._error(exc)},
                )
                with anyio.move_on_after(JOIN_RETRY_PAUSE):
                    await self._stop.wait()
                continue
            log.info(
                "consumer started",
                extra={"lifecycle": "consumer_started", "consumer": self.name, "group": s.group(self.name),
                       "topic": s.topic, "handlers": list(self.handlers)},
            )  # fmt: skip
            return kafka
        return None

    async def _live_loop(self, kafka: AIOKafkaConsumer) -> None:
        """Fetch, settle, commit, one batch after another, the next read ahead while one
        settles (mostly a wait on the database), so its routing and look-up are off the
        critical path. A settled batch's offsets are committed while the next one settles,
        or at once when nothing more comes, partitions are revoked or the consumer stops."""
        ahead: Fetched | None = None
        retrying: set[tuple[str, str]] = set()  # what the batch before put in the retry table
        self._kafka = kafka
        try:
            while not self._stop.is_set():
                ahead, retrying = await self._next_batch(kafka, ahead, retrying)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(COMMIT_TIMEOUT):
                await self._commit_settled()
            self._kafka = None

    async def _next_batch(
        self, kafka: AIOKafkaConsumer, ahead: Fetched | None, retrying: set[tuple[str, str]]
    ) -> tuple[Fetched | None, set[tuple[str, str]]]:
        """Settle one batch (``ahead`` if read already); returns the batch read ahead
        meanwhile and what this one put in the retry table."""
        fetched = ahead or await self._fetch(kafka, FETCH_TIMEOUT_MS)
        if fetched is None:
            async with self._batch_lock:
                await self._commit_settled()
            return None, retrying
        async with self._batch_lock:
            if fetched.generation != self._generation:
                return None, set()
            following: list[Fetched] = []
            error: Exception | None = None
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._fetch_ahead, kafka, following)
                tasks.start_soon(self._commit_settled)
                try:
                    retrying = await self._settle(fetched, retrying)
                except Exception as exc:
                    error = exc
            ahead = following[0] if following else None
            if error is None:
                self._settled.update(fetched.offsets)
                return ahead, retrying
            # Nothing of this batch is committed: fetch it again from its first offsets after a
            # pause; what it settled already is found as processed.
            log.error(
                "batch not settled; fetching it again", extra={"consumer": self.name, "error": self._error(error)}
            )
            for tp, offset in {**(ahead.first if ahead else {}), **fetched.first}.items():
                kafka.seek(tp, offset)
            with anyio.move_on_after(BATCH_RETRY_PAUSE):
                await self._stop.wait()
            return None, set()

    async def _commit_settled(self) -> None:
        """Commit the offsets of the batches settled since the last commit."""
        offsets, self._settled = self._settled, {}
        if not offsets or self._kafka is None:
            return
        try:
            await self._kafka.commit(offsets)
        except KafkaError as exc:
            # The partitions moved on (a rebalance): their new owner re-reads from the last
            # commit and finds these messages processed.
            log.warning("offset commit failed", extra={"consumer": self.name, "error": self._error(exc)})
            return
        self._record_lag(self._kafka, offsets)

    async def _fetch(self, kafka: AIOKafkaConsumer, timeout_ms: int) -> Fetched | None:
        """The next batch, routed; None when none came within ``timeout_ms``."""
        batch = await kafka.getmany(timeout_ms=timeout_ms, max_records=self.settings.max_batch)
        if not batch:
            return None
        fetched = Fetched(
            rooms={}, generation=self._generation,
            first={tp: records[0].offset for tp, records in batch.items()},
            offsets={tp: records[-1].offset + 1 for tp, records in batch.items()},
        )  # fmt: skip
        for n, record in enumerate(record for records in batch.values() for record in records):
            if n % ROUTE_SLICE == ROUTE_SLICE - 1:
                await checkpoint()  # the settling batch's statements go on meanwhile
            message = self._route(record)
            fetched.rooms.setdefault(message.room, []).append(message)
            fetched.handlings += len(message.handlers)
            fetched.rejected += message.rejected is not None
        return fetched

    async def _fetch_ahead(self, kafka: AIOKafkaConsumer, into: list[Fetched]) -> None:
        """The next batch, routed, and its rooms held back by retries as they are now (what
        the settling batch puts in the retry table is added when it has settled)."""
        try:
            fetched = await self._fetch(kafka, 0)
        except KafkaError:
            return  # the next plain fetch meets it again
        if fetched is None:
            return
        into.append(fetched)
        if self.ordered:
            try:
                fetched.blocked = await self.store.blocked_rooms(self.name, set(fetched.rooms))
            except Exception:
                return  # settling it looks again

    def _record_lag(self, kafka: AIOKafkaConsumer, offsets: dict[TopicPartition, int]) -> None:
        for tp, committed in offsets.items():
            high = kafka.highwater(tp)
            if high is not None:
                self.metrics.lag.set(
                    max(0, high - committed), {"consumer": self.name, "topic": tp.topic, "partition": tp.partition}
                )

    # -- the live path ------------------------------------------------------------------------

    async def _settle(self, fetched: Fetched, retrying: set[tuple[str, str]]) -> set[tuple[str, str]]:
        """Settle the batch; ``retrying``: the (handler, room) pairs the batch before put in
        the retry table. Returns those this one put there."""
        rooms = fetched.rooms
        blocked: set[tuple[str, str]] = set()
        if self.ordered:
            looked_up = fetched.blocked
            if looked_up is None:
                looked_up = await self.store.blocked_rooms(self.name, set(rooms))
            blocked = looked_up | retrying
        self._retrying = set()
        done = await self._settle_batch_handlers(list(rooms.values()), blocked) if self._batch_handlers else set()
        # What is left (handlers one message at a time, dead letters, the batch handlers'
        # fallback): up to `concurrency` chunks of whole rooms, each settled in one transaction.
        if len(done) == fetched.handlings and not fetched.rejected:
            return self._retrying
        groups = [room for room in rooms.values() if self._unsettled(room, done)]
        width = min(self.settings.concurrency, len(groups))
        async with anyio.create_task_group() as tasks:
            for n in range(width):
                tasks.start_soon(self._settle_chunk, groups[n::width], blocked, done)
        return self._retrying

    @staticmethod
    def _unsettled(room: list[Message], done: AbstractSet[tuple[int, int, str]]) -> bool:
        return any(
            m.rejected is not None or any((m.partition, m.offset, h.name) not in done for h in m.handlers) for m in room
        )

    async def _settle_batch_handlers(
        self, rooms: list[list[Message]], blocked: set[tuple[str, str]]
    ) -> set[tuple[int, int, str]]:
        """Every room of the fetch for each batch handler: one ``handle_batch`` call and one
        transaction per handler, its processed records one multi-row statement. Parallel
        transactions would only add commits: the work is a few multi-row statements whatever
        the number of messages. Returns the (partition, offset, handler) handlings committed."""
        done: set[tuple[int, int, str]] = set()
        for handler in self._batch_handlers:
            done |= await self._handle_many(rooms, handler, blocked)
        return done

    async def _settle_chunk(
        self, rooms: list[list[Message]], blocked: set[tuple[str, str]], done: AbstractSet[tuple[int, int, str]]
    ) -> None:
        """The rooms' messages in one transaction (each handling in a savepoint), one room
        after another, but the handlings in ``done``. If that transaction cannot complete (a
        handler timed out, the connection broke), everything in it is rolled back and the
        messages are settled again one transaction each."""
        dead: list[tuple[RetryRow, str]] = []
        messages = sum(len(room) for room in rooms)
        limit = self.settings.handler_timeout * (messages + 1)
        try:
            with anyio.fail_after(limit):
                async with self.store.batch(limit) as batch:
                    for room in rooms:
                        await self._settle_room(room, blocked, batch, dead, done)
        except Exception as exc:
            log.warning(
                "chunk not settled in one transaction; settling its messages one by one",
                extra={"consumer": self.name, "messages": messages, "error": self._error(exc)},
            )
            dead = []
            for room in rooms:
                await self._settle_room(room, blocked, None, dead, done)
        await self._announce_dead_letters(dead)

    def _route(self, record: Any) -> Message:
        message = Message(
            topic=record.topic, partition=record.partition, offset=record.offset,
            key=(record.key or b"").decode("utf-8", "replace"), value=record.value or b"",
            headers=_headers(record.headers),
        )  # fmt: skip
        try:
            message.envelope = parse_envelope(message.value)
        except EnvelopeError as exc:
            message.rejected = f"unparsable value: {exc}"
            return message
        self._choose_handlers(message)
        return message

    def _choose_handlers(self, message: Message) -> None:
        assert message.envelope is not None
        event_type = message.envelope.event_type
        handlers = self._handlers_of.get(event_type)
        if handlers is None:
            handlers = [h for h in self.handlers.values() if h.takes(event_type)]
            if len(self._handlers_of) < MAX_EVENT_TYPES_KEPT:
                self._handlers_of[event_type] = handlers
        message.handlers = handlers
        if not message.handlers and event_type not in KNOWN_EVENT_TYPES:
            message.rejected = f"unknown event type {event_type!r}: no handler of consumer {self.name} takes it"

    async def _settle_room(
        self,
        messages: list[Message],
        blocked: set[tuple[str, str]],
        batch: ConsumerBatch | None,
        dead: list[tuple[RetryRow, str]],
        done: AbstractSet[tuple[int, int, str]] = frozenset(),
    ) -> None:
        """One room's messages in offset order (but the (partition, offset, handler) handlings
        in ``done``). A handler that fails on one of them holds back the room's later
        messages for that handler (with ``ordering: per_room``): they wait in the retry table
        behind it."""
        outcomes: ConsumerBatch | ConsumerStore = batch if batch is not None else self.store
        held: set[str] = {handler for handler, room in blocked if room == messages[0].held_key}
        for message in messages:
            if message.rejected is not None:
                row = self._retry_row(message, NO_HANDLER, 1, message.rejected)
                await outcomes.dead_letter(row)
                dead.append((row, "rejected"))
                continue
            for handler in message.handlers:
                if (message.partition, message.offset, handler.name) in done:
                    continue
                if handler.name in held:
                    await outcomes.schedule(
                        self._retry_row(message, handler.name, 0, "waiting behind an earlier event of its room")
                    )
                    self._retrying.add((handler.name, message.held_key))
                    continue
                ok = await self._handle(message, handler, attempt=1, retry=None, batch=batch, dead=dead)
                if not ok and self.ordered:
                    held.add(handler.name)

    async def _handle_many(
        self, rooms: list[list[Message]], handler: BoundHandler, blocked: set[tuple[str, str]]
    ) -> set[tuple[int, int, str]]:
        """The rooms' messages for ``handler`` in one ``handle_batch`` call and one transaction
        (rooms it holds back excepted); returns the handlings committed, none when the call or
        the transaction failed (then each message goes through ``handle`` on its own, so a
        bad one costs only itself)."""
        messages = [
            m for room in rooms for m in room
            if m.rejected is None and handler in m.handlers and (handler.name, m.held_key) not in blocked
        ]  # fmt: skip
        if not messages:
            return set()
        records = [self._record(m, handler) for m in messages]
        events = [self._event(m, 1) for m in messages]
        labels = {"consumer": self.name, "handler": handler.name}
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
                extra={**labels, "messages": len(messages), "error": self._error(exc)},
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

    def _record(self, message: Message, handler: BoundHandler) -> Processed:
        assert message.envelope is not None
        return Processed(
            self.name, handler.name, message.envelope.app_code, message.envelope.event_id, message.topic,
            message.partition, message.offset,
        )  # fmt: skip

    def _event(self, message: Message, attempt: int) -> ConsumedEvent:
        assert message.envelope is not None
        return ConsumedEvent(
            envelope=message.envelope, consumer=self.name, topic=message.topic, partition=message.partition,
            offset=message.offset, key=message.key, headers=message.headers, attempt=attempt, value=message.value,
        )  # fmt: skip

    def _retry_row(self, message: Message, handler: str, attempts: int, error: str | None, due: int = 0) -> RetryRow:
        return RetryRow(
            consumer=self.name, handler=handler, app_code=message.app_code, event_id=message.event_id[:128],
            event_type=message.event_type[:64], room_key=message.room, topic=message.topic,
            partition=message.partition, offset=message.offset, value=message.value, headers=message.headers,
            attempts=attempts, due_at_ms=due, last_error=error,
        )  # fmt: skip

    # -- one handling -------------------------------------------------------------------------

    async def _handle(
        self,
        message: Message,
        handler: BoundHandler,
        attempt: int,
        retry: RetryRow | None,
        batch: ConsumerBatch | None = None,
        dead: list[tuple[RetryRow, str]] | None = None,
    ) -> bool:
        """Handle ``message`` with ``handler`` once, in ``batch`` (a savepoint of a shared
        transaction) or in a transaction of its own. A failure is recorded (retry or dead
        letter) before this returns; dead letters to announce once committed go to ``dead``.
        True when the message is done for this handler."""
        assert message.envelope is not None
        envelope = message.envelope
        record = self._record(message, handler)
        event = self._event(message, attempt)
        labels = {"consumer": self.name, "handler": handler.name}
        started = time.perf_counter()
        error: BaseException | None = None
        outcome = "handled"
        with self._span(message, handler.name, attempt) as span:
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
                return True
            except Exception as exc:
                error = exc
                if span is not None:
                    span.set_attribute("error.type", type(exc).__name__)
                    span.set_status(Status(StatusCode.ERROR))
        self.metrics.duration.record(time.perf_counter() - started, labels)
        if error is None:
            self.metrics.handled.add(1, {**labels, "outcome": outcome})
            return True
        text = self._error(error)
        permanent = isinstance(error, PermanentHandlerError)
        extra = {**labels, "event_id": envelope.event_id, "event_type": envelope.event_type,
                 "room_id": envelope.room_id, "attempt": attempt, "error": text}  # fmt: skip
        outcomes: ConsumerBatch | ConsumerStore = batch if batch is not None else self.store
        reason = "permanent" if permanent else "failed"
        if self.policy.parks(attempt, permanent):
            row = self._retry_row(message, handler.name, attempt, text)
            if retry is None:
                await outcomes.dead_letter(row)
                if dead is not None:
                    dead.append((row, reason))
                else:
                    await self._announce_dead_letter(row, reason)
            elif await self.store.retry_failed(retry, attempt, now_ms(), text, dead=True):
                await self._announce_dead_letter(row, reason)
            return False
        due = now_ms() + int(self.policy.delay(attempt) * 1000)
        log.warning("handling failed; retry scheduled", extra={**extra, "retry_at_ms": due})
        self.metrics.retried.add(1, labels)
        if retry is None:
            await outcomes.schedule(self._retry_row(message, handler.name, attempt, text, due))
            self._retrying.add((handler.name, message.held_key))
        else:
            await self.store.retry_failed(retry, attempt, due, text, dead=False)
        return False

    def _span(self, message: Message, handler: str, attempt: int) -> Any:
        """A span per handling, current while it runs, child of the message's
        ``traceparent`` (no tracer: none)."""
        tracer = self.telemetry.tracer
        if tracer is None:
            return _NoSpan()
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
            "messaging.consumer.group.name": self.settings.group(self.name),
            "room_outbox.consumer": self.name,
            "room_outbox.handler": handler,
            "room_outbox.event_id": message.event_id,
            "room_outbox.event_type": message.event_type,
            "room_outbox.attempt": attempt,
        }
        return tracer.start_span(
            f"process {message.topic} {handler}", context=producer_context(message.traceparent),
            kind=SpanKind.CONSUMER, attributes=attributes, record_exception=False, set_status_on_exception=False,
        )  # fmt: skip

    # -- dead letters -------------------------------------------------------------------------

    async def _announce_dead_letter(self, row: RetryRow, reason: str) -> None:
        await self._announce_dead_letters([(row, reason)])

    async def _announce_dead_letters(self, dead: list[tuple[RetryRow, str]]) -> None:
        """Log, count and copy to the dead-letter topic dead letters already recorded."""
        for row, reason in dead:
            log.error(
                "dead letter",
                extra={"consumer": self.name, "handler": row.handler or "(none)", "event_id": row.event_id,
                       "event_type": row.event_type, "topic": row.topic, "partition": row.partition,
                       "offset": row.offset, "attempts": row.attempts, "error": row.last_error},
            )  # fmt: skip
            self.metrics.dead.add(1, {"consumer": self.name, "handler": row.handler or "(none)", "reason": reason})
        await self._publish_dead_letters([row for row, _ in dead])

    async def _publish_dead_letter(self, row: RetryRow) -> None:
        await self._publish_dead_letters([row])

    async def _publish_dead_letters(self, rows: list[RetryRow]) -> None:
        """Copies to the dead-letter topic, the error in their headers, all sent at once and
        awaited together within ``DLQ_SEND_TIMEOUT``. The table rows are the record that counts
        (status, inspect, redrive); a failed copy is logged, not retried."""
        topic = self.settings.dlq_topic()
        if topic is None or not rows:
            return
        try:
            with anyio.fail_after(DLQ_SEND_TIMEOUT):
                producer = await self._dlq_producer()
                sent = [
                    await producer.send(
                        topic, row.value, key=row.room_key.encode(), headers=_dlq_headers(self.name, row)
                    )
                    for row in rows
                ]
                await asyncio.gather(*sent)
        except (KafkaError, TimeoutError, OSError) as exc:
            log.warning(
                "dead letters not copied to their topic (they are in room_consumer_retry)",
                extra={"consumer": self.name, "topic": topic, "event_ids": [row.event_id for row in rows][:20],
                       "dead_letters": len(rows), "error": self._error(exc)},
            )  # fmt: skip

    async def _dlq_producer(self) -> AIOKafkaProducer:
        if self._dlq is None:
            producer = AIOKafkaProducer(
                bootstrap_servers=self.settings.bootstrap_servers, client_id=f"{self.settings.client_id}-dlq",
                acks="all", **self.settings.security.client_kwargs(),
            )  # fmt: skip
            try:
                await producer.start()
            except BaseException:
                await producer.stop()
                raise
            self._dlq = producer
        return self._dlq

    # -- the retry worker ---------------------------------------------------------------------

    async def _retry_loop(self) -> None:
        """Take due rows of ``room_consumer_retry`` (each room's first, when ordered) and
        handle them; again at once while there were any, else after ``retry.poll_interval``."""
        while not self._stop.is_set():
            try:
                rows = await self.store.claim_retries(
                    self.name, self.owner, self.settings.concurrency, self.lease_ms, self.ordered
                )
            except Exception as exc:
                log.warning("retry claim failed", extra={"consumer": self.name, "error": self._error(exc)})
                rows = []
            if not rows:
                with anyio.move_on_after(self.settings.retry.poll_interval):
                    await self._stop.wait()
                continue
            async with anyio.create_task_group() as tasks:
                for row in rows:
                    tasks.start_soon(self._retry_one, row)

    async def _retry_one(self, row: RetryRow) -> None:
        try:
            async with self._limiter:
                if self._stop.is_set():
                    await self.store.release([row])
                    return
                await self._retry(row)
        except Exception as exc:  # the row's lease runs out and it comes back
            log.warning("retry failed to settle", extra={"consumer": self.name, "error": self._error(exc)})

    async def _retry(self, row: RetryRow) -> None:
        message = Message(
            topic=row.topic, partition=row.partition, offset=row.offset, key=row.room_key, value=row.value,
            headers=row.headers,
        )  # fmt: skip
        try:
            message.envelope = parse_envelope(row.value)
        except EnvelopeError as exc:
            message.rejected = f"unparsable value: {exc}"
        if row.handler == NO_HANDLER:
            # A redriven dead letter that no handler was chosen for: route it anew (the
            # consumer's handlers may have changed since).
            if message.rejected is None:
                self._choose_handlers(message)
            if message.rejected is not None or not message.handlers:
                error = message.rejected or f"no handler of consumer {self.name} takes {message.event_type!r}"
                if await self.store.retry_failed(row, row.attempts + 1, now_ms(), error, dead=True):
                    await self._publish_dead_letter(self._retry_row(message, NO_HANDLER, row.attempts + 1, error))
                return
            await self.store.replace(row, [self._retry_row(message, h.name, 0, None) for h in message.handlers])
            return
        handler = self.handlers.get(row.handler)
        if handler is None or message.envelope is None:
            error = message.rejected or f"handler {row.handler!r} is not among consumer {self.name}'s handlers"
            await self.store.retry_failed(row, row.attempts, now_ms(), error, dead=True)
            return
        await self._handle(message, handler, attempt=row.attempts + 1, retry=row)

    def _error(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return self.redactor.redact(text)[:1024]


class _NoSpan:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def rebalance_timeout(settings: ConsumerSettings, batch_handlers: int) -> float:
    """How long the group waits for this member to rejoin in a rebalance. A member gives up
    its partitions only once its batch is settled (:class:`_SettleBeforeRevoke`), so the wait
    must outlast the longest batch its own deadlines allow: each batch handler's call, every
    message twice (in its chunk's transaction, then alone if that one failed), the
    dead-letter copies and the commit. Shorter (aiokafka's default is ``session_timeout``),
    a slow batch would lose its partitions mid-way and its messages be handled again."""
    messages = batch_handlers + 2 * (settings.max_batch + 1)
    batch = settings.handler_timeout * messages + DLQ_SEND_TIMEOUT + COMMIT_TIMEOUT
    return max(settings.session_timeout, batch)


class _SettleBeforeRevoke(ConsumerRebalanceListener):  # type: ignore[misc]
    """Partitions leave this member only once the batch in progress is settled and what is
    settled is committed."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    async def on_partitions_revoked(self, revoked: Any) -> None:
        async with self.consumer._batch_lock:
            self.consumer._generation += 1
            await self.consumer._commit_settled()
            log.info(
                "partitions revoked",
                extra={"consumer": self.consumer.name, "partitions": sorted(tp.partition for tp in revoked)},
            )

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info(
            "partitions assigned",
            extra={"consumer": self.consumer.name, "partitions": sorted(tp.partition for tp in assigned)},
        )


__all__ = ["Consumer"]


def _dlq_headers(consumer: str, row: RetryRow) -> list[tuple[str, bytes]]:
    """The message's own headers but earlier ``dlq.*`` ones, and where and why it died."""
    return [
        *((k, v.encode()) for k, v in row.headers.items() if not k.startswith("dlq.")),
        ("dlq.error", (row.last_error or "")[:1024].encode()),
        ("dlq.consumer", consumer.encode()),
        ("dlq.handler", row.handler.encode()),
        ("dlq.topic", row.topic.encode()),
        ("dlq.partition", str(row.partition).encode()),
        ("dlq.offset", str(row.offset).encode()),
        ("dlq.attempts", str(row.attempts).encode()),
    ]
