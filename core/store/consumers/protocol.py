"""What the consumer engine keeps in the database, as a protocol: the statements, on MySQL
and PostgreSQL, are in :mod:`room_outbox.store.consumers.sql`.

Two tables:

* ``room_consumer_processed``: one row per (consumer, handler, app_code, event_id) handled,
  written in the handler's own transaction (effectively-once).
* ``room_consumer_retry``: messages a handler failed on (``retrying``, due again at
  ``due_at_ms``), later messages of the same room waiting behind them, and dead letters
  (``dead``). ``handler`` is empty for messages that failed before any handler was chosen (an
  unparsable value, an unknown event type).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from room_outbox.handler import Transaction

#: ``handler`` of a dead letter that no handler was chosen for.
NO_HANDLER = ""


class LeaseLost(Exception):
    """A retry row this process claimed was taken over (its lease ran out) meanwhile."""


#: The widths of the consumer tables' columns a message's fields go to
#: (:mod:`room_outbox.store.schema.consumers`), in characters.
APP_CODE_MAX = 64
EVENT_ID_MAX = 128
EVENT_TYPE_MAX = 64
#: The retry table keeps this many characters of a room key (``room_key`` VARCHAR(200)):
#: whoever compares room keys with the table's compares this much of them (:func:`fit_room_key`).
ROOM_KEY_MAX = 200
#: ``last_error`` VARCHAR(1024).
RETRY_ERROR_MAX = 1024
#: The headers as JSON (``headers`` TEXT: 65,535 bytes on MySQL; the JSON is ASCII, a byte a
#: character): what is kept of a message's headers, each value at most ``HEADER_VALUE_MAX``.
HEADERS_MAX = 16_384
HEADER_VALUE_MAX = 1024
#: The header naming those left out when the headers were longer than ``HEADERS_MAX``.
HEADERS_LEFT_OUT = "room-outbox.headers-left-out"
#: Ends a text cut to its column's width.
CUT = "\u2026"


def _storable(value: str) -> str:
    """``value`` with what no server stores as text replaced: NUL (PostgreSQL refuses it) as
    the two characters ``\\0``, a lone surrogate (no UTF-8 for it) as ``?``."""
    if "\x00" in value:
        value = value.replace("\x00", "\\0")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            value = value.encode("utf-8", "replace").decode("utf-8")
    return value


def fit_text(value: str, width: int) -> str:
    """``value`` as a text column of ``width`` characters can store it: storable
    (:func:`_storable`) and, when longer, cut with ``…`` as its last character. A value that
    fits comes back as it is, so fitting twice changes nothing."""
    if len(value) <= width and value.isascii() and "\x00" not in value:
        return value
    value = _storable(value)
    return value if len(value) <= width else value[: width - 1] + CUT


def fit_key(value: str, width: int) -> str:
    """``value`` as a key column of ``width`` characters can store it, still telling it apart
    from every other value: one that does not fit as it is keeps its start, then ``…`` and 16
    hex digits of the whole value's SHA-256. A plain cut would make two ids sharing their start
    one key: the second a duplicate of the first, handled never, or its retry row dropped."""
    if len(value) <= width and value.isascii() and "\x00" not in value:
        return value
    storable = _storable(value)
    if storable == value and len(value) <= width:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return storable[: width - len(digest) - 1] + CUT + digest


def fit_room_key(room: str) -> str:
    """A room key as the retry table keeps it: storable and its first ``ROOM_KEY_MAX``
    characters (no mark: rows written before compare by that prefix, and two rooms that share
    it are only held back together)."""
    return _storable(room)[:ROOM_KEY_MAX] if len(room) > ROOM_KEY_MAX or not room.isascii() or "\x00" in room else room


def fit_headers(headers: dict[str, str]) -> dict[str, str]:
    """The headers the retry table keeps: names and values storable, each value at most
    ``HEADER_VALUE_MAX`` characters, the whole at most ``HEADERS_MAX`` as JSON. Headers beyond
    that are left out in order, named in ``HEADERS_LEFT_OUT``; the topic, partition and offset
    of the row still find the whole message."""
    if sum(len(k) + len(v) for k, v in headers.items()) * 6 + 8 * len(headers) <= HEADERS_MAX:
        return headers  # JSON writes a character as at most 6 and a header adds 8: it fits
    kept: dict[str, str] = {}
    left: list[str] = []
    size = 2 + 200  # {} and room for the note of those left out
    for name, value in headers.items():
        name, value = fit_text(name, 128), fit_text(value, HEADER_VALUE_MAX)
        more = len(json.dumps({name: value})) + 2
        if size + more > HEADERS_MAX:
            left.append(name)
            continue
        kept[name] = value
        size += more
    if left:
        kept[HEADERS_LEFT_OUT] = fit_text(f"{len(left)}: {', '.join(left)}", 150)
    return kept


@dataclass(frozen=True)
class Processed:
    """A processed record; app_code and event_id fitted to their key columns (:func:`fit_key`)
    however it is made, so that a record compares equal to the one the table holds."""

    consumer: str
    handler: str
    app_code: str
    event_id: str
    topic: str
    partition: int
    offset: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "app_code", fit_key(self.app_code, APP_CODE_MAX))
        object.__setattr__(self, "event_id", fit_key(self.event_id, EVENT_ID_MAX))


@dataclass(frozen=True)
class RetryRow:
    consumer: str
    handler: str
    app_code: str
    event_id: str
    event_type: str
    room_key: str
    topic: str
    partition: int
    offset: int
    value: bytes
    headers: dict[str, str]
    attempts: int
    due_at_ms: int
    last_error: str | None
    id: int = 0
    owner: str | None = None

    def __post_init__(self) -> None:
        # Every field fitted to its column however the row is made: whatever a message holds,
        # its row can be written (room_key is fitted when written: the dead-letter copy keeps
        # the whole key).
        fitted = {
            "app_code": fit_key(self.app_code, APP_CODE_MAX), "event_id": fit_key(self.event_id, EVENT_ID_MAX),
            "event_type": fit_text(self.event_type, EVENT_TYPE_MAX), "headers": fit_headers(self.headers),
            "last_error": None if self.last_error is None else fit_text(self.last_error, RETRY_ERROR_MAX),
        }  # fmt: skip
        for name, value in fitted.items():
            object.__setattr__(self, name, value)


class ConsumerBatch(Protocol):
    """Handlings that share one transaction, each in a savepoint of its own."""

    def processing(self, record: Processed) -> AbstractAsyncContextManager[Transaction | None]:
        """Like :meth:`ConsumerStore.processing`, inside a savepoint: an exception rolls back
        to it (this handling's record and writes only) and propagates."""
        ...

    async def schedule(self, row: RetryRow) -> None: ...

    async def dead_letter(self, row: RetryRow) -> None: ...


@dataclass(frozen=True)
class DeadLetters:
    """Which dead letters ``consumers dead-letters`` and ``redrive`` take: a consumer's (every
    consumer's: None), of one handler, of these events, of one app. One WHERE for the preview,
    the count and the change, so that they select alike."""

    consumer: str | None
    handler: str | None = None
    event_ids: tuple[str, ...] = ()
    app_code: str | None = None

    def where(self) -> tuple[str, list[Any]]:
        """SQL and parameters over the retry table; ids and app as the table keeps them (a long
        one: its start and its digest)."""
        clauses, params = ["status = 'dead'"], []
        if self.consumer is not None:
            clauses.append("consumer = %s")
            params.append(self.consumer)
        if self.handler is not None:
            clauses.append("handler = %s")
            params.append(self.handler)
        if self.app_code is not None:
            clauses.append("app_code = %s")
            params.append(fit_key(self.app_code, APP_CODE_MAX))
        if self.event_ids:
            clauses.append(f"event_id IN ({', '.join(['%s'] * len(self.event_ids))})")
            params.extend(fit_key(e, EVENT_ID_MAX) for e in self.event_ids)
        return " AND ".join(clauses), params


class ConsumerStore(Protocol):
    async def migrate(self) -> list[str]: ...

    def processing(
        self, record: Processed, retry: RetryRow | None = None
    ) -> AbstractAsyncContextManager[Transaction | None]:
        """A transaction holding ``record``: yields ``None`` (and writes nothing of the
        handler's) when the record already exists. ``retry``: the claimed retry row this
        handling settles; it is deleted in the same transaction (:class:`LeaseLost` when
        this process no longer holds it)."""
        ...

    def processing_many(self, records: list[Processed]) -> AbstractAsyncContextManager[tuple[Transaction, list[bool]]]:
        """A transaction holding many records of one consumer and handler: yields it and, per
        record, whether it is new (False: handled before, or the same event earlier in
        ``records``). Commits when the block ends; any error rolls it all back."""
        ...

    def batch(self, timeout: float | None = None) -> AbstractAsyncContextManager[ConsumerBatch]:
        """One transaction for many handlings, committed when the block ends, within
        ``timeout`` seconds."""
        ...

    async def blocked_rooms(self, consumer: str, room_keys: set[str]) -> set[tuple[str, str]]:
        """(handler, room_key) pairs among ``room_keys`` with rows waiting for a retry."""
        ...

    async def schedule(self, row: RetryRow) -> None:
        """Put ``row`` in the retry table (``retrying``); nothing when it is already there."""
        ...

    async def dead_letter(self, row: RetryRow) -> None:
        """Record ``row`` as a dead letter (a retrying row of the same event becomes dead)."""
        ...

    async def count_retrying(self, consumer: str, limit: int) -> int:
        """The consumer's rows waiting for a retry (``status``'s "retrying"), counted up to
        ``limit``."""
        ...

    def refused(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a write, is the database refusing the row's values (too
        long, out of range, a character it cannot store, a packet too large) rather than the
        database failing (unreachable, a deadlock, a timeout): the row may be written without
        them."""
        ...

    async def claim_retries(
        self, consumer: str, owner: str, limit: int, lease_ms: int, ordered: bool
    ) -> list[RetryRow]:
        """Due rows, leased to ``owner`` for ``lease_ms``; with ``ordered`` only each room's
        first row (per handler)."""
        ...

    async def retry_failed(self, row: RetryRow, attempts: int, due_at_ms: int, error: str, dead: bool) -> bool:
        """Record a failed retry (or that it is now dead); False when the lease was lost."""
        ...

    async def release(self, rows: list[RetryRow]) -> None:
        """Give back claimed rows not attempted (shutdown)."""
        ...

    async def replace(self, row: RetryRow, by: list[RetryRow]) -> bool:
        """Swap a claimed handler-less row for one row per handler that takes it."""
        ...

    async def redrive(self, dead: DeadLetters) -> int:
        """The dead letters ``dead`` selects made ``retrying`` again, in batches; returns how many."""
        ...

    async def count_dead_letters(self, dead: DeadLetters) -> int: ...

    async def dead_letter_apps(self, dead: DeadLetters) -> list[str]: ...

    async def overview(self) -> list[dict[str, Any]]:
        """Per consumer and handler: rows retrying and dead, oldest dead letter."""
        ...

    async def dead_letters(self, dead: DeadLetters, limit: int) -> list[dict[str, Any]]: ...

    async def event_states(self, event_id: str) -> list[dict[str, Any]]:
        """Every consumer's record of ``event_id``: consumed, retrying or dead."""
        ...
