"""Tailing lanes: a sink that keeps order by itself (an ordered log such as a Kafka topic) reads
``room_outbox`` after the lane's cursor, with no per-row copy, claim or mark.

A round is one transaction: lock the lane's cursor row (``FOR UPDATE SKIP LOCKED``), read the
rows after it with the feeder's gap-safe rule (:class:`~room_outbox.store.lanes.store.LaneStore`:
ids still in flight below the highest id read are waited for, up to ``gap_timeout``), ids,
envelopes and the columns an envelope must agree with in one statement, let the caller publish
them (meanwhile the cursor's one write is made and the next round's rows are read), then park
what can never be delivered and commit.
The cursor row's lock is the lane's ownership: one process tails a lane at a time, the others
skip it, and a process that dies (even by kill -9) drops its connection and with it the lock, so
another takes over from the cursor — repeating at most the round in flight. A round that fails
(the broker down) is rolled back and read again, in order.

The cursor is the same ``room_outbox_lane_cursor`` row a lane-table lane uses ("every id at or
below ``fed_through_id`` is done"). A tailing lane also keeps there the highest id it has read
and the ranges below it still missing (:class:`TailCursor`): an id that is missing for a while
(a producer's transaction still open, a rolled-back insert) holds ``fed_through_id`` below it
for up to ``gap_timeout``, while the rounds go on sending what is above it, and a new owner
must not send all of that again. A range given up on (missing longer than ``gap_timeout``)
is recorded in the skipped table by the round that gives it up
(:meth:`TailStore._record_skipped`), so that an insert that commits after all can still be
found and sent. :func:`migrate_tail` moves the cursor back below the lane table's first row
still owed when a lane switches from its table to tailing, and moves the rows
the table parked, and those it cancelled, to the parked table; a round passes over the rows it
holds, so a parked row is sent only once requeued and a cancelled one never. The switch back
(:func:`~room_outbox.store.schema.tail.hand_back_steps`) carries the cancelled ones, and what
the lane sent above ``fed_through_id``, over to the new lane table.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar

from room_outbox.envelope import ROW_COLUMNS
from room_outbox.store.backends.errors import refused_value
from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import ascii_text, key_chunks, marks, text
from room_outbox.store.lanes.store import CURSOR_TABLE, Gap, LaneStore, StartPosition, log
from room_outbox.store.schema.lanes import KEPT_WIDTH
from room_outbox.store.schema.outbox import Migration
from room_outbox.store.schema.registry import WantedSchema, migrate, migration_plan
from room_outbox.store.schema.tail import (
    CANCELLED,
    PARKED,
    PARKED_TABLE,
    REQUEUED,
    SKIPPED,
    SKIPPED_ERROR,
    open_gap_ranges,
)

if TYPE_CHECKING:
    from room_outbox.store.protocol import SQLStore


@dataclass(slots=True)  # not frozen: a frozen dataclass costs twice as much to build, once per row
class TailRow:
    """A row as a round reads it: its key, envelope and the columns the envelope must agree
    with, nothing else (each column read costs the relay CPU per event; what parking needs
    besides is read for the parked rows alone). The envelope is as the driver gives it: the
    parser decodes bytes from a BLOB column and names what is wrong (bytes that are not UTF-8,
    a NULL) as that row's error, never the round's."""

    outbox_id: int
    envelope: str | bytes | None
    #: The row's :data:`~room_outbox.envelope.ROW_COLUMNS` read as one column, joined (one
    #: column read, one comparison); None where the profile builds the envelope from them.
    columns: str | bytes | None = None


async def _nothing() -> None:
    """A round's ``while_sending`` before the store sets it."""


#: The lane kept after a round rolled back: call it between two waits, so that the session
#: never sits idle longer than the server allows (it reads the cursor row again).
KeptLane = Callable[[], Coroutine[Any, Any, object]]


async def _not_kept() -> KeptLane | None:
    """A round's ``roll_back_keeping_lane`` before the store sets it."""
    return None


@dataclass
class TailRound:
    """The rows of one round, in id order (requeued rows first), and what the caller parks."""

    rows: list[TailRow]
    requeued: list[int] = field(default_factory=list)
    parked: dict[int, str] = field(default_factory=dict)
    #: The database's work for this round that need not wait for the sink, to run while the
    #: batch is on its way (see :meth:`TailStore.round`); never raises.
    while_sending: Callable[[], Coroutine[Any, Any, None]] = field(default=_nothing)
    #: For a caller about to fail the round: its work undone at once and the lane kept, while
    #: the caller waits for something of its own (:meth:`TailStore._roll_back_keeping_lane`).
    roll_back_keeping_lane: Callable[[], Coroutine[Any, Any, KeptLane | None]] = field(default=_not_kept)
    #: Where :attr:`while_sending` moved the cursor (None: not yet), or what it failed with.
    cursor: TailCursor | None = None
    failure: Exception | None = None
    #: Whether the round read a whole batch (rows it passes over unsent included): more are
    #: likely waiting, and the next round runs at once.
    full: bool = False

    def park(self, row: TailRow, error: str) -> None:
        self.parked[row.outbox_id] = error[:1024]


#: Seconds between two INFO lines of one process taking a tailing lane over.
RESUME_SAID_EVERY = 60.0


@dataclass(frozen=True)
class TailCursor:
    """A tailing lane's cursor row. Every id at or below ``fed_through_id`` is done (sent,
    parked, or given up on as never committed); above it, up to ``read_through_id``, every id
    is done but those in ``open_gaps``: the ranges still waited for, comma separated, each
    ``low-high@since``, ``since`` being when it was first seen missing in the cluster's epoch
    seconds (the database's clock), so that ``gap_timeout`` runs on across handovers; then
    ``/step:residue`` where the range's ids of that residue were read (:attr:`Gap.read`). So a new
    owner (after a kill, a failover, a restart) sends nothing again that a committed round
    sent, even while an id below it is still missing."""

    fed_through_id: int
    read_through_id: int | None = None
    open_gaps: str | None = None

    @classmethod
    def from_row(cls, fed_through_id: Any, read_through_id: Any, open_gaps: Any) -> TailCursor:
        """The cursor from its row's values as the database driver returns them."""
        return cls(
            int(fed_through_id),
            None if read_through_id is None else int(read_through_id),
            None if open_gaps is None else text(open_gaps),
        )

    def ranges(self) -> list[tuple[int, int, int, tuple[int, int] | None]]:
        """``open_gaps`` as ``(low, high, since, read)`` (:func:`open_gap_ranges`); ValueError
        when it does not parse."""
        return open_gap_ranges(self.open_gaps)

    def passed(self, outbox_id: int) -> bool:
        """Whether the lane is past ``outbox_id``: sent it (or passed it over as before its
        start); a row in a range still waited for committed late and goes next round. Ranges
        that do not parse: only what ``fed_through_id`` covers (the lane tails from it then)."""
        if outbox_id <= self.fed_through_id:
            return True
        if self.read_through_id is None or outbox_id > self.read_through_id:
            return False
        try:
            return not any(Gap(low, high, 0.0, read).waits_for(outbox_id) for low, high, _, read in self.ranges())
        except ValueError:
            return False


@dataclass
class TailStore(LaneStore):
    """One tailing lane over ``room_outbox``; ``feed_batch`` is the round's size."""

    #: A skipped event taken back to be sent is a requeued entry of the parked table.
    skipped_to_send: ClassVar[str] = REQUEUED
    #: The cursor as this process last wrote it: another value there means another process
    #: owned the lane meanwhile, and what this one remembers (ids seen, gaps) is stale.
    _committed: TailCursor | None = None
    #: The next round's rows, read ahead by the last round, with the highest id seen when they
    #: were read: the next round's own read as long as nothing moved.
    _ahead: tuple[int, list[TailRow]] | None = None
    #: When this process last said at INFO that it took the lane over (see :meth:`_resume`).
    _resume_said_at: float = -math.inf

    async def migrate(self) -> list[str]:
        return await migrate_tail(self.owner, [self.lane])

    async def _insert_cursor(self, cur: Any, start: StartPosition) -> bool:
        """Make the lane's cursor row at ``start``: the ids still in flight then are its first
        ranges waited for (:class:`TailCursor`), seen missing at the start, so that whichever
        process takes the lane first sends them once they commit and nothing committed before;
        False when another process made the row first."""
        since = now_ms() // 1000
        open_gaps = ",".join(f"{low}-{high}@{since}" for low, high in start.missing) or None
        read_through = start.read_through_id if open_gaps else None
        insert = (
            f"INSERT INTO {CURSOR_TABLE} (lane, fed_through_id, read_through_id, open_gaps, updated_at_ms)"
            " VALUES (%s, %s, %s, %s, %s)"
        )
        await cur.execute(
            self.dialect.insert_skipping_duplicates(insert, "lane"),
            (self.lane, start.fed_through_id, read_through, open_gaps, now_ms()),
        )
        return bool(cur.rowcount)

    @asynccontextmanager
    async def round(self) -> AsyncIterator[TailRound | None]:
        """One round in one transaction; None when another process owns the lane right now.
        Leaving the block normally parks ``round.parked``, moves the cursor and commits; an
        exception rolls everything back (the rows are read again next round).

        The caller may run ``round.while_sending`` while its batch is on its way to the sink:
        the cursor's write is made then (it counts only once the round commits, after the
        sink's answer) and, after a full read, the next round's rows are read, in this
        transaction, so that the database and the sink work at the same time instead of in
        turn. Reading rows a moment earlier changes nothing else: ids still in flight below
        them are waited for as gaps all the same, and nothing read ahead counts as done until
        the round that sends it commits."""
        await self._create_cursor()
        ahead, self._ahead = self._ahead, None
        with self._forgotten_unless_committed():
            async with self.transaction() as cur:
                locked = await self._lock(cur)
                if locked is None:
                    yield None
                    return
                cursor, any_requeued, any_held = locked
                watermark = cursor.fed_through_id
                if cursor != self._committed:
                    self._resume(cursor)
                    ahead = None
                self._gaps = [g for g in self._gaps if g.high > watermark]
                read = ahead[1] if ahead is not None and ahead[0] == self._high else await self._read(cur)
                fresh = [row.outbox_id for row in read if row.outbox_id > self._high]
                if not read:
                    await self._warn_if_ids_started_again(cur, self._high)
                self._turned_up([row.outbox_id for row in read if row.outbox_id <= self._high], watermark)
                self._take_new(fresh, watermark)
                requeued = await self._requeued(cur) if any_requeued else []
                again = await self._rows(cur, requeued)
                held = await self._held(cur, read) if any_held else set()
                to_send = [row for row in read if row.outbox_id not in held]
                tail = TailRound(rows=again + to_send, requeued=requeued, full=len(read) >= self.feed_batch)
                for gone in sorted(set(requeued) - {row.outbox_id for row in again}):
                    # Deleted from room_outbox since it was parked: nothing to send, and not sent.
                    tail.parked[gone] = "requeued, but its row is no longer in room_outbox: nothing to send"
                    log.warning(
                        "a requeued event's row is gone from room_outbox; it stays parked",
                        extra={"lane": self.lane, "outbox_id": gone},
                    )
                # A full read: more are likely waiting.
                tail.while_sending = functools.partial(
                    self._while_sending, cur, tail, cursor, len(fresh) >= self.feed_batch
                )
                tail.roll_back_keeping_lane = functools.partial(self._roll_back_keeping_lane, cur)
                try:
                    yield tail
                    if tail.failure is not None:
                        raise tail.failure
                except BaseException:
                    self._ahead = None  # read in a transaction that does not commit
                    raise
                await self._park(cur, tail)
                committed = tail.cursor if tail.cursor is not None else await self._move_cursor(cur, cursor)
        self._committed = committed

    async def _roll_back_keeping_lane(self, cur: Any) -> KeptLane | None:
        """Roll the round back now and lock the cursor row again at once, on the same
        connection: the lane stays this process's (the others skip it) in a transaction that
        holds nothing of ``room_outbox``, so room-service's schema changes need not wait, while
        the caller waits for the sink; the caller then fails the round, which lets the lane go.
        None where another process took the lane in between, or the database has no row locks."""
        self._ahead = None  # read in the transaction rolled back
        if not self.dialect.row_lock:
            return None
        await cur.execute("ROLLBACK")
        if await self._lock_cursor(cur) is None:
            return None
        return functools.partial(self._lock_cursor, cur)

    def _resume(self, cursor: TailCursor) -> None:
        """Take the lane over from its cursor row (the first round, or another process owned it
        meanwhile): go on from the highest id read, waiting for the ranges still missing until
        ``gap_timeout`` after they were first seen missing, by whichever process. Ranges that
        do not parse make it start from ``fed_through_id`` instead: events sent above it may
        be sent again, none is skipped."""
        self._high, self._gaps, self._last_id = cursor.fed_through_id, [], None
        read_through = cursor.read_through_id
        if read_through is not None and read_through > cursor.fed_through_id:
            try:
                ranges = cursor.ranges()
            except ValueError:
                log.warning(
                    "the cursor's open_gaps do not parse; tailing from fed_through_id: events above it may be sent again",
                    extra={"lane": self.lane, "fed_through_id": cursor.fed_through_id},
                )
            else:
                # Their first sight on this process's monotonic clock, from the cluster's clock.
                now, cluster_now = time.monotonic(), now_ms() / 1000
                self._high = read_through
                self._gaps = [
                    Gap(max(low, cursor.fed_through_id + 1), high, now - max(0.0, cluster_now - since), read)
                    for low, high, since, read in ranges
                    if high > cursor.fed_through_id
                ]
        # With light traffic and several processes the lane changes hands at almost every round
        # (whichever polls first takes it): said at INFO once in RESUME_SAID_EVERY, else DEBUG.
        now = time.monotonic()
        level = logging.INFO if now - self._resume_said_at >= RESUME_SAID_EVERY else logging.DEBUG
        if level == logging.INFO:
            self._resume_said_at = now
        log.log(
            level,
            "tailing the lane from its cursor",
            extra={"lane": self.lane, "fed_through_id": cursor.fed_through_id, "read_through_id": self._high},
        )

    async def _while_sending(self, cur: Any, tail: TailRound, cursor: TailCursor, read_ahead: bool) -> None:
        """Move the cursor and, with ``read_ahead``, read the next round's rows (:meth:`round`).
        A failure is kept in ``tail`` and fails the round when it ends."""
        try:
            tail.cursor = await self._move_cursor(cur, cursor)
            if read_ahead:
                self._ahead = (self._high, await self._read(cur))
        except Exception as exc:
            tail.failure = exc

    async def _move_cursor(self, cur: Any, before: TailCursor) -> TailCursor:
        """Write where the lane is (:class:`TailCursor`) when it moved, and the ranges it gave
        up on (:meth:`_record_skipped`); return it."""
        skipped = self._expire_gaps() + self._bound_gaps()
        if skipped:
            await self._record_skipped(cur, skipped)
        after = TailCursor(
            min(g.low for g in self._gaps) - 1 if self._gaps else self._high,
            self._high,
            self._gaps_text(),
        )
        if after != before:
            await cur.execute(
                f"UPDATE {CURSOR_TABLE} SET fed_through_id = %s, read_through_id = %s, open_gaps = %s,"
                " updated_at_ms = %s WHERE lane = %s",
                (after.fed_through_id, after.read_through_id, after.open_gaps, now_ms(), self.lane),
            )
        return after

    def _gaps_text(self) -> str | None:
        """The ranges waited for as ``open_gaps`` (:class:`TailCursor`), None when there are none.
        Whole seconds: the same text from round to round, though the cluster's clock is measured
        again now and then."""
        if not self._gaps:
            return None
        now, cluster_now = time.monotonic(), now_ms() / 1000
        return ",".join(
            f"{g.low}-{g.high}@{round(cluster_now - (now - g.first_seen))}"
            + ("" if g.read is None else f"/{g.read[0]}:{g.read[1]}")
            for g in sorted(self._gaps, key=attrgetter("low"))
        )

    async def _lock(self, cur: Any) -> tuple[TailCursor, bool, bool] | None:
        """The cursor, locked (None: another process owns the lane right now), whether any of
        the lane's parked rows are requeued and whether the parked table holds any row above
        ``fed_through_id`` (:meth:`_held`), in the same statement (a locking read does not lock
        what a subquery in its column list reads)."""
        also = (
            f", read_through_id, open_gaps, EXISTS (SELECT 1 FROM {PARKED_TABLE} WHERE lane = %s AND status = %s),"
            f" EXISTS (SELECT 1 FROM {PARKED_TABLE} WHERE lane = %s AND outbox_id > {CURSOR_TABLE}.fed_through_id)"
        )
        row = await self._lock_cursor(cur, also, (self.lane, REQUEUED, self.lane))
        if row is None:
            return None
        fed, read_through, open_gaps, any_requeued, any_held = row
        return TailCursor.from_row(fed, read_through, open_gaps), bool(any_requeued), bool(any_held)

    async def _held(self, cur: Any, rows: Sequence[TailRow]) -> set[int]:
        """The ids among ``rows`` (in id order) that the parked table holds: rows the lane has
        not reached yet that its lane table parked or an operator cancelled there (the switch
        to tailing carries them over), or that a round reads again (the cursor's ranges lost).
        The lane passes over them, unsent, as it passes over rows it sent: a cancelled one is
        never sent, a parked one only once requeued (then as a requeued row, first)."""
        if not rows:
            return set()
        await cur.execute(
            f"SELECT outbox_id FROM {PARKED_TABLE} WHERE lane = %s AND outbox_id BETWEEN %s AND %s",
            (self.lane, rows[0].outbox_id, rows[-1].outbox_id),
        )
        return {int(r[0]) for r in await cur.fetchall()}

    async def _read(self, cur: Any) -> list[TailRow]:
        """In one statement, in id order: the rows above the highest id seen, up to
        ``feed_batch``, and the rows that turned up in the ranges seen missing (ids that
        were in flight)."""
        p, read = self.owner.profile, self._row_columns()
        above = f"SELECT {read} FROM {p.table} WHERE {p.key} > %s ORDER BY {p.key} LIMIT %s"
        if not self._gaps:
            await cur.execute(above, (self._high, self.feed_batch))
            return self._tail_rows(await cur.fetchall())
        ranges, bounds = self._gap_ranges()
        late = f"SELECT {read} FROM {p.table} WHERE {ranges}"
        await cur.execute(
            self.owner.dialect.union_after_limit.format(first=above, second=late),
            (self._high, self.feed_batch, *bounds),
        )
        return sorted(self._tail_rows(await cur.fetchall()), key=attrgetter("outbox_id"))

    async def _rows(self, cur: Any, ids: Sequence[int]) -> list[TailRow]:
        if not ids:
            return []
        p = self.owner.profile
        await cur.execute(f"SELECT {self._row_columns()} FROM {p.table} WHERE {p.key} IN ({marks(ids)})", list(ids))
        found = {row.outbox_id: row for row in self._tail_rows(await cur.fetchall())}
        return [found[i] for i in ids if i in found]

    def _row_columns(self) -> str:
        """SQL: what a round reads of a row (:class:`TailRow`). The columns its envelope must
        agree with come as one text, not where the profile builds the envelope from them."""
        p = self.owner.profile
        if p.envelope_from_columns:
            return f"{p.key}, {self.owner.envelope_column}"
        columns = self.dialect.joined_text([getattr(p, name) for name in ROW_COLUMNS])
        return f"{p.key}, {self.owner.envelope_column}, {columns}"

    def _tail_rows(self, fetched: Sequence[Sequence[Any]]) -> list[TailRow]:
        if self.owner.profile.envelope_from_columns:
            return [TailRow(int(r[0]), r[1]) for r in fetched]
        return [TailRow(int(r[0]), r[1], r[2]) for r in fetched]

    async def _requeued(self, cur: Any) -> list[int]:
        await cur.execute(
            f"SELECT outbox_id FROM {PARKED_TABLE} WHERE lane = %s AND status = %s ORDER BY outbox_id LIMIT %s",
            (self.lane, REQUEUED, self.feed_batch),
        )
        return [int(r[0]) for r in await cur.fetchall()]

    async def _park(self, cur: Any, tail: TailRound) -> None:
        """Requeued rows sent are done; rows that failed for good are (again) parked."""
        now = now_ms()
        done = [i for i in tail.requeued if i not in tail.parked]
        if done:
            await cur.execute(
                f"DELETE FROM {PARKED_TABLE} WHERE lane = %s AND outbox_id IN ({marks(done)})", [self.lane, *done]
            )
        named = await self._names(cur, [i for i in tail.parked if i not in tail.requeued])
        for outbox_id, error in tail.parked.items():
            try:
                async with self._undone_if_refused(cur):
                    await self._park_one(cur, outbox_id, error, outbox_id in tail.requeued, named, now)
            except Exception as exc:
                if refused_value(exc) is None or error.isascii():
                    raise
                # A parked table in a character set without some of the text's characters (a
                # LATIN1 database) refuses it: kept with them escaped, the lane goes on.
                error = ascii_text(error)
                await self._park_one(cur, outbox_id, error, outbox_id in tail.requeued, named, now)
            if outbox_id not in tail.requeued:
                event_id, room_id = named.get(outbox_id, ("", ""))
                log.warning(
                    "event parked: it can never be delivered",
                    extra={"lane": self.lane, "outbox_id": outbox_id, "event_id": event_id, "room_id": room_id,
                           "error": error},
                )  # fmt: skip

    async def _park_one(
        self, cur: Any, outbox_id: int, error: str, requeued: bool, named: dict[int, tuple[str, str]], now: int
    ) -> None:
        """Park ``outbox_id`` with ``error``: a requeued row parked again, or a new parked row."""
        if requeued:
            await cur.execute(
                f"UPDATE {PARKED_TABLE} SET status = %s, last_error = %s, updated_at_ms = %s"
                " WHERE lane = %s AND outbox_id = %s",
                (PARKED, error, now, self.lane, outbox_id),
            )
            return
        # Parked already by an owner before a handover: this error replaces that one.
        await cur.execute(f"DELETE FROM {PARKED_TABLE} WHERE lane = %s AND outbox_id = %s", (self.lane, outbox_id))
        event_id, room_id = named.get(outbox_id, ("", ""))  # "": the row is gone since the read
        event_id, room_id = event_id[:KEPT_WIDTH], room_id[:KEPT_WIDTH]  # as a lane's copies are cut
        await cur.execute(
            f"INSERT INTO {PARKED_TABLE} (lane, outbox_id, event_id, room_id, status, last_error,"
            " created_at_ms, updated_at_ms) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            (self.lane, outbox_id, event_id, room_id, PARKED, error, now, now),
        )

    async def _names(self, cur: Any, ids: Sequence[int]) -> dict[int, tuple[str, str]]:
        """The event id and room id of the rows ``ids``, as their columns hold them."""
        if not ids:
            return {}
        p = self.owner.profile
        await cur.execute(
            f"SELECT {p.key}, {p.event_id}, {p.room_id} FROM {p.table} WHERE {p.key} IN ({marks(ids)})", list(ids)
        )
        return {int(r[0]): (str(r[1]), str(r[2])) for r in await cur.fetchall()}

    async def parked(self) -> list[dict[str, Any]]:
        """The lane's parked and requeued rows, oldest first (not those cancelled)."""
        async with self.transaction() as cur:
            await cur.execute(
                f"SELECT outbox_id, event_id, room_id, status, last_error FROM {PARKED_TABLE}"
                " WHERE lane = %s AND status <> %s ORDER BY outbox_id",
                (self.lane, CANCELLED),
            )
            names = ("outbox_id", "event_id", "room_id", "status", "last_error")
            return [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]

    async def requeue(self, outbox_ids: Sequence[int] | None = None) -> int:
        """Send parked rows again (all of the lane's when ``outbox_ids`` is None); returns how many."""
        update = f"UPDATE {PARKED_TABLE} SET status = %s, updated_at_ms = %s WHERE lane = %s AND status = %s"
        params = [REQUEUED, now_ms(), self.lane, PARKED]
        if outbox_ids is not None and not outbox_ids:
            return 0
        async with self.transaction() as cur:
            if outbox_ids is None:
                await cur.execute(update, params)
                return int(cur.rowcount)
            changed = 0
            for chunk in key_chunks(outbox_ids):  # a statement per chunk of keys, all or none applied
                await cur.execute(f"{update} AND outbox_id IN ({marks(chunk)})", [*params, *chunk])
                changed += int(cur.rowcount)
            return changed

    def _held_in(self) -> str | None:
        """A tailing lane holds the rows it was given in the parked table alone."""
        return None

    async def _enter_skipped(self, cur: Any, taken: Sequence[int], status: str) -> int:
        """Make the skipped rows ``taken`` entries of the parked table with ``status``:
        ``requeued``, the next round sends them as it sends a requeued parked event;
        ``cancelled``, never sent."""
        p, now = self.owner.profile, now_ms()
        cut = f", SUBSTR({{column}}, 1, {KEPT_WIDTH})"  # as a lane's copies are cut
        entered = 0
        for chunk in key_chunks(taken):
            await cur.execute(
                f"INSERT INTO {PARKED_TABLE} (lane, outbox_id, event_id, room_id, status, last_error,"
                f" created_at_ms, updated_at_ms) SELECT '{self.lane}', {p.key}"
                + cut.format(column=p.event_id)
                + cut.format(column=p.room_id)
                + f", '{status}', %s, {now}, {now} FROM {p.table}"
                f" WHERE {p.key} IN ({marks(chunk)})"
                f" AND NOT EXISTS (SELECT 1 FROM {PARKED_TABLE} e WHERE e.lane = '{self.lane}'"
                f" AND e.outbox_id = {p.table}.{p.key})",
                [SKIPPED_ERROR, *chunk],
            )
            entered += int(cur.rowcount)
        return entered

    async def cancel(self, event_id: str, apply: bool, app_code: str | None = None) -> str | None:
        """The status ``event_id`` has among the lane's parked rows, or ``skipped`` (None: it
        is neither); with ``apply`` a ``parked`` one, or a skipped one (:meth:`take_skipped`),
        is made ``cancelled``: the lane never sends it, and requeue, the backlog and retention
        no longer count it. Not a requeued one: it may be on its way already. With ``app_code``, only the entry of that app's row
        (event ids may be unique per app only): found by the row's key, so an entry whose row
        is gone is not found."""
        where = "lane = %s AND event_id = %s"
        params: list[Any] = [self.lane, event_id]
        skipped: list[int] = []
        async with self.transaction() as cur:
            if app_code is not None:
                p = self.owner.profile
                await cur.execute(
                    f"SELECT {p.key} FROM {p.table} WHERE {p.event_id} = %s AND {p.app_code} = %s", (event_id, app_code)
                )
                keys = [int(key) for (key,) in await cur.fetchall()]
                if not keys:
                    return None
                where, params = f"lane = %s AND outbox_id IN ({marks(keys)})", [self.lane, *keys]
            if apply:
                await cur.execute(
                    f"UPDATE {PARKED_TABLE} SET status = %s, updated_at_ms = %s WHERE {where} AND status = %s",
                    (CANCELLED, now_ms(), *params, PARKED),
                )
                if cur.rowcount:
                    return PARKED
            await cur.execute(f"SELECT status FROM {PARKED_TABLE} WHERE {where}", params)
            found = await cur.fetchone()
            if found is None:  # skipped, perhaps: an insert that committed after the lane gave up on its id
                p = self.owner.profile
                of_app = "" if app_code is None else f" AND o.{p.app_code} = %s"
                skipped = await self.skipped_keys(
                    cur, f"o.{p.event_id} = %s{of_app}", (event_id, *(() if app_code is None else (app_code,)))
                )
        if found is not None:
            return str(found[0])
        if not skipped:
            return None
        if apply:
            await self.take_skipped(skipped, CANCELLED)
        return SKIPPED


async def migrate_tail(store: SQLStore, lanes: Sequence[str]) -> list[str]:
    """The tailing lanes' tables, through the one migration path (:mod:`room_outbox.store.schema.tail`)."""
    return await migrate(store, WantedSchema(outbox=False, tail_lanes=tuple(lanes)))


async def tail_migration_plan(store: SQLStore, lanes: Sequence[str]) -> list[Migration]:
    """What :func:`migrate_tail` would do."""
    return await migration_plan(store, WantedSchema(outbox=False, tail_lanes=tuple(lanes)))


__all__ = ["KeptLane", "TailCursor", "TailRound", "TailRow", "TailStore", "migrate_tail", "tail_migration_plan"]
