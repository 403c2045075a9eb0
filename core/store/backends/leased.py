"""One lane's consumption state in one table, in SQL all three stores speak: claims with leases,
per-room hold-back, fenced result writes, lease renewal.

:class:`LeasedRows` holds the statements once; :class:`~.mysql.MySQLStore`,
:class:`~.postgres.PostgresStore`, :class:`~.sqlite.SQLiteStore` (the main lane in
``room_outbox``) and :class:`~.mysql_lanes.LaneStore` (a lane of its own) give it a
transaction, a table and their dialect (its locking clause). The
claim reads ``status='pending' AND lock_until_ms <= now ORDER BY lock_until_ms, key``: a range
on the ``(status, lock_until_ms, key)`` index that stops after ``limit`` rows, however many
published rows, leased rows or rows waiting for a retry the table holds. A claim limited to
room buckets (per-room ordering with several processes, :mod:`.membership`) reads the same
range and checks each row's bucket (:meth:`LeasedRows.row_bucket`): in the index entries where
the index holds it last (PostgreSQL, and the MySQL/MariaDB tables ``migrate`` creates), else on
the row.
With ``claim_after`` the main lane leaves the producer's youngest rows to its own push
(:meth:`LeasedRows._due_ranges`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio

from room_outbox.envelope import MAX_ENVELOPE_BYTES
from room_outbox.store.backends.errors import refused_value, row_lock_not_granted
from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import MYSQL, Dialect, ascii_text
from room_outbox.store.dialect import marks as _marks
from room_outbox.store.protocol import (
    BucketReader,
    Claimed,
    ClaimFailedAfterResults,
    DeliveryResult,
    OutboxRow,
    Outcome,
    ReadAlong,
    room_heads,
)
from room_outbox.store.schema.buckets import read_row_bucket
from room_outbox.store.schema.columns import LAST_ERROR_MAX
from room_outbox.store.schema.outbox import ROOM_INDEX, TABLE, claim_index
from room_outbox.store.schema.profiles import V1, Profile

#: How far ahead of the database's clock a producer's row may be created and still end the
#: key range of a claim's rows old enough (see :meth:`LeasedRows._fresh_bound`): the few
#: milliseconds hosts' clocks differ by, with room to spare.
CREATED_AHEAD_MS = 1_000
#: A row whose result the database refused is due again this long after at the soonest.
REFUSED_RETRY_MS = 60_000
#: How many rows refused by the database a store remembers, to log each once while it lasts.
REFUSALS_REMEMBERED = 10_000
#: A result whose row another session holds locked this long (seconds) is logged as waiting.
LOCKED_RESULT_WARN_S = 1.0

log = logging.getLogger("room_outbox.store")


def claim_sql(
    table: str,
    key: str,
    envelope: str,
    lock: str,
    profile: Profile = V1,
    buckets: int = 0,
    hint: str = "",
    due: str = "",
    bucket: str = "room_bucket",
) -> str:
    """The claim scan of one lane's table (see the module docstring). ``buckets``: how many
    room buckets the scan is limited to (placeholders after the due condition's; 0: every
    room), checked in the claim index's entries, whose last column is the bucket (``hint``:
    the dialect's ``index_hint``, which makes sure of that on MySQL; ``bucket``: the row's
    bucket, the dialect's :meth:`~.dialect.Dialect.room_bucket`). ``due``: the rows taken,
    with one placeholder (default ``lock <= now``; see :meth:`LeasedRows._due_ranges`)."""
    p = profile
    only = f" AND {bucket} IN ({_marks(range(buckets))})" if buckets else ""
    forced = hint.format(index=claim_index(table)[0])
    return (
        f"SELECT {claimed_columns(key, envelope, p)} FROM {table}{forced}"
        f" WHERE {p.is_open()} AND {due or p.lock + ' <= ' + p.ms('%s')}{only} ORDER BY {p.lock}, {key} LIMIT %s{lock}"
    )


def claimed_columns(key: str, envelope: str, profile: Profile = V1) -> str:
    """SQL: the columns a claim reads of each row it takes (:meth:`LeasedRows._outbox_rows`)."""
    p = profile
    # A row's own attempts limit, where the profile has one: every column costs the driver
    # a parse per row.
    limit = f", {p.attempts_limit}" if p.attempts_limit else ""
    return f"{key}, {p.event_id}, {p.event_type}, {p.room_id}, {p.app_code}, {envelope}, {p.attempts_made}{limit}"


def bounded_by_key(claim_after_ms: int, dialect: Dialect, profile: Profile) -> bool:
    """Whether a store's claim takes the producer's rows that no claim has taken yet in key
    order only up to the first one younger than ``claim_after`` (:meth:`LeasedRows._due_ranges`):
    where a locking scan locks every row it reads (MySQL) and those rows sit first in the claim
    index. The rows after that young one wait for it, however old."""
    return claim_after_ms > 0 and dialect.locks_before_filtering and profile.fresh_at_cleared_lock


def _closing(results: Sequence[DeliveryResult]) -> set[int]:
    """The rows ``results`` close once written: published or parked, no longer open."""
    return {r.row_id for r in results if r.outcome in (Outcome.PUBLISHED, Outcome.PARKED)}


def open_rows_of_rooms_sql(
    table: str, key: str, rooms: int, profile: Profile = V1, hint: str = "", also: str = "", besides: int = 0
) -> str:
    """Per-room ordering's look-up: the open rows of ``rooms`` rooms (placeholders, then the
    highest key found, then ``besides`` keys to leave out) below that key, read by the room
    index, each with its ``lock`` in ms (when it may go: see :meth:`LeasedRows._heads_of_rooms`).
    ``hint``: the dialect's ``index_hint``; left to choose, MySQL's optimizer read the
    (status, id) range below the key instead, which grows with every published row, while the
    room index's reads do not. ``also``: more columns to select (", 0"). ``besides``: the keys
    of rows to leave out (the claim's own), which the index entries rule out (the key is in
    every entry) before their rows are read for the other columns."""
    p = profile
    forced = hint.format(index=ROOM_INDEX.format(table=table))
    leave_out = f" AND {key} NOT IN ({_marks(range(besides))})" if besides else ""
    return (
        f"SELECT {key}, {p.app_code}, {p.room_id}, {p.as_ms(p.lock)}{also} FROM {table}{forced}"
        f" WHERE {p.room_id} IN ({_marks(range(rooms))}) AND {p.is_open()} AND {key} < %s{leave_out}"
    )


def _fresh_bound_of(row: Sequence[Any]) -> int:
    """The key bound :meth:`LeasedRows._fresh_bound` reads, from its row (the last key read,
    the first young one)."""
    last, first_young = row
    if last is None:
        return 0
    return int(last) if first_young is None else min(int(last), int(first_young) - 1)


@dataclasses.dataclass(frozen=True)
class _RoomsMet:
    """What a per-room claim knows of the rooms its scan meets (see
    :meth:`LeasedRows._heads_of_rooms`): its ``claim`` and ``limit``, how long it holds rows
    back, the open rows that do not hold their rooms back (``closing``: those the results it
    writes publish or park; ``in_flight``: those the caller delivers before any later row of
    their rooms), and ``written``: rows whose result it writes, which it never takes."""

    claim: str
    limit: int
    hold_back_ms: int
    closing: Collection[int] = ()
    in_flight: Mapping[int, tuple[str, str]] | None = None
    written: Collection[int] = ()


def _first_earlier_rows(
    found: Sequence[OutboxRow], earlier: Iterable[tuple[int, str, str, int | None]]
) -> dict[tuple[str, str], tuple[int, int | None]]:
    """Of every room some found rows of which are not heads (:func:`room_heads`): its first
    open row outside ``found`` (``earlier``: key, room and ``lock``), as (key, ``lock``), the
    rooms in the order ``found`` meets them (the scan's)."""
    highest: dict[tuple[str, str], int] = {}
    for row in found:
        room = (row.app_code, row.room_id)
        highest[room] = max(row.id, highest.get(room, row.id))
    firsts: dict[tuple[str, str], tuple[int, int | None]] = {}
    for row_id, app_code, room_id, lock in earlier:
        room = (app_code, room_id)
        if row_id < highest.get(room, -1) and row_id < firsts.get(room, (row_id + 1, None))[0]:
            firsts[room] = (row_id, lock)
    return {room: firsts[room] for room in highest if room in firsts}


class LeasedRows:
    """One lane's consumption state in one table: claims with leases, fenced result writes.

    The main lane keeps it in ``room_outbox`` itself (key ``id``); every other lane in its own
    table ``room_outbox_lane_<name>`` (key ``outbox_id``, see :mod:`.mysql_lanes`). Same
    columns, same indexes, same statements.
    """

    table = TABLE
    key = "id"
    #: The longest envelope read (bytes, ``database.max_envelope_bytes``; see :meth:`read_envelope`).
    max_envelope_bytes = MAX_ENVELOPE_BYTES
    #: SQL: how every statement reads the outbox's envelope (:meth:`read_envelope`).
    envelope_column = "envelope"
    #: The database's dialect; its ``row_lock`` is how the claim scan locks what it takes
    #: (SQLite's is "": its BEGIN IMMEDIATE already serialises every writer).
    dialect: Dialect = MYSQL
    #: The status words of the table (see :mod:`.profiles`); lanes of their own keep ``v1``.
    profile: Profile = V1
    #: With per-room ordering: reads, inside the claim's transaction, the room buckets this
    #: process may claim now (``None`` back: all of them). Set by the cluster membership
    #: (:mod:`.membership`, MySQL and PostgreSQL); unset, every process claims every room and per-room
    #: order rests on the hold-back alone (PostgreSQL, SQLite).
    room_buckets: BucketReader | None = None
    #: Rows the producer wrote are claimed only once this old (ms, by their creation time
    #: against the database's clock): room-service pushes each event itself right after its
    #: commit and then marks it published; a claim before that would send it a second time.
    #: Rows waiting for a retry or a lease's end are due by ``lock`` alone. 0: at once.
    claim_after_ms: int = 0
    #: How long a claim leases its rows (``outbox_worker.lease``, ms; its default here): a row
    #: the producer's own worker holds is left to it until it was last changed this long ago
    #: (:meth:`~.profiles.Profile.producers_claim_ended`).
    lease_ms: int = 30_000
    #: The room buckets the last per-room claim found claimable (None: all; none before the first).
    _buckets_seen: Sequence[int] | None = ()
    #: Table → SQL of its rows' room bucket, read once per table (:meth:`row_bucket`).
    _row_buckets: dict[str, str] | None = None
    #: Rows whose result the database refused (key: why), logged once while the refusal lasts
    #: (:meth:`_report_refused`). None until the first refusal: a write that goes through
    #: then checks nothing more.
    _refused: dict[int, str] | None = None
    #: Rows whose results wait for another session's lock on them: since when (the event
    #: loop's clock), and whether that was logged (:meth:`_report_waiting`). None until the
    #: first such row.
    _waiting_since: dict[int, tuple[float, bool]] | None = None

    def use_profile(self, profile: Profile) -> None:
        """Keep the main lane's state in ``profile``'s table and words (``database.profile``)."""
        self.profile = profile
        self.table = profile.table
        self.key = profile.key
        self.envelope_column = self.read_envelope(profile.envelope)

    def read_envelope(self, column: str) -> str:
        """SQL: the envelope ``column`` as read, an oversized one left unread (see
        :meth:`~.dialect.Dialect.bounded_envelope`)."""
        return self.dialect.bounded_envelope(column, self.max_envelope_bytes)

    async def read_column_types(self) -> None:
        """Read what :meth:`read_envelope` needs to know of the outbox's columns (PostgreSQL:
        the envelope's type), once the store is open."""

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        """A cursor taking ``%s`` placeholders in a transaction, committed when the block ends."""
        raise NotImplementedError

    @property
    def _bound_by_key(self) -> bool:
        """Whether a claim takes the producer's rows up to a key bound read first
        (:meth:`_fresh_bound`; see :meth:`_due_ranges`)."""
        return bounded_by_key(self.claim_after_ms, self.dialect, self.profile)

    async def _due_ranges(
        self, cur: Any, limit: int, buckets: Sequence[int] | None, bound: int | None = None
    ) -> list[tuple[str, int]]:
        """What a claim takes, in its order: due conditions for :func:`claim_sql`, each with
        its parameter, read one after the other while the batch is not full: rows due by
        ``lock`` and old enough (:meth:`_due_by_age`) that the producer's own worker does not
        hold (:meth:`_producers_claim_ended`, a filter on the rows of those ranges)."""
        ranges = await self._due_by_age(cur, limit, buckets, bound)
        ended = self._producers_claim_ended()
        return [(f"{due} AND {ended}", param) for due, param in ranges] if ended else ranges

    def _producers_claim_ended(self) -> str:
        """SQL: the row is not held by the producer's own worker (see
        :meth:`~.profiles.Profile.producers_claim_ended`), by the database's clock, as the
        producer's times are compared with it."""
        p = self.profile
        return p.producers_claim_ended(p.ms(f"({self.dialect.now_ms} - {int(self.lease_ms)})"))

    async def _due_by_age(
        self, cur: Any, limit: int, buckets: Sequence[int] | None, bound: int | None
    ) -> list[tuple[str, int]]:
        """:meth:`_due_ranges` by ``lock`` and creation time alone.

        Without ``claim_after_ms``: ``lock <= now``. With it, the rows the producer wrote that
        no claim has taken yet must be that old too. Where a locking scan locks every row it
        reads (MySQL), and those rows all sit at ``lock`` 0 (v1, room_cell), so that the claim
        index orders them by key ahead of every other row, they are taken up to a key bound
        (``bound`` where the claim read it already, else read here), then the rows due by
        ``lock``: two exact ranges of the index, which never reach, let alone lock, a younger
        row. Elsewhere the creation time is checked on the rows of the ``lock <= now`` range:
        the young pending rows are read, not locked (PostgreSQL locks only the rows that
        pass). A row without a creation time (a nullable column the producer left empty)
        counts as old: its age cannot be told, and waiting for it would wait for ever (on
        MySQL, with every row after it)."""
        p = self.profile
        lock_due = f"{p.lock} <= {p.ms('%s')}"
        if self.claim_after_ms <= 0:
            return [(lock_due, now_ms())]
        old_enough = self._old_enough()
        if self._bound_by_key:
            if bound is None:
                bound = await self._fresh_bound(cur, limit, buckets)
            # Below the bound, only rows created ahead of the clock may be young: checked here.
            return [
                (f"{p.lock} = {p.lock_cleared} AND {self.key} <= %s AND ({old_enough})", bound),
                (f"{p.lock} > {p.lock_cleared} AND {lock_due}", now_ms()),
            ]
        return [self._due_now()]

    def _old_enough(self) -> str:
        """SQL: the row was created ``claim_after_ms`` ago or more, by the database's clock (or
        has no creation time, see :meth:`_due_by_age`)."""
        p = self.profile
        return f"{p.created} <= {p.ms(f'({self.dialect.now_ms} - {int(self.claim_after_ms)})')} OR {p.created} IS NULL"

    def _due_now(self) -> tuple[str, int]:
        """A due condition (as :meth:`_due_by_age`'s) with its parameter, for rows read by key:
        due by ``lock``, and old enough if the producer wrote it and no claim has taken it yet."""
        p = self.profile
        lock_due = f"{p.lock} <= {p.ms('%s')}"
        if self.claim_after_ms <= 0:
            return lock_due, now_ms()
        claimed_before = f"{p.lock} > {p.lock_cleared}" if p.fresh_at_cleared_lock else f"status <> '{p.fresh}'"
        return f"{lock_due} AND ({claimed_before} OR {self._old_enough()})", now_ms()

    async def _fresh_bound(self, cur: Any, limit: int, buckets: Sequence[int] | None) -> int:
        """The key up to which the producer's unclaimed rows are claimable: those of the
        first ``limit`` of them (in key order, the claim's) that come before the first one
        younger than ``claim_after_ms``; 0: none. Read without locks, so the producer's own
        update of a young row never waits for it, and never more rows than the claim itself
        may take.

        A row created more than :data:`CREATED_AHEAD_MS` ahead of the database's clock (by a
        producer whose clock runs fast) does not end the range: it would hold back every
        later row, of every room, for as long as that clock is ahead. The claim leaves it
        until it is old enough by its own creation time, as it would anywhere else, reading
        it meanwhile (a lock held for the claim's few milliseconds)."""
        bucket = await self.row_bucket(cur, self.table, self.profile) if buckets else ""
        read = self._fresh_bound_read(limit, buckets, bucket)
        await cur.execute(read.sql, read.params)
        return _fresh_bound_of(await cur.fetchone())

    def _fresh_bound_read(self, limit: int, buckets: Sequence[int] | None, bucket: str = "") -> ReadAlong:
        """:meth:`_fresh_bound`'s read. The database reads those rows once and sends two keys,
        not the rows: the last one read and the first young one. ``bucket``: a row's bucket
        (:meth:`row_bucket`), where ``buckets`` limit it."""
        p = self.profile
        forced = self.dialect.index_hint.format(index=claim_index(self.table)[0])
        only = f" AND {bucket} IN ({_marks(buckets)})" if buckets else ""
        return ReadAlong(
            f"SELECT MAX(k) AS last_key, MIN(CASE WHEN created > {self.dialect.now_ms} - %s"
            f" AND created <= {self.dialect.now_ms} + {CREATED_AHEAD_MS} THEN k END) AS first_young_key"
            f" FROM (SELECT {self.key} AS k, {p.created} AS created FROM {self.table}{forced}"
            f" WHERE status = '{p.fresh}' AND {p.lock} = {p.lock_cleared}{only} ORDER BY {self.key} LIMIT %s) AS first_rows",
            (self.claim_after_ms, *(buckets or ()), limit),
            ("last_key", "first_young_key"),
        )

    async def row_bucket(self, cur: Any, table: str, profile: Profile) -> str:
        """SQL: the room bucket of a row of ``table`` (shaped as ``profile`` says), as every
        claim on it and the handover fence read it: decided from the table's columns the first
        time it is asked for (:func:`~room_outbox.store.schema.buckets.read_row_bucket`), then
        kept for the process's life."""
        if self._row_buckets is None:
            self._row_buckets = {}
        if table not in self._row_buckets:
            self._row_buckets[table] = await read_row_bucket(cur, self.dialect, table, profile)
        return self._row_buckets[table]

    def _room_buckets(self) -> BucketReader | None:
        return self.room_buckets

    async def _claimable(self, cur: Any, read_buckets: BucketReader, limit: int) -> tuple[list[int] | None, int | None]:
        """The room buckets a per-room claim takes (None: all), read under the fence's lock, and
        the key bound where it came along (None: to be read). A key bound to read
        (:attr:`_bound_by_key`) comes in the buckets' own statement, a round trip less. It is
        counted over the buckets the last claim found, as the buckets are not known before
        that statement; the claim then takes the buckets both found, so the bound holds for
        every row it reads, and a bucket gained meanwhile from the next claim on."""
        seen = self._buckets_seen
        along = None
        if self._bound_by_key and (seen is None or seen):
            bucket = await self.row_bucket(cur, self.table, self.profile) if seen else ""
            along = self._fresh_bound_read(limit, seen, bucket)
        buckets = await read_buckets(cur, along)
        self._buckets_seen = buckets
        if along is None or along.row is None:
            return buckets, None
        if seen is not None:  # None: every bucket
            buckets = list(seen) if buckets is None else sorted(set(buckets) & set(seen))
        return buckets, _fresh_bound_of(along.row)

    async def _before_claim(self, cur: Any) -> int:
        """Work a claim's transaction does first (a lane of its own feeds its table here);
        returns the milliseconds it took, which the lease is extended by: a lease counts from
        the claim itself."""
        return 0

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
        async with self._results_beside(results) as beside:
            read_buckets = self._room_buckets() if per_room else None
            # The results are written after the reads where they are written beside (their write
            # is waited for as late as can be), and per room on MySQL (in the same transaction,
            # see Dialect.slow_reads_after_own_writes).
            reads_first = beside is not None or (per_room and self.dialect.slow_reads_after_own_writes)
            committed = not results  # the results, before the rows are handed over

            async def write_results(cur: Any) -> list[DeliveryResult]:
                nonlocal committed
                if beside is None:
                    return await self._apply_results(cur, results)
                stale, committed = await beside.finish(cur)
                return stale

            async with self.transaction() as cur:
                lease_until_ms += await self._before_claim(cur)
                stale = [] if reads_first else await write_results(cur)
                buckets, bound = (
                    (None, None) if read_buckets is None else await self._claimable(cur, read_buckets, limit)
                )
                if buckets == []:  # none of its own yet (joining), or all handed over
                    if reads_first:
                        stale = await write_results(cur)
                    return Claimed([], stale, exhausted=True)
                scanned: list[Sequence[Any]] = []
                for due, param in await self._due_ranges(cur, limit, buckets, bound):
                    if len(scanned) < limit:
                        scanned += await self._scan(cur, due, param, limit - len(scanned), buckets)
                exhausted = len(scanned) < limit
                found = self._outbox_rows(scanned, claim)
                if in_flight:  # one whose lease ran out is found again: still the caller's, its result decides
                    found = [row for row in found if row.id not in in_flight]
                if per_room and reads_first:
                    # The results' rows are still open, claimed by this process. Those the results
                    # close (published, parked) do not hold their rooms back; the others do, as they
                    # will once written. None of them is taken again here, even where its lease has
                    # run out: its result decides what becomes of it.
                    closing = _closing(results)
                    written = {r.row_id for r in results}
                    untaken = [row for row in found if row.id not in written]
                    rooms = _RoomsMet(claim, limit, hold_back_ms, closing, in_flight, written)
                    rows = await self._heads_of_rooms(cur, untaken, rooms, bool(buckets))
                    stale = await write_results(cur)
                    # A row whose result waits for another session's lock stays this process's, and
                    # is closed once that is written: it does not make the claim look again.
                    if any(r.row_id in closing and not (r.published_by_producer or r.row_locked) for r in stale):
                        rows = []  # a row counted as closed is open elsewhere: look again next claim
                else:
                    rows = found
                    if per_room:
                        rooms = _RoomsMet(claim, limit, hold_back_ms, (), in_flight)
                        rows = await self._heads_of_rooms(cur, found, rooms, bool(buckets))
                    if reads_first:
                        stale = await write_results(cur)
                if rows:
                    if on_locked is not None and committed:
                        await on_locked(rows)  # locked by this transaction: no other claim can take them
                    ids = [row.id for row in rows]
                    p = self.profile
                    in_flight_status = "" if p.in_flight == p.fresh else f", status = '{p.in_flight}'"
                    await cur.execute(
                        f"UPDATE {self.table} SET worker_id = %s, {p.lock} = {p.ms('%s')}{in_flight_status}"
                        f" WHERE {self.key} IN ({_marks(ids)})",
                        (claim, lease_until_ms, *ids),
                    )
            return Claimed(rows, stale, exhausted=exhausted)

    @asynccontextmanager
    async def _results_beside(self, results: Sequence[DeliveryResult]) -> AsyncIterator[_WrittenBeside | None]:
        """Around a claim: ``results`` written beside it (:class:`_WrittenBeside`) where the
        store does that, else None (the claim writes them). A claim that fails after they were
        written beside it raises :class:`ClaimFailedAfterResults`."""
        if not results or not self.writes_beside_claims:
            yield None
            return
        beside = _WrittenBeside(self, results)
        failure: Exception | None = None
        async with anyio.create_task_group() as writing:
            writing.start_soon(beside.write)
            await beside.connected.wait()  # its connection first: the claim waits for it, never it for the claim
            try:
                yield beside
            except Exception as exc:  # raised once the write beside it has ended
                failure = exc
        if failure is None:
            return
        if beside.stale is None:
            raise failure  # written in the claim's transaction, if at all: undone with it
        raise ClaimFailedAfterResults(beside.stale) from failure

    @property
    def writes_beside_claims(self) -> bool:
        """Whether a claim writes the results it is given beside it (:class:`_WrittenBeside`):
        the main lane's store on a server whose pool holds two connections or more says yes;
        a lane table's store writes them in its claims."""
        return False

    def _beside_transaction(self) -> AbstractAsyncContextManager[Any]:
        """:meth:`transaction` for results written beside a claim: its statements never wait
        for a row lock, but fail at once. The claim, which waits for them, may hold one: a
        locking scan that comes back short locks the index entry that ends its range, which
        may be a row whose result is being written. Failed, they are written in the claim's
        transaction instead."""
        raise NotImplementedError

    async def _scan(
        self, cur: Any, due: str, param: int, limit: int, buckets: Sequence[int] | None
    ) -> list[Sequence[Any]]:
        """The rows ``due`` (with ``param``) of the claim index's range, up to ``limit``."""
        if buckets is None:
            # MySQL's optimizer, left to choose, read the producer's old rows by the (status, id)
            # index, every pending row with them.
            hint = self.dialect.index_hint if self.claim_after_ms > 0 else ""
            sql = claim_sql(
                self.table, self.key, self.envelope_column, self.dialect.row_lock, self.profile, 0, hint, due
            )
            await cur.execute(sql, (param, limit))
        else:
            # A locking scan would lock, for a moment, every row it reads, other processes'
            # rooms' among them, and make their claims skip those rows and hold their rooms
            # back. So: read without locks, then lock what was found by key.
            sql = claim_sql(
                self.table,
                self.key,
                self.envelope_column,
                "",
                self.profile,
                len(buckets),
                self.dialect.index_hint,
                due,
                await self.row_bucket(cur, self.table, self.profile),
            )
            await cur.execute(sql, (param, *buckets, limit))
        return list(await cur.fetchall())

    def _outbox_rows(self, read: Sequence[Sequence[Any]], claim: str) -> list[OutboxRow]:
        """The rows read by :func:`claimed_columns`, as claimed by ``claim``."""
        if self.profile.attempts_limit is None:
            return [
                OutboxRow(id, event_id, event_type, room_id, app_code, envelope, retries, claim)
                for id, event_id, event_type, room_id, app_code, envelope, retries in read
            ]
        # the row's own attempts limit last
        return [
            OutboxRow(id, event_id, event_type, room_id, app_code, envelope, retries, claim, own_limit)
            for id, event_id, event_type, room_id, app_code, envelope, retries, own_limit in read
        ]

    async def _heads_of_rooms(
        self, cur: Any, found: list[OutboxRow], rooms: _RoomsMet, lock: bool = False
    ) -> list[OutboxRow]:
        """Keep a found row only if every earlier open row of its room was found too (or passes,
        see :class:`_RoomsMet`). ``lock``: the rows were found without locks (:meth:`_scan`
        with buckets): lock those still claimable first, skipping the others, in the same
        statement where the dialect allows (:meth:`_lock_and_look_back`).

        A room whose found rows are not all heads has its head taken instead, where that row
        may go now (due, not leased, not one whose result the claim writes): one statement for
        all of them (:meth:`_take_heads`), within the batch, as the room's found rows wait. A scan in ``lock``
        order meets a room through any of its open rows, and once rows were held back (a
        backlog behind failing events, as in an outage) mostly through rows that are not its
        head: so a claim takes a row of every room it meets, however long the backlog and
        whatever order its rows' locks are in.

        The found rows of a room that cannot go on now are held back: made unclaimable until
        its head may go (its ``lock``), for ``hold_back_ms`` at most (a head leased elsewhere,
        or published or requeued before its retry, says nothing of when its room goes on).
        Otherwise a room with a long backlog behind a waiting event would fill every later
        scan with rows that cannot be taken. At its head's own lock they come up again right
        behind it in the claim index, in key order, and are taken with it. The found rows of a
        room that goes on are left as they are: the next claim takes the room's next row.
        """
        if not found:
            return found
        passing = set(rooms.closing)
        if rooms.in_flight:
            met = {(row.app_code, row.room_id) for row in found}
            passing.update(row_id for row_id, room in rooms.in_flight.items() if room in met)
        found, earlier = await self._lock_and_look_back(cur, found, lock, sorted(passing))
        heads = room_heads(found, [(row_id, app_code, room_id) for row_id, app_code, room_id, _ in earlier])
        now = now_ms()
        firsts = _first_earlier_rows(found, earlier)
        may_go = [
            first for first, due in firsts.values() if due is not None and due <= now and first not in rooms.written
        ]
        # Within the batch: each of those rooms has a found row that is not taken.
        taken = await self._take_heads(cur, may_go[: rooms.limit - len(heads)], rooms.claim)
        going_on = {(row.app_code, row.room_id) for row in taken}
        head_ids = {row.id for row in heads}
        until: dict[int, list[int]] = {}
        for row in found:
            room = (row.app_code, row.room_id)
            if row.id in head_ids or room in going_on:
                continue
            _first, due = firsts[room]
            held_until = now + rooms.hold_back_ms
            if due is not None and now < due < held_until:
                held_until = due
            until.setdefault(held_until, []).append(row.id)
        await self._hold_back(cur, until)
        return heads + taken

    async def _take_heads(self, cur: Any, row_ids: Sequence[int], claim: str) -> list[OutboxRow]:
        """Of ``row_ids`` (rooms' heads outside the scan's rows), lock and read those still open
        and due, as the scan would take them, skipping those locked by others."""
        if not row_ids:
            return []
        due, param = self._due_now()
        ended = self._producers_claim_ended()
        await cur.execute(
            f"SELECT {claimed_columns(self.key, self.envelope_column, self.profile)} FROM {self.table}"
            f" WHERE {self.key} IN ({_marks(row_ids)}) AND {self.profile.is_open()} AND {due}"
            f"{' AND ' + ended if ended else ''}{self.dialect.row_lock}",
            (*row_ids, param),
        )
        return self._outbox_rows(await cur.fetchall(), claim)

    async def _hold_back(self, cur: Any, until: Mapping[int, Sequence[int]]) -> None:
        """Make rows unclaimable until a time (ms → the rows' keys), in one statement."""
        if not until:
            return
        p = self.profile
        held = sorted(row_id for rows in until.values() for row_id in rows)
        params: tuple[int, ...]
        if len(until) == 1:
            [(held_until, _rows)] = until.items()
            lock, params = p.ms("%s"), (held_until,)
        else:
            cases = " ".join(f"WHEN {self.key} IN ({_marks(rows)}) THEN {p.ms('%s')}" for rows in until.values())
            lock = f"CASE {cases} END"
            params = tuple(value for held_until, rows in until.items() for value in (*rows, held_until))
        await cur.execute(
            f"UPDATE {self.table} SET {p.lock} = {lock} WHERE {self.key} IN ({_marks(held)})", (*params, *held)
        )

    async def _lock_and_look_back(
        self, cur: Any, found: list[OutboxRow], lock: bool, passing: Sequence[int] = ()
    ) -> tuple[list[OutboxRow], list[tuple[int, str, str, int | None]]]:
        """The found rows (with ``lock``: those locked, the others skipped) and the open rows
        of their rooms below the highest of them (:func:`open_rows_of_rooms_sql`), each with
        its ``lock`` in ms, but for the found rows and ``passing`` (left out in the index
        entries, before their rows are read). A found row that fails the lock counts among its
        room's earlier open rows, open or not by now (one closed meanwhile holds its room back
        one claim: the safe side), with no ``lock`` (None: not to be taken by this claim); read
        again by the look-back, each found row would cost the claim a row more to send and
        parse. On MySQL/MariaDB the lock and the look-back are one statement (a locking read
        may be one part of a UNION there, not on PostgreSQL)."""
        p = self.profile
        rooms = sorted({row.room_id for row in found})
        hint = self.dialect.index_hint
        ids = [row.id for row in found]
        look_back_params = (*rooms, max(ids), *ids, *passing)
        besides = len(ids) + len(passing)
        if not lock:  # the scan locked what it found
            look_back = open_rows_of_rooms_sql(self.table, self.key, len(rooms), p, hint, besides=besides)
            await cur.execute(look_back, look_back_params)
            return found, [tuple(row) for row in await cur.fetchall()]
        ended = self._producers_claim_ended()
        take = (
            f"SELECT {self.key}, {p.app_code}, {p.room_id}, {p.as_ms(p.lock)}, 1 FROM {self.table}"
            f" WHERE {self.key} IN ({_marks(ids)}) AND {p.is_open()} AND {p.lock} <= {p.ms('%s')}"
            f"{' AND ' + ended if ended else ''}{self.dialect.row_lock}"
        )
        take_params = (*ids, now_ms())
        earlier: list[tuple[int, str, str, int | None]]
        if self.dialect.name == "mysql":
            # The look-back's rows are told apart by the last column (0).
            look_back = open_rows_of_rooms_sql(self.table, self.key, len(rooms), p, hint, ", 0", besides)
            await cur.execute(f"({take}) UNION ALL ({look_back})", (*take_params, *look_back_params))
            both = await cur.fetchall()
            locked = {row[0] for row in both if row[4]}
            earlier = [(row[0], row[1], row[2], row[3]) for row in both if not row[4]]
        else:
            await cur.execute(take, take_params)
            locked = {row[0] for row in await cur.fetchall()}
            look_back = open_rows_of_rooms_sql(self.table, self.key, len(rooms), p, hint, besides=besides)
            await cur.execute(look_back, look_back_params)
            earlier = [tuple(row) for row in await cur.fetchall()]
        earlier += [(row.id, row.app_code, row.room_id, None) for row in found if row.id not in locked]
        return [row for row in found if row.id in locked], earlier

    async def record(self, results: Sequence[DeliveryResult]) -> list[DeliveryResult]:
        if not results:
            return []
        if self.writes_beside_claims:
            # As beside a claim: no waiting for a row lock; where one is held, again with the
            # rows locked elsewhere skipped (:meth:`_apply_results`).
            try:
                async with self._beside_transaction() as cur:
                    return await self._apply_results(cur, results)
            except Exception as exc:
                if not row_lock_not_granted(exc):
                    raise
            async with self.transaction() as cur:
                return await self._apply_results(cur, results, skip_locked=True)
        async with self.transaction() as cur:
            return await self._apply_results(cur, results)

    async def renew(self, claim: str, row_ids: Sequence[int], lease_until_ms: int) -> int:
        if not row_ids:
            return 0
        async with self.transaction() as cur:
            # The rows another session holds locked are skipped, not waited for: a renewal
            # waiting for one row would renew none until that session ends (and hold up the
            # claims, which take turns with renewals). They are still this claim's, counted as
            # held; their leases are renewed once their locks are released.
            locked = await self._locked_elsewhere(cur, row_ids) if self.dialect.row_lock else set()
            free = [row_id for row_id in row_ids if row_id not in locked]
            held = len(locked)
            if free:
                held += int(
                    await cur.execute(
                        f"UPDATE {self.table} SET {self.profile.lock} = {self.profile.ms('%s')}"
                        f" WHERE {self.key} IN ({_marks(free)}) AND worker_id = %s AND status = '{self.profile.in_flight}'",
                        (lease_until_ms, *free, claim),
                    )
                )
            if held < len(row_ids) and free:
                held += len(await self._published_under(cur, claim, free))
            return held

    async def _locked_elsewhere(self, cur: Any, row_ids: Sequence[int]) -> set[int]:
        """Of ``row_ids``, the rows another session holds locked (room-service's transaction
        that updated one, say), read without waiting; the others are locked by this
        transaction from then on, so that its writes to them wait for no one. A row that is
        gone is not among them (its write finds it stale)."""
        await cur.execute(
            f"SELECT {self.key} FROM {self.table} WHERE {self.key} IN ({_marks(row_ids)}){self.dialect.row_lock}",
            row_ids,
        )
        free = {row[0] for row in await cur.fetchall()}
        if len(free) == len(row_ids):
            return set()
        skipped = [row_id for row_id in row_ids if row_id not in free]
        await cur.execute(f"SELECT {self.key} FROM {self.table} WHERE {self.key} IN ({_marks(skipped)})", skipped)
        return {row[0] for row in await cur.fetchall()}

    def _report_waiting(self, results: Sequence[DeliveryResult], locked: Collection[int]) -> None:
        """Log a result whose row another session holds locked once, when it has waited
        :data:`LOCKED_RESULT_WARN_S` (a claim of another process locks a row it passes for
        milliseconds; a lock held longer is a transaction of another program), and once
        more when its row is written; the rounds in between say nothing."""
        since = self._waiting_since
        if since is None:
            since = self._waiting_since = {}
        now = anyio.current_time()
        for result in results:
            if result.row_id in locked:
                first, warned = since.get(result.row_id, (now, False))
                waited = now - first
                if not warned and waited >= LOCKED_RESULT_WARN_S:
                    log.warning(
                        "result not written: another session holds its row locked; written once the lock is released",
                        extra={**self._waiting_fields(result), "waited_s": round(waited, 1)},
                    )
                    warned = True
                since[result.row_id] = (first, warned)
            elif result.row_id in since:
                first, warned = since.pop(result.row_id)
                log.log(
                    logging.WARNING if warned else logging.DEBUG,
                    "result written: the row another session held locked is free again",
                    extra={**self._waiting_fields(result), "waited_s": round(now - first, 1)},
                )

    def _waiting_fields(self, result: DeliveryResult) -> dict[str, Any]:
        return {"table": self.table, "row": result.row_id, "event_id": result.event_id, "claim": result.claim}

    async def _published_under(self, cur: Any, claim: str, row_ids: Sequence[int]) -> set[int]:
        """Of ``row_ids``, those the producer published while ``claim`` held them: delivered
        with the claim still in ``worker_id`` (a worker's own write clears it, a takeover
        replaces it)."""
        await cur.execute(
            f"SELECT {self.key} FROM {self.table} WHERE {self.key} IN ({_marks(row_ids)})"
            f" AND status = '{self.profile.delivered}' AND worker_id = %s",
            (*row_ids, claim),
        )
        return {row[0] for row in await cur.fetchall()}

    async def _tell_producer_published(self, cur: Any, stale: list[DeliveryResult]) -> list[DeliveryResult]:
        """``stale`` with the results whose row the producer published under their claim marked."""
        by_producer: set[tuple[int, str]] = set()
        for claim in sorted({r.claim for r in stale}):
            ids = sorted({r.row_id for r in stale if r.claim == claim})
            by_producer |= {(row_id, claim) for row_id in await self._published_under(cur, claim, ids)}
        return [
            dataclasses.replace(r, published_by_producer=True) if (r.row_id, r.claim) in by_producer else r
            for r in stale
        ]

    async def _apply_results(
        self, cur: Any, results: Sequence[DeliveryResult], skip_locked: bool = False
    ) -> list[DeliveryResult]:
        """Write results whose claim still holds the row; return the others (stale).

        ``skip_locked``: first lock the results' rows, skipping those another session holds
        locked (:meth:`_locked_elsewhere`); their results are not written but returned with
        ``row_locked``, for a later write. Waiting for such a lock would hold every other
        result, and the locks already taken on their rows, until the other session ends.

        Every write is fenced in its WHERE (``worker_id`` = the claim, still ``pending``), so
        a claimant that lost a row changes nothing. Published and released rows go in one
        statement per claim; only when it matched fewer rows than it was given (a lease taken
        over, an event the producer published or an operator cancelled meanwhile: rare) does
        a second read find out which. Failures are one statement each: they carry their own
        error text, and each one's row count tells whether it was stale.

        A value one row's columns cannot take (a status the column cannot hold, say) fails
        only that row's write: a refused statement of several rows is written again row by
        row, and a refused row is released with the cause in ``last_error``
        (:meth:`_release_refused`). Otherwise one row would fail its lane's every result
        write, and every claim that carries them, for ever."""
        locked = await self._locked_elsewhere(cur, sorted({r.row_id for r in results})) if skip_locked else set()
        stale = await self._write_each(cur, [r for r in results if r.row_id not in locked] if locked else results)
        if locked or self._waiting_since:  # once written: a write that failed has written nothing
            self._report_waiting(results, locked)
        if not locked:
            return stale
        return stale + [dataclasses.replace(r, row_locked=True) for r in results if r.row_id in locked]

    async def _write_each(self, cur: Any, results: Sequence[DeliveryResult]) -> list[DeliveryResult]:
        """:meth:`_apply_results` for rows none of which another session holds locked."""
        stale: list[DeliveryResult] = []
        groups: dict[tuple[str, Outcome], list[DeliveryResult]] = {}
        for result in results:
            groups.setdefault((result.claim, result.outcome), []).append(result)
        for (_claim, outcome), group in sorted(groups.items(), key=lambda item: (item[0][0], item[0][1].value)):
            if outcome in (Outcome.FAILED, Outcome.PARKED):
                for result in group:
                    stale += await self._write_or_release(cur, [result])
            else:
                stale += await self._write_or_release(cur, group)
        return await self._tell_producer_published(cur, stale) if stale else stale

    async def _write_or_release(self, cur: Any, group: list[DeliveryResult]) -> list[DeliveryResult]:
        """Write the results of one claim and outcome (:meth:`_write_results`); when the
        database refuses a value, row by row, releasing the rows it refuses."""
        try:
            async with self._undone_if_refused(cur):
                stale = await self._write_results(cur, group)
        except Exception as exc:
            cause = refused_value(exc)
            if cause is None:
                raise
        else:
            if self._refused:  # a row refused before is written now: its refusal has ended
                for result in group:
                    self._refused.pop(result.row_id, None)
            return stale
        if len(group) > 1:
            stale = []
            for result in group:
                stale += await self._write_or_release(cur, [result])
            return stale
        [result] = group
        if result.error and not result.error.isascii():
            # An error column in a character set without some of the text's characters
            # (room-service's table in latin1, a LATIN1 database) refuses the text: written
            # again with them escaped, the result keeps its outcome (a failure counted, a row
            # parked) instead of being released uncounted.
            return await self._write_or_release(cur, [dataclasses.replace(result, error=ascii_text(result.error))])
        await self._release_refused(cur, result, cause)
        return []

    @asynccontextmanager
    async def _undone_if_refused(self, cur: Any) -> AsyncIterator[None]:
        """A statement that fails leaves the transaction usable: MySQL and SQLite undo the
        failed statement alone; PostgreSQL aborts the whole transaction unless the statement
        ran after a savepoint, rolled back to."""
        if self.dialect.name != "postgresql":
            yield
            return
        await cur.execute("SAVEPOINT result_write")
        try:
            yield
        except BaseException:
            await cur.execute("ROLLBACK TO SAVEPOINT result_write")
            raise
        await cur.execute("RELEASE SAVEPOINT result_write")

    async def _write_results(self, cur: Any, group: list[DeliveryResult]) -> list[DeliveryResult]:
        """Write the results of one claim and outcome; return the stale ones."""
        now = now_ms()
        words = self.profile
        claim, outcome = group[0].claim, group[0].outcome
        held = f"worker_id = %s AND status = '{words.in_flight}'"  # the fence: still this claim's
        if outcome in (Outcome.FAILED, Outcome.PARKED):
            [r] = group
            # A parked row's lock is the profile's cleared one (silk's now(), not epoch 0).
            retry_at: tuple[int, ...] = ()
            if outcome is Outcome.PARKED:
                status, lock = f"'{words.parked}'", words.lock_cleared
            else:
                status, lock, retry_at = (
                    words.after_failure(),
                    words.lock_after_failure(words.ms("%s")),
                    (r.retry_at_ms,),
                )
            matched = await cur.execute(
                f"UPDATE {self.table} SET status = {status}, {words.attempts} = {words.attempts_made} + 1,"
                f" last_error = %s, worker_id = NULL, {words.lock} = {lock},"
                f" {words.updated} = {words.ms('%s')} WHERE {self.key} = %s AND {held}",
                ((r.error or "unknown error")[:LAST_ERROR_MAX], *retry_at, now, r.row_id, claim),
            )
            return [] if matched else [r]
        ids = sorted(r.row_id for r in group)
        if outcome is Outcome.PUBLISHED:
            # Where attempts counts the successful one too (silk's), in the same statement.
            counted = f"{words.attempts} = {words.attempts_made} + 1, " if words.counts_success else ""
            change = (
                f"status = '{words.delivered}', {counted}last_error = NULL, worker_id = NULL,"
                f" {words.lock} = {words.lock_cleared}, {words.updated} = {words.ms('%s')}"
            )
            done = f"status = '{words.delivered}' AND worker_id IS NULL AND {words.updated} = {words.ms(str(int(now)))}"
            params: tuple[Any, ...] = (now, *ids, claim)
        else:  # RELEASED, THROTTLED: back to what it was before the claim, unattempted
            back = "" if words.in_flight == words.fresh else f"status = {words.released()}, "
            # THROTTLED: not before the latest time its limits may have room (0: at once).
            due = max(r.retry_at_ms for r in group)
            lock = words.ms("%s") if due else words.lock_cleared
            # A throttled row the destination refused records why, in this same statement
            # (one CASE over the rows that carry an error); the others keep their last_error.
            noted = sorted((r.row_id, r.error[:LAST_ERROR_MAX]) for r in group if r.error)
            cases = " WHEN %s THEN %s" * len(noted)
            note = f", last_error = CASE {self.key}{cases} ELSE last_error END" if noted else ""
            change = f"{back}worker_id = NULL, {words.lock} = {lock}{note}"
            done = f"{words.is_waiting()} AND worker_id IS NULL"
            params = (*((due,) if due else ()), *(value for pair in noted for value in pair), *ids, claim)
        matched = await cur.execute(
            f"UPDATE {self.table} SET {change} WHERE {self.key} IN ({_marks(ids)}) AND {held}",
            params,
        )
        if matched == len(ids):
            return []
        await cur.execute(f"SELECT {self.key} FROM {self.table} WHERE {self.key} IN ({_marks(ids)}) AND {done}", ids)
        written = {row[0] for row in await cur.fetchall()}
        return [r for r in group if r.row_id not in written]

    async def _release_refused(self, cur: Any, result: DeliveryResult, cause: str) -> None:
        """A row whose result the database refused goes back to what it was before the claim
        (a status its column holds), due again after the retry time (at the soonest
        :data:`REFUSED_RETRY_MS` from now, so that a refusal that lasts costs one attempt per
        interval), with the cause in ``last_error``. If even that is refused, the row stays
        as the claim left it and is taken again once its lease runs out."""
        words = self.profile
        back = "" if words.in_flight == words.fresh else f"status = {words.released()}, "
        unattempted = result.outcome in (Outcome.RELEASED, Outcome.THROTTLED)
        counted = "" if unattempted else f", {words.attempts} = {words.attempts_made} + 1"
        error = f"its {result.outcome.value} result was refused by the database: {cause}"
        if result.error:
            error += f"; {result.error}"
        error = ascii_text(error)  # not refused in turn for a character its column cannot hold
        due = max(result.retry_at_ms, now_ms() + REFUSED_RETRY_MS)
        try:
            async with self._undone_if_refused(cur):
                await cur.execute(
                    f"UPDATE {self.table} SET {back}worker_id = NULL{counted}, last_error = %s,"
                    f" {words.lock} = {words.ms('%s')} WHERE {self.key} = %s"
                    f" AND worker_id = %s AND status = '{words.in_flight}'",
                    (error[:LAST_ERROR_MAX], due, result.row_id, result.claim),
                )
        except Exception as exc:
            refused = refused_value(exc)
            if refused is None:
                raise
            self._report_refused(result, cause, f"its release was refused too ({refused})")
            return
        self._report_refused(result, cause)

    def _report_refused(self, result: DeliveryResult, cause: str, release_refused: str | None = None) -> None:
        """One ERROR per row while the database goes on refusing its result for the same
        reason (then DEBUG): such a row comes back every :data:`REFUSED_RETRY_MS`, and a
        refusal of every parked row, say, would otherwise be a line per row per minute."""
        refused = self._refused
        if refused is None:
            refused = self._refused = {}
        again = refused.pop(result.row_id, None) == cause
        refused[result.row_id] = cause  # the newest last: the oldest is forgotten first
        if len(refused) > REFUSALS_REMEMBERED:
            del refused[next(iter(refused))]
        if release_refused is None:
            message = "result refused by the database; the row is released, due again in a minute at the soonest (see last_error)"
        else:
            message = f"result refused by the database, and {release_refused}; taken again once its lease runs out"
        fields = {
            "table": self.table,
            "row": result.row_id,
            "event_id": result.event_id,
            "outcome": result.outcome.value,
            "status": self._status_written(result.outcome),
            "error": cause,
        }
        log.log(logging.DEBUG if again else logging.ERROR, message, extra=fields)

    def _status_written(self, outcome: Outcome) -> str:
        """The status the result of ``outcome`` writes (a released row's goes back to what it
        was before the claim)."""
        words = self.profile
        if outcome is Outcome.PUBLISHED:
            return words.delivered
        if outcome is Outcome.PARKED:
            return words.parked
        if outcome is Outcome.FAILED:
            return words.retry if words.attempts_limit is None else f"{words.retry} or {words.parked}"
        return words.in_flight if words.in_flight == words.fresh else f"{words.fresh} or {words.retry}"


class _WrittenBeside:
    """Results a claim writes beside it, in a transaction of their own on another of the
    pool's connections: the database works on them while it reads the claim's rows, and the
    claim waits for their commit only before it writes its leases (:meth:`finish`)."""

    def __init__(self, rows: LeasedRows, results: Sequence[DeliveryResult]) -> None:
        self.rows = rows
        self.results = results
        #: The write holds its connection, or gave up getting one.
        self.connected = anyio.Event()
        self.done = anyio.Event()
        #: Once committed: the results whose claim no longer held their row.
        self.stale: list[DeliveryResult] | None = None

    async def write(self) -> None:
        try:
            async with self.rows._beside_transaction() as cur:
                self.connected.set()
                stale = await self.rows._apply_results(cur, self.results)
            self.stale = stale
        except Exception as exc:  # written in the claim's transaction instead
            log.debug("results not written beside the claim (%s); writing them in it", type(exc).__name__)
        finally:
            self.connected.set()
            self.done.set()

    async def finish(self, cur: Any) -> tuple[list[DeliveryResult], bool]:
        """The stale results, and whether the results are committed: once written beside,
        yes; where that failed, they are written in the claim's transaction (``cur``), not
        yet committed. There, the rows another session holds locked are skipped (their
        results come back ``row_locked``): the claim waits for no one else's lock, so that
        the lane goes on and the other rows it locks are not held for as long."""
        await self.done.wait()
        if self.stale is not None:
            return self.stale, True
        return await self.rows._apply_results(cur, self.results, skip_locked=True), False
