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

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from room_outbox.handler import Transaction

#: ``handler`` of a dead letter that no handler was chosen for.
NO_HANDLER = ""


class LeaseLost(Exception):
    """A retry row this process claimed was taken over (its lease ran out) meanwhile."""


@dataclass(frozen=True)
class Processed:
    consumer: str
    handler: str
    app_code: str
    event_id: str
    topic: str
    partition: int
    offset: int


#: The retry table keeps this many characters of a room key (``room_key`` VARCHAR(200)):
#: whoever compares room keys with the table's compares this much of them.
ROOM_KEY_MAX = 200


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


class ConsumerBatch(Protocol):
    """Handlings that share one transaction, each in a savepoint of its own."""

    def processing(self, record: Processed) -> AbstractAsyncContextManager[Transaction | None]:
        """Like :meth:`ConsumerStore.processing`, inside a savepoint: an exception rolls back
        to it (this handling's record and writes only) and propagates."""
        ...

    async def schedule(self, row: RetryRow) -> None: ...

    async def dead_letter(self, row: RetryRow) -> None: ...


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

    async def redrive(self, consumer: str, handler: str | None, event_ids: list[str]) -> int: ...

    async def overview(self) -> list[dict[str, Any]]:
        """Per consumer and handler: rows retrying and dead, oldest dead letter."""
        ...

    async def dead_letters(self, consumer: str | None, limit: int) -> list[dict[str, Any]]: ...

    async def event_states(self, event_id: str) -> list[dict[str, Any]]:
        """Every consumer's record of ``event_id``: consumed, retrying or dead."""
        ...
