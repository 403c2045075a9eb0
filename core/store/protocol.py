"""Storage of the main lane's consumption state: the protocol and the records it trades in.

The dispatcher talks to a store only through :class:`OutboxStore`; the backends
(:mod:`room_outbox.store.backends`) implement it on MySQL/MariaDB, PostgreSQL and SQLite.
Every write of a result is *fenced* on the claim that produced it: a result whose claim no
longer holds the row (lease expired and taken over, row already published by room-service)
changes nothing and is reported back as stale. Callers that need more than the lane's
protocol (operator queries, the readiness ping, the producer's mark) use :class:`SQLStore`.

This module imports no database driver, so that depending on the store's types never loads one.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from room_outbox.store.dialect import Dialect
    from room_outbox.store.schema.outbox import Migration
    from room_outbox.store.schema.profiles import Profile


@dataclass(slots=True)
class ReadAlong:
    """A one-row read that the room buckets' read carries in its own statement, saving the
    claim a round trip (on MySQL/MariaDB; elsewhere it runs as a statement of its own).
    ``sql``: a SELECT of one row whose columns are named ``columns``, read without locks;
    ``params``: its parameters. The reader sets ``row``; a reader that leaves it None did not
    read it."""

    sql: str
    params: tuple[Any, ...]
    columns: tuple[str, ...]
    row: tuple[Any, ...] | None = None


class BucketReader(Protocol):
    """Reads the room buckets this process may claim, in the claim's transaction (its
    cursor), and ``along`` with them where given; None back: every bucket."""

    async def __call__(self, cur: Any, along: ReadAlong | None = None) -> list[int] | None: ...


# One OutboxRow and one DeliveryResult are built per event: not frozen, as a frozen dataclass
# costs several times as much to build (each field set through object.__setattr__). Treat
# them as values all the same: nothing changes one once built.
@dataclass(slots=True)
class OutboxRow:
    """A claimed ``room_outbox`` row. ``envelope`` is raw: parsing is the dispatcher's job,
    so a malformed envelope becomes a recorded failure instead of a store error (None: a lane
    table's row whose ``room_outbox`` row is gone)."""

    id: int
    event_id: str
    event_type: str
    room_id: str
    app_code: str
    envelope: str | bytes | None
    retry_count: int
    claim: str
    #: The row's own limit (the profile's ``attempts_limit``, silk's ``max_attempts``): a failed
    #: attempt that reaches it parks the row. None: ``outbox_worker.retry`` decides.
    attempts_limit: int | None = None


class Outcome(enum.Enum):
    PUBLISHED = "published"
    FAILED = "failed"  # stays pending: retry_count+1, last_error, retried after retry_at_ms
    PARKED = "parked"  # status 'failed': retry_count+1, last_error; never retried unless requeued
    RELEASED = "released"  # not attempted (shutdown, or held back by its room): lease dropped
    #: Not attempted: a rate limit held it back (this process's, or the destination's refusal,
    #: then with its error in last_error). Lease dropped, retry_count kept; claimable again
    #: from retry_at_ms (0: at once).
    THROTTLED = "throttled"


@dataclass(slots=True)
class DeliveryResult:
    row_id: int
    event_id: str
    claim: str
    outcome: Outcome
    error: str | None = None
    #: For FAILED and THROTTLED: not claimable again before this time (epoch ms).
    retry_at_ms: int = 0
    #: Set on a stale result whose row the producer published while this claim still held
    #: it (room-service's own push succeeded): not a lease lost to another process.
    published_by_producer: bool = False
    #: Set on a result left unwritten because another session (room-service's transaction)
    #: holds its row locked: not stale, its claim still holds the row. The caller keeps it and
    #: hands it to a later write, as waiting for the lock would hold up every other result.
    row_locked: bool = False


@dataclass(frozen=True, slots=True)
class Claimed:
    rows: list[OutboxRow]
    #: Results of the previous round not written: those whose claim no longer held their row,
    #: and those whose row another session held locked (``row_locked``, to be written later).
    stale: list[DeliveryResult]
    #: The scan found fewer claimable rows than asked for, and left none for a busy room: no
    #: need to come back at once.
    exhausted: bool


class ClaimFailedAfterResults(Exception):
    """A claim failed (the ``__cause__``) after the results it was given were written beside
    it: ``stale`` are those of them whose claim no longer held their row."""

    def __init__(self, stale: list[DeliveryResult]) -> None:
        super().__init__("claim failed after its results were written")
        self.stale = stale


def room_heads(found: Sequence[OutboxRow], pending: Iterable[tuple[int, str, str]]) -> list[OutboxRow]:
    """Per-room ordering's rule, the same for every backend: keep a found row only if no
    earlier pending row of its room (``pending``: ``(id, app_code, room_id)`` of the rooms'
    pending rows below the highest found id) is left outside ``found``."""
    found_ids = {row.id for row in found}
    first_outside: dict[tuple[str, str], int] = {}
    for row_id, app_code, room_id in pending:
        key = (app_code, room_id)
        if row_id not in found_ids and row_id < first_outside.get(key, row_id + 1):
            first_outside[key] = row_id
    return [r for r in found if r.id < first_outside.get((r.app_code, r.room_id), r.id + 1)]


class OutboxStore(Protocol):
    @property
    def profile(self) -> Profile:
        """The table's name and status words (``database.profile``; a lane of its own: ``v1``)."""
        ...

    async def migrate(self) -> list[str]:
        """Create or upgrade the schema idempotently; return what was changed."""

    async def claim(
        self,
        claim: str,
        limit: int,
        lease_until_ms: int,
        results: Sequence[DeliveryResult] = (),
        per_room: bool = False,
        hold_back_ms: int = 1000,
        in_flight: Mapping[int, tuple[str, str]] | None = None,
        on_locked: Callable[[list[OutboxRow]], Awaitable[None]] | None = None,
    ) -> Claimed:
        """Record ``results`` and claim up to ``limit`` pending rows. The results are written
        in the claim's transaction, or beside it in one of their own, committed before the
        claim writes its leases (so that the rows held never exceed what the caller holds):
        should the claim then fail, it raises :class:`ClaimFailedAfterResults`. A result
        whose row another session holds locked is not waited for where the results are
        written beside the claim: it comes back among ``stale``, ``row_locked``.

        With ``per_room``, a row is claimed only if no earlier pending row of its room is
        left outside the claim (waiting for a retry, leased elsewhere, or skipped). A room the
        scan meets only through later rows has its first pending row claimed instead where
        that row may go now. A row held back is not looked at again until its room's first
        pending row may go, for ``hold_back_ms`` at most. ``in_flight`` (row id:
        ``(app_code, room_id)``): rows the caller holds whose results are not among
        ``results``. They do not hold their rooms back: the caller delivers a later row of
        their room only once they are published, and releases it otherwise, so that a claim
        made ahead of their results may take their rooms' next rows.

        ``on_locked``: awaited with the rows claimed as soon as they are locked and the
        results are committed (never while they are still to be written in the claim's
        transaction), before the claim writes the rows' leases and commits; if it raises, the
        claim fails. From then on the caller may deliver the rows while the claim finishes:
        should it fail, they are claimable again, delivered twice at worst, as after a kill.
        A store that never awaits it leaves the rows to the caller once it returns.
        """

    async def record(self, results: Sequence[DeliveryResult]) -> list[DeliveryResult]:
        """Record results in one transaction; return those not written: the stale ones, and
        those whose row another session holds locked (``row_locked``)."""

    async def renew(self, claim: str, row_ids: Sequence[int], lease_until_ms: int) -> int:
        """Extend the lease of rows still held by ``claim``; return how many are, counting the
        rows the producer published while ``claim`` held them (none lost to another claim)."""

    async def aclose(self) -> None:
        """Close the connection pool."""


class StoreAddress(Protocol):
    @property
    def database(self) -> str:
        """The database name (MySQL, PostgreSQL) or file path (SQLite), for logs."""
        ...


class SQLStore(OutboxStore, Protocol):
    @property
    def address(self) -> StoreAddress: ...

    async def migration_plan(self) -> list[Migration]:
        """The statements :meth:`migrate` would run now (``migrate --sql``)."""
        ...

    async def run_migration(self, planner: Callable[[Any], Awaitable[list[Migration]]]) -> list[str]:
        """The one way a migration runs here (:mod:`room_outbox.store.schema.registry`): holding
        the database's exclusive-migration lock, the plan ``planner`` reads from the catalogue
        (given a cursor in a transaction) is run; return its changes."""
        ...

    @property
    def dialect(self) -> Dialect: ...

    #: The room buckets this process may claim (the membership's on a server; None on SQLite).
    room_buckets: BucketReader | None
    #: The age (ms) the producer's rows must reach before a claim takes them (``outbox_worker.claim_after``).
    claim_after_ms: int
    #: The main lane's lease (ms, ``outbox_worker.lease``): a row the producer's own worker holds
    #: is left to it until it was last changed this long ago.
    lease_ms: int

    #: SQL: how statements read the outbox's envelope column (an oversized one left unread; see
    #: :meth:`~.backends.leased.LeasedRows.read_envelope`).
    envelope_column: str

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        """A cursor (``execute``/``executemany`` with ``%s`` placeholders, ``fetchone``,
        ``fetchall``, ``description``) in a transaction, committed when the block ends."""
        ...

    async def row_bucket(self, cur: Any, table: str, profile: Profile) -> str:
        """SQL: the room bucket of a row of ``table`` (shaped as ``profile`` says), as claims and
        the handover fence read it, decided once per table (see
        :meth:`~.backends.leased.LeasedRows.row_bucket`)."""
        ...
