"""A fetched Kafka message, parsed and routed to its handlers once, and the batch it came in.

A message that cannot be parsed, or whose type is unknown and taken by no handler, is
*rejected* when routed: it becomes a dead letter before any handler sees it. Routing remembers
each event type's handlers, for a bounded number of types, so that a topic full of made-up
types costs no more memory than a few.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition
from anyio.lowlevel import checkpoint

from room_outbox.consume.registry import BoundHandler
from room_outbox.envelope import KNOWN_EVENT_TYPES, EnvelopeError, EventEnvelope, parse_envelope
from room_outbox.store.consumers.protocol import RetryRow, fit_room_key

#: Event types whose handlers are remembered: a topic full of made-up types stays bounded.
MAX_EVENT_TYPES_KEPT = 1000
#: Messages routed between two checkpoints, so that routing a batch read ahead holds up the
#: settling batch's database statements by no more than this many messages' parsing.
ROUTE_SLICE = 50


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
        return fit_room_key(self.room)

    @property
    def app_code(self) -> str:
        if self.envelope is not None:
            return self.envelope.app_code
        return self.key.split(":", 1)[0] if ":" in self.key else ""

    @property
    def event_id(self) -> str:
        if self.envelope is not None:
            return self.envelope.event_id
        # Unparsable: the producer's header names it, unless blank (it would name no event).
        header = self.headers.get("event_id", "")
        return header if header and not header.isspace() else f"{self.topic}:{self.partition}:{self.offset}"

    @property
    def traceparent(self) -> str | None:
        """The producer's trace: the header the Kafka sink sets, else the envelope's own."""
        return self.headers.get("traceparent") or (self.envelope.traceparent if self.envelope is not None else None)

    @property
    def event_type(self) -> str:
        return self.envelope.event_type if self.envelope is not None else self.headers.get("event_type", "")

    def retry_row(self, consumer: str, handler: str, attempts: int, error: str | None, due: int = 0) -> RetryRow:
        """This message's row in the retry table (a retry or a dead letter) for ``handler``; the
        row fits its columns whatever the message holds (:class:`RetryRow`)."""
        return RetryRow(
            consumer=consumer, handler=handler, app_code=self.app_code, event_id=self.event_id,
            event_type=self.event_type, room_key=self.room, topic=self.topic, partition=self.partition,
            offset=self.offset, value=self.value, headers=self.headers, attempts=attempts, due_at_ms=due,
            last_error=error,
        )  # fmt: skip


@dataclass
class Fetched:
    """A fetched batch, routed: its messages by room, each partition's first offset (to
    fetch it again) and the offsets to commit once it is settled."""

    rooms: dict[str, list[Message]]
    first: dict[TopicPartition, int]
    offsets: dict[TopicPartition, int]
    #: The consumer's count of revocations when fetched: a revocation since makes it stale.
    generation: int
    #: (handler, room) pairs with rows retrying when looked up while the batch before
    #: settled; None: not looked up yet.
    blocked: set[tuple[str, str]] | None = None
    #: Its (message, handler) handlings and its messages rejected before any handler: when
    #: the batch handlers have done every handling and none is rejected, nothing is left.
    handlings: int = 0
    rejected: int = 0


class Router:
    """Parses messages and chooses, for each, the consumer's handlers that take its type."""

    def __init__(self, consumer: str, handlers: dict[str, BoundHandler]) -> None:
        self.consumer = consumer
        self.handlers = handlers
        #: The handlers that take each event type met so far (the handlers never change).
        self._handlers_of: dict[str, list[BoundHandler]] = {}

    async def route_batch(self, batch: dict[TopicPartition, list[Any]], generation: int) -> Fetched:
        """A batch of Kafka records (by partition, as fetched) as a routed :class:`Fetched`."""
        fetched = Fetched(
            rooms={}, generation=generation,
            first={tp: records[0].offset for tp, records in batch.items()},
            offsets={tp: records[-1].offset + 1 for tp, records in batch.items()},
        )  # fmt: skip
        for n, record in enumerate(record for records in batch.values() for record in records):
            if n % ROUTE_SLICE == ROUTE_SLICE - 1:
                await checkpoint()  # the settling batch's statements go on meanwhile
            message = self.route(record)
            fetched.rooms.setdefault(message.room, []).append(message)
            fetched.handlings += len(message.handlers)
            fetched.rejected += message.rejected is not None
        return fetched

    def route(self, record: Any) -> Message:
        """A fetched Kafka record as a routed :class:`Message`."""
        message = Message(
            topic=record.topic, partition=record.partition, offset=record.offset,
            key=(record.key or b"").decode("utf-8", "replace"), value=record.value or b"",
            headers={str(k): (v or b"").decode("utf-8", "replace") for k, v in (record.headers or ())},
        )  # fmt: skip
        self.parse(message)
        if message.rejected is None:
            self.choose_handlers(message)
        return message

    @staticmethod
    def parse(message: Message) -> None:
        """Set the message's envelope from its value, or why it is rejected."""
        try:
            message.envelope = parse_envelope(message.value)
        except EnvelopeError as exc:
            message.rejected = f"unparsable value: {exc}"

    def choose_handlers(self, message: Message) -> None:
        """Set the handlers of a parsed message; an unknown type no handler takes is rejected."""
        assert message.envelope is not None
        event_type = message.envelope.event_type
        handlers = self._handlers_of.get(event_type)
        if handlers is None:
            handlers = [h for h in self.handlers.values() if h.takes(event_type)]
            if len(self._handlers_of) < MAX_EVENT_TYPES_KEPT:
                self._handlers_of[event_type] = handlers
        message.handlers = handlers
        if not message.handlers and event_type not in KNOWN_EVENT_TYPES:
            message.rejected = f"unknown event type {event_type!r}: no handler of consumer {self.consumer} takes it"
