"""Consumption lanes besides the main lane: one table per lane, fed from ``room_outbox``
without gaps, on MySQL, PostgreSQL and SQLite alike.

``room_outbox.status`` belongs to the main lane. Every other sink keeps its own state in
``room_outbox_lane_<name>``: the main lane's columns and indexes (so the same claim, lease,
fencing, retry, parking and per-room code serves it), keyed by ``outbox_id``, without a copy
of the envelope (read from ``room_outbox`` at claim time). A table per lane keeps one lane's
backlog, indexes and clean-up off every other's. Feeding (:meth:`LaneStore._feed`) must copy
every committed row although ids commit out of order, and adds nothing to room-service's write
path: no trigger, no extra write, only reads of ``room_outbox`` by primary key.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any, ClassVar

from room_outbox.config import LanesSettings
from room_outbox.store.backends.leased import LeasedRows
from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import key_chunks, table_names, text
from room_outbox.store.dialect import marks as _marks
from room_outbox.store.protocol import BucketReader, Claimed, DeliveryResult, OutboxRow
from room_outbox.store.schema.lanes import (
    CURSOR_TABLE,
    KEPT_WIDTH,
    SKIPPED_TABLE,
    copied_columns,
    cursor_ddl,
    lane_ddl,
    lane_table,
)
from room_outbox.store.schema.profiles import V1
from room_outbox.store.schema.registry import WantedSchema, migrate
from room_outbox.store.schema.tail import LANE_SKIPPED_ERROR, skipped_rows

if TYPE_CHECKING:
    from room_outbox.store.protocol import SQLStore
    from room_outbox.store.schema.profiles import Profile

log = logging.getLogger("room_outbox.lanes")


async def migrate_lanes(store: SQLStore, lanes: Sequence[str]) -> list[str]:
    """Create the cursor table and each lane's table (idempotent), through the one migration
    path (:mod:`room_outbox.store.schema.registry`)."""
    return await migrate(store, WantedSchema(outbox=False, lanes=tuple(lanes)))


@dataclass(frozen=True)
class StartPosition:
    """Where a new lane starts: every id at or below ``fed_through_id`` is before its start, and
    so is every id above it up to ``read_through_id`` but those in ``missing``: ids still in
    flight at the start (a producer's transaction open then), waited for as gaps and sent once
    they commit."""

    fed_through_id: int
    read_through_id: int | None = None
    missing: tuple[tuple[int, int], ...] = ()


def start_id(start: str | int, max_id: int) -> int:
    """The watermark a new lane starts from: ``now`` (only events from now on), ``beginning``
    (every row in the table) or an id (that row and everything after it)."""
    if start == "now":
        return max_id
    if start == "beginning":
        return 0
    return max(int(start) - 1, 0)


@dataclass
class Gap:
    """Ids in ``[low, high]`` on the feeder's lattice, missing since ``first_seen`` (monotonic),
    but those of ``read``."""

    low: int
    high: int
    first_seen: float
    #: ``(step, residue)``: the ids equal to ``residue`` modulo ``step`` are not waited for, read
    #: already when the step got finer (:meth:`LaneStore._learn_step`); None: every id.
    read: tuple[int, int] | None = None

    def waits_for(self, outbox_id: int) -> bool:
        """Whether ``outbox_id`` is one of the ids the gap waits for."""
        return self.low <= outbox_id <= self.high and not self.was_read(outbox_id)

    def was_read(self, outbox_id: int) -> bool:
        """Whether ``outbox_id`` is among the ids ``read`` names (in the range or not)."""
        return self.read is not None and (outbox_id - self.read[1]) % self.read[0] == 0

    def trimmed(self) -> Gap | None:
        """The gap without ids read at its ends (two such ids are never next to each other),
        None when nothing is left."""
        low = self.low + 1 if self.was_read(self.low) else self.low
        high = self.high - 1 if self.was_read(self.high) else self.high
        return dataclasses.replace(self, low=low, high=high) if low <= high else None

    def waited_ranges(self) -> list[Gap]:
        """The gap as ranges of ids waited for alone (every id in each): what is recorded when
        it is given up on, so that no id read before is taken as skipped."""
        if self.read is None:
            return [self]
        step, residue = self.read
        first_read = self.low + (residue - self.low) % step  # the lowest id read at or above low
        bounds = range(first_read - step, self.high + 1, step)  # ids read, one before low
        ranges = (Gap(max(b + 1, self.low), min(b + step - 1, self.high), self.first_seen) for b in bounds)
        return [gap for gap in ranges if gap.low <= gap.high]


_FEEDING = LanesSettings()
#: Differences between ids read before a step above 1 is believed.
STEP_EVIDENCE = 16
#: Seconds between two checks, by an idle lane, that room_outbox's ids have not started again.
ID_CHECK_INTERVAL = 60.0
#: Ids per feeding INSERT … SELECT (placeholders: within every database's limit).
COPY_CHUNK = 500
#: Skipped ranges per statement (four placeholders each: within every database's limit).
SKIPPED_CHUNK = 250
#: Rows a lane starting ``now`` looks back over, at most, for ids still in flight
#: (:meth:`LaneStore._start_now`).
START_LOOKBACK = 10_000


def _copied(row: OutboxRow) -> tuple[str, str, str, str]:
    """The text values a lane keeps copies of."""
    return row.event_id, row.event_type, row.room_id, row.app_code


@dataclass
class LaneStore(LeasedRows):
    """One lane: :class:`~room_outbox.store.OutboxStore` over ``room_outbox_lane_<name>``,
    sharing its owner's (the main lane's store's) connections and dialect, fed from
    ``room_outbox`` before each claim."""

    #: What a skipped event taken back (:meth:`take_skipped`) is, to be sent: pending in the table.
    skipped_to_send: ClassVar[str] = V1.fresh

    owner: SQLStore
    lane: str
    start: str | int = "now"
    gap_timeout: float = _FEEDING.gap_timeout
    feed_batch: int = _FEEDING.feed_batch
    max_gaps: int = _FEEDING.max_gaps
    key: str = "outbox_id"
    envelope_column: str = "''"  # set from the owner's profile (see __post_init__)
    _high: int = -1  # the highest room_outbox id this process has seen
    _gaps: list[Gap] = field(default_factory=list)
    #: The greatest common divisor of the differences between ids read (0: none yet), and how
    #: many differences it is built on.
    _gcd: int = 0
    _differences: int = 0
    _last_id: int | None = None
    #: (monotonic time, lowest id read then), one entry a second at most, back ``gap_timeout``:
    #: where to look again from when the lattice gets finer.
    _recent: list[tuple[float, int]] = field(default_factory=list)
    #: When an idle round next checks that room_outbox's ids have not started again (monotonic).
    _next_id_check: float = 0.0
    #: Whether the lane's cursor row is known to exist (:meth:`_create_cursor`).
    _cursor_made: bool = False

    def __post_init__(self) -> None:
        self.table = lane_table(self.lane)
        self.dialect = self.owner.dialect
        # The claim reads each row's envelope from room_outbox in the same statement, by primary
        # key: one round trip less per claim than a second SELECT. A locking claim does not lock
        # what a subquery in its column list reads (MySQL/MariaDB and PostgreSQL alike), so the
        # main lane's claims on room_outbox are not made to skip those rows. A row deleted from
        # room_outbox meanwhile gets no envelope (NULL, whatever the column's type): it fails
        # as a bad envelope, visibly, instead of vanishing.
        p = self.owner.profile
        self.envelope_column = (
            f"(SELECT {self.owner.envelope_column} FROM {p.table} WHERE {p.key} = {self.table}.outbox_id)"
        )

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        return self.owner.transaction()

    def _room_buckets(self) -> BucketReader | None:
        return self.owner.room_buckets  # one membership per process: every lane claims the same rooms

    async def row_bucket(self, cur: Any, table: str, profile: Profile) -> str:
        return await self.owner.row_bucket(cur, table, profile)  # read once per process, with the fence's

    async def migrate(self) -> list[str]:
        return await migrate_lanes(self.owner, [self.lane])

    async def aclose(self) -> None:
        """The connections belong to the owner store."""

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
        await self._create_cursor()
        # Not ``on_locked``: a copy's values may be cut, and the rows are whole only once read
        # again after the claim.
        with self._forgotten_unless_committed():
            claimed = await super().claim(claim, limit, lease_until_ms, results, per_room, hold_back_ms, in_flight)
        cut = [row.id for row in claimed.rows if max(map(len, _copied(row))) >= KEPT_WIDTH]
        if not cut:
            return claimed
        whole = await self._whole_values(cut)
        rows = []
        for row in claimed.rows:
            if row.id in whole:
                event_id, event_type, room_id, app_code = whole[row.id]
                row = dataclasses.replace(
                    row, event_id=event_id, event_type=event_type, room_id=room_id, app_code=app_code
                )
            rows.append(row)
        return dataclasses.replace(claimed, rows=rows)

    async def _whole_values(self, outbox_ids: list[int]) -> dict[int, tuple[str, str, str, str]]:
        """The text values of ``outbox_ids`` as room_outbox holds them, for rows whose copies may
        have been cut (:attr:`_source_columns`): the envelope is checked against these."""
        p = self.owner.profile
        async with self.transaction() as cur:
            await cur.execute(
                f"SELECT {p.key}, {p.event_id}, {p.event_type}, {p.room_id}, {p.app_code} FROM {p.table}"
                f" WHERE {p.key} IN ({_marks(outbox_ids)})",
                outbox_ids,
            )
            return {int(key): (text(e), text(t), text(r), text(a)) for key, e, t, r, a in await cur.fetchall()}

    async def _before_claim(self, cur: Any) -> int:
        # Feeding in the claim's own transaction: rows fed are claimable at once, and a round
        # costs one transaction, not two. The cursor row stays locked until the claim commits;
        # other processes skip feeding meanwhile (SKIP LOCKED) and go straight on to claiming.
        fed_from = now_ms()
        await self._feed(cur)
        return now_ms() - fed_from

    # -- feeding -------------------------------------------------------------------------

    @property
    def _source_columns(self) -> str:
        """What a lane copies of an outbox row (:func:`copied_columns`)."""
        return copied_columns(self.owner.profile)

    async def feed(self) -> int:
        """One feeding round in a transaction of its own; returns rows added to the lane."""
        await self._create_cursor()
        with self._forgotten_unless_committed():
            async with self.transaction() as cur:
                return await self._feed(cur)

    @contextmanager
    def _forgotten_unless_committed(self) -> Iterator[None]:
        """What a feeding round learnt (ids seen, gaps, step) is undone when its transaction
        does not commit: its inserts are rolled back, so the rows must be read again."""
        before = (self._high, list(self._gaps), self._gcd, self._differences, self._last_id, list(self._recent))
        try:
            yield
        except BaseException:
            self._high, self._gaps, self._gcd, self._differences, self._last_id, self._recent = before
            raise

    async def _feed(self, cur: Any) -> int:
        """One feeding round with ``cur``; returns rows added to the lane.

        Each row is copied once per lane (an INSERT that skips duplicates). Ids commit out of
        order (a transaction holding id 100 can commit after id 101 was read), so the lane keeps
        a watermark, ``room_outbox_lane_cursor.fed_through_id``: every id at or below it is fed
        or known never to exist. A round (1) reads rows above the highest id seen, (2) looks
        again for the ids it saw missing, feeding those committed since, and (3) moves the
        watermark up to just below the oldest id still missing. An id missing for longer than
        ``gap_timeout`` is taken as a rolled-back insert and given up on (logged): a producer
        transaction that holds its id longer is not fed, but its range is recorded
        (:meth:`_record_skipped`): once it commits, ``status`` counts it and ``requeue --lane``
        feeds it. At most ``max_gaps`` ranges are waited for, so the query never grows past
        that many terms.

        Several processes may feed one lane: the cursor row is taken with ``FOR UPDATE SKIP
        LOCKED`` (SQLite serialises every writer anyway), so one feeds at a time and the others
        go straight on to claiming."""
        # Read first, lock the cursor only when there is something to feed: a round that finds
        # nothing new and waits for no gap costs one primary-key read.
        fresh = await self._fetch_new(cur)
        if not fresh and not self._gaps and self._high >= 0:
            await self._warn_if_ids_started_again(cur, self._high)
            return 0
        cursor = await self._lock_cursor(cur)
        if cursor is None:
            return 0  # another process is feeding this lane right now
        watermark = int(cursor[0])
        if watermark > self._high:  # another process fed further: start from there
            self._high = watermark
            fresh = await self._fetch_new(cur)
        self._gaps = [g for g in self._gaps if g.high > watermark]
        self._take_new(fresh, watermark)
        ids = fresh + await self._read_gaps(cur, watermark)
        await self._copy(cur, ids)
        skipped = self._expire_gaps() + self._bound_gaps()
        if skipped:
            await self._record_skipped(cur, skipped)
        new_watermark = min(g.low for g in self._gaps) - 1 if self._gaps else self._high
        if new_watermark > watermark:
            await cur.execute(
                f"UPDATE {CURSOR_TABLE} SET fed_through_id = %s, updated_at_ms = %s WHERE lane = %s",
                (new_watermark, now_ms(), self.lane),
            )
        return len(ids)

    async def _warn_if_ids_started_again(self, cur: Any, passed: int) -> None:
        """On an idle round, once a minute at most: warn when the next id room_outbox will give is
        at or below ``passed``, the highest id the lane has passed, and no row holds ``passed``
        or a higher id any more. Its ids started again (the table truncated, its sequence
        restarted), and the lane would never send the rows given those ids again. (Both, as
        MySQL 8 may report a table's next id from a statistics cache, late.) Read with the
        round's own cursor, no second connection; a role that may not read the sequence
        (PostgreSQL) fails this statement alone."""
        now = time.monotonic()
        if not self.owner.dialect.next_id_sql or now < self._next_id_check:
            return
        self._next_id_check = now + ID_CHECK_INTERVAL
        p = self.owner.profile
        try:
            async with self._undone_if_refused(cur):
                await cur.execute(self.owner.dialect.next_id_sql.format(table=p.table, key=p.key))
                row = await cur.fetchone()
        except Exception as exc:
            log.debug("could not read room_outbox's next id", extra={"lane": self.lane, "error": str(exc)})
            return
        if row is None or row[0] is None or int(row[0]) > passed or (row[1] is not None and int(row[1]) >= passed):
            return
        log.error(
            "room_outbox's ids started again below this lane's cursor (the table truncated, or its"
            " sequence restarted): the lane never sends rows given ids it has passed; retire the lane"
            " and start it again from the beginning (lanes retire, then start: beginning)",
            extra={"lane": self.lane, "next_id": int(row[0]), "passed_id": passed},
        )

    async def _copy(self, cur: Any, ids: Sequence[int]) -> None:
        """Copy the rows ``ids`` of ``room_outbox`` into the lane's table, in the database: no
        row travels to this process and back. (On MySQL/MariaDB at READ COMMITTED, the isolation
        every connection here sets, the rows read are not locked, so the main lane's claims of
        them are not held up; nor are they on PostgreSQL or SQLite.) A row fed already is kept
        as it is."""
        p, now = self.owner.profile, int(now_ms())
        for first in range(0, len(ids), COPY_CHUNK):
            chunk = ids[first : first + COPY_CHUNK]
            insert = (
                f"INSERT INTO {self.table} (outbox_id, event_id, event_type, room_id, app_code,"
                f" created_at_ms, updated_at_ms) SELECT {self._source_columns}, {now}, {now}"
                f" FROM {p.table} WHERE {p.key} IN ({_marks(chunk)})"
            )
            await cur.execute(self.dialect.insert_skipping_duplicates(insert, "outbox_id"), chunk)

    async def _create_cursor(self) -> None:
        """Create the lane's cursor row where ``start`` says, unless it is known to exist, in a
        transaction of its own, committed before any round's work. A round that fails rolls
        back its own writes only: the lane's start is fixed once (``now`` measured again each
        round would pass over the rows committed meanwhile), and the lane counts as started
        while its first rounds fail."""
        if self._cursor_made:
            return
        async with self.transaction() as cur:
            await cur.execute(f"SELECT 1 FROM {CURSOR_TABLE} WHERE lane = %s", (self.lane,))
            if await cur.fetchone() is None:
                if self.start == "now":
                    start = await self._start_now(cur)
                else:
                    p = self.owner.profile
                    await cur.execute(f"SELECT COALESCE(MAX({p.key}), 0) FROM {p.table}")
                    (max_id,) = await cur.fetchone()
                    start = StartPosition(start_id(self.start, int(max_id)))
                if await self._insert_cursor(cur, start):  # not when another process made it first
                    log.info(
                        "lane started",
                        extra={
                            "lane": self.lane,
                            "start": str(self.start),
                            "fed_through_id": start.fed_through_id,
                            "in_flight_ranges": len(start.missing),
                        },
                    )
        self._cursor_made = True

    async def _start_now(self, cur: Any) -> StartPosition:
        """Where a lane starting ``now`` starts: after the highest id, but for the ids missing
        below it that may still commit (a producer's transaction open at the start), which are
        waited for as any gap is, up to ``gap_timeout``, and sent once they commit.

        The window looked at: the rows created within ``gap_timeout`` before the start, at most
        :data:`START_LOOKBACK` of them. Their creation times are the producer's clock: the start
        is the earlier of the database's now and the newest row's creation, so a producer's
        clock behind the database's narrows the window by nothing. A lane running all along
        would be waiting for just those ids: one missing below a row created longer ago it would
        have seen missing that long ago and given up on (a rolled-back insert), so it is neither
        waited for nor warned about. The bound keeps the start's one read, and the rows it
        marks done, small on a busy table: an id missing further back belongs to a transaction
        open while that many later rows were inserted. Ids follow the step their differences
        show (:attr:`_step`), and at most ``max_gaps`` ranges are waited for (the highest)."""
        p = self.owner.profile
        await cur.execute(
            f"SELECT {p.key}, {p.as_ms(p.created)} FROM {p.table} ORDER BY {p.key} DESC LIMIT %s", (START_LOOKBACK,)
        )
        rows = [(int(key), created) for key, created in await cur.fetchall()]
        if not rows:
            return StartPosition(0)
        newest = rows[0][1]
        started = now_ms() if newest is None else min(now_ms(), int(newest))
        recent_from = started - self.gap_timeout * 1000
        window: list[int] = []  # from the highest id down
        for key, created in rows:
            window.append(key)
            if created is not None and int(created) < recent_from:
                break  # made before the window: ids missing below it are given up on already
        ids = [key for key, _ in reversed(rows)]
        differences = [high - low for low, high in pairwise(ids)]
        step = math.gcd(*differences) if len(differences) >= STEP_EVIDENCE else 1
        window.reverse()
        missing = [(low + step, high - step) for low, high in pairwise(window) if high - low > step]
        missing = missing[-self.max_gaps :]
        max_id = rows[0][0]
        if not missing:
            return StartPosition(max_id)
        return StartPosition(missing[0][0] - 1, max_id, tuple(missing))

    async def _insert_cursor(self, cur: Any, start: StartPosition) -> bool:
        """Make the lane's cursor row at ``start``; False when another process made it first.
        Ids still in flight at the start are waited for by the feeder, which goes on from
        ``fed_through_id``: the rows committed above it before the start go into the lane's
        table as done, so it neither feeds nor sends them."""
        insert = f"INSERT INTO {CURSOR_TABLE} (lane, fed_through_id, updated_at_ms) VALUES (%s, %s, %s)"
        await cur.execute(
            self.dialect.insert_skipping_duplicates(insert, "lane"), (self.lane, start.fed_through_id, now_ms())
        )
        if not cur.rowcount:
            return False
        if start.missing and start.read_through_id is not None:
            p, now = self.owner.profile, now_ms()
            # Not the ids still in flight, whether or not they have committed meanwhile.
            waited = f" AND {p.key} NOT BETWEEN %s AND %s" * len(start.missing)
            insert = (
                f"INSERT INTO {self.table} (outbox_id, event_id, event_type, room_id, app_code, status, last_error,"
                f" created_at_ms, updated_at_ms) SELECT {self._source_columns}, %s, %s, %s, %s"
                f" FROM {p.table} WHERE {p.key} > %s AND {p.key} <= %s{waited}"
            )
            await cur.execute(
                self.dialect.insert_skipping_duplicates(insert, "outbox_id"),
                (
                    V1.delivered,
                    "committed before the lane's start: not sent",
                    now,
                    now,
                    start.fed_through_id,
                    start.read_through_id,
                    *(bound for gap in start.missing for bound in gap),
                ),
            )
        return True

    async def _lock_cursor(self, cur: Any, also: str = "", params: Sequence[Any] = ()) -> Sequence[Any] | None:
        """The lane's cursor row (:meth:`_create_cursor` made it), locked: its
        ``fed_through_id``, then the ``also`` columns (SQL taking ``params``); None when
        another process holds it, or when it is gone (the lane retired meanwhile: the next
        round makes it again)."""
        query = f"SELECT fed_through_id{also} FROM {CURSOR_TABLE} WHERE lane = %s{self.dialect.row_lock}"
        await cur.execute(query, (*params, self.lane))
        row = await cur.fetchone()
        if row is not None:
            return tuple(row)
        await cur.execute(f"SELECT 1 FROM {CURSOR_TABLE} WHERE lane = %s", (self.lane,))
        if await cur.fetchone() is None:
            self._cursor_made = False
        return None

    async def _fetch_new(self, cur: Any) -> list[int]:
        """Ids above the highest id seen, up to ``feed_batch``."""
        key = self.owner.profile.key
        await cur.execute(
            f"SELECT {key} FROM {self.owner.profile.table} WHERE {key} > %s ORDER BY {key} LIMIT %s",
            (self._high, self.feed_batch),
        )
        return [int(row[0]) for row in await cur.fetchall()]

    def _take_new(self, ids: list[int], watermark: int) -> None:
        """Learn from ids just read above the highest id seen: the step, the ids missing."""
        if not ids:
            return
        now = time.monotonic()
        self._remember(now, ids[0])
        previous = self._last_id
        if self._gcd != 1:  # a step of 1 is final: no difference makes it finer
            for row_id in ids:  # learn the step before deciding what is missing
                if previous is not None:
                    self._learn_step(row_id, previous, watermark, now)
                previous = row_id
        after = self._high
        for row_id in ids:
            if row_id - after > 1:  # ids in between that may still commit
                self._add_gap(after, row_id, now)
            after = row_id
        self._high = self._last_id = ids[-1]
        self._gaps = [trimmed for gap in self._gaps if (trimmed := self._on_lattice(gap))]

    def _remember(self, now: float, first_id: int) -> None:
        if not self._recent or now - self._recent[-1][0] >= 1.0:
            self._recent.append((now, first_id))
        while len(self._recent) > 1 and now - self._recent[1][0] > self.gap_timeout:
            self._recent.pop(0)  # the oldest kept entry still reaches back gap_timeout

    @property
    def _step(self) -> int:
        """Ids are ``_last_id`` plus a multiple of this. With ``auto_increment_increment`` > 1
        (Galera, some HA set-ups, a session that sets it) the ids skipped between two inserts
        will never exist and must not be waited for. The step is learnt from the ids themselves:
        the greatest common divisor of the differences between ids read, which every real step
        divides. Believed only on enough evidence: two ids around one rolled-back insert differ
        by 2 whatever the step."""
        return self._gcd if self._differences >= STEP_EVIDENCE else 1

    def _learn_step(self, row_id: int, known: int, watermark: int, now: float) -> None:
        """Take one more difference between ids read, ``row_id`` and ``known``, into
        :attr:`_step`. An id off the lattice (another writer with another offset) makes it
        finer: then the ids off the old lattice within ``gap_timeout`` are waited for, so that
        writer's late commits are still sent."""
        before = self._step
        self._gcd = math.gcd(self._gcd, row_id - known)
        self._differences += 1
        step = self._step
        if step < before:
            # A finer lattice: ids between the old lattice's points were never waited for.
            # Those on it, ``known``'s, were read (or are in the gaps, which stay): waiting
            # for them again would send them twice (a tailing lane). Costs nothing until it
            # happens: one more range term while the new gap lasts.
            low = min([watermark, *(first_id - 1 for _, first_id in self._recent)]) + 1
            log.warning(
                "room_outbox ids follow a finer step than seen so far; recent ids off the old step are looked at again",
                extra={"lane": self.lane, "step": step, "previous_step": before, "from_id": low},
            )
            gap = Gap(low, self._high, now, read=(before, known % before)).trimmed()
            if gap is not None:
                self._gaps.append(gap)

    def _add_gap(self, after: int, before: int, now: float) -> None:
        """Wait for the ids strictly between ``after`` and the id ``before`` that was just read."""
        gap = self._on_lattice(Gap(after + 1, before - 1, now), anchor=before)
        if gap is not None:
            self._gaps.append(gap)

    def _on_lattice(self, gap: Gap, anchor: int | None = None) -> Gap | None:
        """``gap`` narrowed to the ids that can exist (``anchor``: an id known to exist)."""
        anchor = self._last_id if anchor is None else anchor
        step = self._step
        if anchor is None or step == 1:
            return gap.trimmed() if gap.low <= gap.high else None
        if gap.read is not None and step % gap.read[0] == 0 and gap.was_read(anchor):
            return None  # every id on the lattice was read (the step is coarse again)
        low = gap.low + (anchor - gap.low) % step
        high = gap.high - (gap.high - anchor) % step
        # An id read at an end: the next lattice point is not one (no two points in a row are).
        if gap.was_read(low):
            low += step
        if gap.was_read(high):
            high -= step
        return dataclasses.replace(gap, low=low, high=high) if low <= high else None

    async def _read_gaps(self, cur: Any, watermark: int) -> list[int]:
        """Ids that have committed inside the ranges seen missing (:meth:`_turned_up`)."""
        if not self._gaps:
            return []
        ranges, bounds = self._gap_ranges()
        key = self.owner.profile.key
        await cur.execute(f"SELECT {key} FROM {self.owner.profile.table} WHERE {ranges} ORDER BY {key}", bounds)
        found = [int(row[0]) for row in await cur.fetchall()]
        self._turned_up(found, watermark)
        return found

    def _gap_ranges(self) -> tuple[str, list[int]]:
        """SQL matching the ids in the ranges seen missing, and its parameters. A range's ids
        read already (:attr:`Gap.read`) are not matched: ``%%`` is the modulo of every database
        (MySQL, PostgreSQL, SQLite) written for the driver's paramstyle."""
        key = self.owner.profile.key
        terms = [
            f"{key} BETWEEN %s AND %s" if gap.read is None else f"({key} BETWEEN %s AND %s AND ({key} - %s) %% %s <> 0)"
            for gap in self._gaps
        ]
        bounds = [
            bound
            for gap in self._gaps
            for bound in ((gap.low, gap.high) if gap.read is None else (gap.low, gap.high, gap.read[1], gap.read[0]))
        ]
        return f"({' OR '.join(terms)})", bounds

    def _turned_up(self, found: Sequence[int], watermark: int) -> None:
        """``found`` (in id order) have committed: the ranges seen missing shrink to what is
        still missing (a range splits around a row that turned up)."""
        if not found:
            return
        if self._gcd != 1 and self._last_id is not None:
            # A late id off the lattice makes the step finer too; the range then waited for
            # holds ``found``, read now, so learnt before the ranges shrink.
            now = time.monotonic()
            for row_id in found:
                self._learn_step(row_id, self._last_id, watermark, now)
        remaining: list[Gap] = []
        for gap in self._gaps:
            low = gap.low
            for row_id in (i for i in found if gap.low <= i <= gap.high):
                if row_id > low:
                    remaining.append(dataclasses.replace(gap, low=low, high=row_id - 1))
                low = row_id + 1
            if low <= gap.high:
                remaining.append(dataclasses.replace(gap, low=low))
        self._gaps = [trimmed for gap in remaining if (trimmed := self._on_lattice(gap))]

    async def _record_skipped(self, cur: Any, gaps: Sequence[Gap]) -> None:
        """Record the ranges given up on, one row a range however many ids it holds, in the
        round's transaction: an insert that commits after all is then told apart from the
        events sent (``inspect``, ``status``) and can be sent (``requeue --lane``). A range
        recorded before with the same first id (the watermark moved back since) is replaced.
        Only when a range is given up on: a round that gives up on none writes nothing here.
        Of a range with ids read already (:attr:`Gap.read`) only the ids waited for."""
        now = now_ms()
        gaps = [part for gap in gaps for part in gap.waited_ranges()]
        for first in range(0, len(gaps), SKIPPED_CHUNK):
            chunk = gaps[first : first + SKIPPED_CHUNK]
            lows = [gap.low for gap in chunk]
            await cur.execute(
                f"DELETE FROM {SKIPPED_TABLE} WHERE lane = %s AND low_id IN ({_marks(lows)})", [self.lane, *lows]
            )
            await cur.execute(
                f"INSERT INTO {SKIPPED_TABLE} (lane, low_id, high_id, skipped_at_ms) VALUES"
                + ", ".join(["(%s, %s, %s, %s)"] * len(chunk)),
                [value for gap in chunk for value in (self.lane, gap.low, gap.high, now)],
            )

    async def _skipped_among(self, cur: Any, ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """The lane's skipped ranges (``low_id``, ``high_id``, ``skipped_at_ms``) that may hold
        some of ``ids`` (sorted)."""
        await cur.execute(
            f"SELECT low_id, high_id, skipped_at_ms FROM {SKIPPED_TABLE} WHERE lane = %s AND low_id <= %s"
            " AND high_id >= %s",
            (self.lane, ids[-1], ids[0]),
        )
        return [(int(low), int(high), int(at)) for low, high, at in await cur.fetchall()]

    async def _leave_skipped(self, cur: Any, ranges: Sequence[tuple[int, int, int]], taken: Sequence[int]) -> None:
        """Take the ids ``taken`` out of the skipped ``ranges`` (a range splits around them), so
        that the ranges hold only what is still skipped."""
        for low, high, at in ranges:
            inside = [i for i in taken if low <= i <= high]
            if not inside:
                continue
            bounds = [low - 1, *inside, high + 1]
            rest = [(a + 1, b - 1) for a, b in itertools.pairwise(bounds) if a + 1 <= b - 1]
            await cur.execute(f"DELETE FROM {SKIPPED_TABLE} WHERE lane = %s AND low_id = %s", (self.lane, low))
            for part_low, part_high in rest:
                await cur.execute(
                    f"INSERT INTO {SKIPPED_TABLE} (lane, low_id, high_id, skipped_at_ms) VALUES (%s, %s, %s, %s)",
                    (self.lane, part_low, part_high, at),
                )

    def _held_in(self) -> str | None:
        """Where the lane holds the rows it was given (:func:`skipped_rows`): its table."""
        return self.table

    async def skipped_keys(self, cur: Any, condition: str, params: Sequence[Any]) -> list[int]:
        """The keys of the outbox's rows (alias ``o``) meeting ``condition`` that lie in the
        lane's skipped ranges and that it does not hold: inserts that committed after it gave
        up on their ids; none before the skipped ranges' table exists."""
        if SKIPPED_TABLE not in await table_names(cur, self.dialect):
            return []
        p = self.owner.profile
        await cur.execute(f"SELECT o.{p.key}{skipped_rows(p, self._held_in())} AND {condition}", (self.lane, *params))
        return [int(key) for (key,) in await cur.fetchall()]

    async def take_skipped(self, outbox_ids: Sequence[int], status: str | None = None) -> int:
        """Take the rows ``outbox_ids`` that lie in the lane's skipped ranges (inserts that
        committed after the lane gave up on their ids) back into the lane with ``status``
        (:meth:`_enter_skipped`; by default :attr:`skipped_to_send`); their ids leave the ranges (a range
        splits around them), so the ranges hold only what is still skipped. Returns how many
        rows were taken."""
        ids = sorted(set(outbox_ids))
        if not ids:
            return 0
        async with self.transaction() as cur:
            ranges = await self._skipped_among(cur, ids)
            taken = [i for i in ids if any(low <= i <= high for low, high, _ in ranges)]
            if not taken:
                return 0
            entered = await self._enter_skipped(cur, taken, status or self.skipped_to_send)
            await self._leave_skipped(cur, ranges, taken)
        return entered

    async def _enter_skipped(self, cur: Any, taken: Sequence[int], status: str) -> int:
        """Feed the skipped rows ``taken`` into the lane's table with ``status``: ``pending``,
        the lane sends them as any row fed; ``cancelled``, never."""
        p, now = self.owner.profile, now_ms()
        # A row fed to be sent says nothing of its own; a cancelled one, why it never was.
        error = None if status == V1.fresh else LANE_SKIPPED_ERROR
        entered = 0
        for chunk in key_chunks(taken):
            insert = (
                f"INSERT INTO {self.table} (outbox_id, event_id, event_type, room_id, app_code, status, last_error,"
                f" created_at_ms, updated_at_ms) SELECT {self._source_columns}, %s, %s, {now}, {now}"
                f" FROM {p.table} WHERE {p.key} IN ({_marks(chunk)})"
            )
            await cur.execute(self.dialect.insert_skipping_duplicates(insert, "outbox_id"), [status, error, *chunk])
            entered += int(cur.rowcount)
        return entered

    def _expire_gaps(self) -> list[Gap]:
        """Give up on the ranges missing longer than ``gap_timeout``; returns them."""
        now = time.monotonic()
        expired = [g for g in self._gaps if now - g.first_seen > self.gap_timeout]
        for gap in expired:
            log.warning(
                "ids never committed within gap_timeout; taken as rolled back and skipped",
                extra={"lane": self.lane, "from_id": gap.low, "to_id": gap.high},
            )
        self._gaps = [g for g in self._gaps if now - g.first_seen <= self.gap_timeout]
        return expired

    def _bound_gaps(self) -> list[Gap]:
        """At most ``max_gaps`` ranges: the longest-missing beyond that are given up on now;
        returns them."""
        excess = len(self._gaps) - self.max_gaps
        if excess <= 0:
            return []
        oldest = sorted(self._gaps, key=lambda g: (g.first_seen, g.low))[:excess]
        log.warning(
            "more ranges of ids missing than lanes.max_gaps; the longest-missing are skipped before gap_timeout",
            extra={
                "lane": self.lane,
                "skipped_ranges": excess,
                "from_id": min(g.low for g in oldest),
                "to_id": max(g.high for g in oldest),
                "max_gaps": self.max_gaps,
            },
        )
        dropped = {id(g) for g in oldest}
        self._gaps = [g for g in self._gaps if id(g) not in dropped]
        return oldest


__all__ = [
    "CURSOR_TABLE",
    "LaneStore",
    "StartPosition",
    "cursor_ddl",
    "lane_ddl",
    "lane_table",
    "migrate_lanes",
    "start_id",
]
