"""One lane's consumption state in one table, in SQL all three stores speak: claims with leases,
per-room hold-back, fenced result writes, lease renewal.

:class:`LeasedRows` holds the statements once; :class:`~.mysql.MySQLStore`,
:class:`~.postgres.PostgresStore`, :class:`~.sqlite.SQLiteStore` (the IM lane in
``room_outbox``) and :class:`~.mysql_lanes.LaneStore` (a lane of its own) give it a
transaction, a table and their dialect (its locking clause). The
claim reads ``status='pending' AND lock_until_ms <= now ORDER BY lock_until_ms, key``: a range
on the ``(status, lock_until_ms, key)`` index that stops after ``limit`` rows, however many
published rows, leased rows or rows waiting for a retry the table holds. A claim limited to
room buckets (per-room ordering with several processes, :mod:`.membership`) reads the same
range and checks the bucket, the index's last column on a server, in the index entries.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from room_outbox.store import Claimed, DeliveryResult, OutboxRow, Outcome, room_heads
from room_outbox.store.dialect import MYSQL, Dialect
from room_outbox.store.dialect import marks as _marks
from room_outbox.store.profiles import V1, Profile
from room_outbox.store.tables import ROOM_INDEX, TABLE, claim_index

#: Reads the room buckets a claim may take, with the claim's cursor (``None``: every room).
BucketReader = Callable[[Any], Awaitable[list[int] | None]]
LAST_ERROR_MAX = 512


def now_ms() -> int:
    return int(time.time() * 1000)


def claim_sql(
    table: str, key: str, envelope: str, lock: str, profile: Profile = V1, buckets: int = 0, hint: str = ""
) -> str:
    """The claim scan of one lane's table (see the module docstring). ``buckets``: how many
    room buckets the scan is limited to (placeholders after the time; 0: every room), checked
    in the claim index's entries, whose last column is the bucket (``hint``: the dialect's
    ``index_hint``, which makes sure of that on MySQL)."""
    p = profile
    only = f" AND room_bucket IN ({_marks(range(buckets))})" if buckets else ""
    forced = hint.format(index=claim_index(table)[0])
    return (
        f"SELECT {key}, {p.event_id}, {p.event_type}, {p.room_id}, {p.app_code}, {envelope}, {p.attempts}"
        f" FROM {table}{forced}"
        f" WHERE {p.is_open()} AND {p.lock} <= {p.ms('%s')}{only} ORDER BY {p.lock}, {key} LIMIT %s{lock}"
    )


def open_rows_of_rooms_sql(table: str, key: str, rooms: int, profile: Profile = V1, hint: str = "") -> str:
    """Per-room ordering's look-up: the open rows of ``rooms`` rooms (placeholders, then the
    highest key found) below that key, read by the room index. ``hint``: the dialect's
    ``index_hint``; left to choose, MySQL's optimizer read the (status, id) range below the key
    instead, which grows with every published row (1.2 ms against 0.3 ms for 100 rooms behind
    15,000 published rows)."""
    p = profile
    forced = hint.format(index=ROOM_INDEX.format(table=table))
    return (
        f"SELECT {key}, {p.app_code}, {p.room_id} FROM {table}{forced}"
        f" WHERE {p.room_id} IN ({_marks(range(rooms))}) AND {p.is_open()} AND {key} < %s"
    )


class LeasedRows:
    """One lane's consumption state in one table: claims with leases, fenced result writes.

    The IM lane keeps it in ``room_outbox`` itself (key ``id``); every other lane in its own
    table ``room_outbox_lane_<name>`` (key ``outbox_id``, see :mod:`.mysql_lanes`). Same
    columns, same indexes, same statements.
    """

    table = TABLE
    key = "id"
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

    def use_profile(self, profile: Profile) -> None:
        """Keep the IM lane's state in ``profile``'s table and words (``database.profile``)."""
        self.profile = profile
        self.table = profile.table
        self.key = profile.key
        self.envelope_column = profile.envelope

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        """A cursor taking ``%s`` placeholders in a transaction, committed when the block ends."""
        raise NotImplementedError

    @property
    def _claim_sql(self) -> str:
        return claim_sql(self.table, self.key, self.envelope_column, self.dialect.row_lock, self.profile)

    def _room_buckets(self) -> BucketReader | None:
        return self.room_buckets

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
    ) -> Claimed:
        read_buckets = self._room_buckets() if per_room else None
        async with self.transaction() as cur:
            lease_until_ms += await self._before_claim(cur)
            stale = await self._apply_results(cur, results)
            buckets = None if read_buckets is None else await read_buckets(cur)
            if buckets is None:
                await cur.execute(self._claim_sql, (now_ms(), limit))
            elif not buckets:  # none of its own yet (joining), or all handed over
                return Claimed([], stale, exhausted=True)
            else:
                # A locking scan would lock, for a moment, every row it reads, other processes'
                # rooms' among them, and make their claims skip those rows and hold their rooms
                # back. So: read without locks, then lock what was found by key.
                await cur.execute(
                    claim_sql(
                        self.table,
                        self.key,
                        self.envelope_column,
                        "",
                        self.profile,
                        len(buckets),
                        self.dialect.index_hint,
                    ),
                    (now_ms(), *buckets, limit),
                )
            scanned = await cur.fetchall()
            exhausted = len(scanned) < limit
            if buckets and scanned:
                scanned = await self._lock_found(cur, scanned)
            found = [
                OutboxRow(id, event_id, event_type, room_id, app_code, envelope, retries, claim)
                for id, event_id, event_type, room_id, app_code, envelope, retries in scanned
            ]
            rows = await self._heads_of_rooms(cur, found, hold_back_ms) if per_room else found
            if rows:
                ids = [row.id for row in rows]
                p = self.profile
                in_flight = "" if p.in_flight == p.fresh else f", status = '{p.in_flight}'"
                await cur.execute(
                    f"UPDATE {self.table} SET worker_id = %s, {p.lock} = {p.ms('%s')}{in_flight}"
                    f" WHERE {self.key} IN ({_marks(ids)})",
                    (claim, lease_until_ms, *ids),
                )
        return Claimed(rows, stale, exhausted=exhausted)

    async def _lock_found(self, cur: Any, scanned: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
        """Of rows read without locks, those still claimable, locked (others skipped)."""
        ids = [row[0] for row in scanned]
        await cur.execute(
            f"SELECT {self.key} FROM {self.table} WHERE {self.key} IN ({_marks(ids)})"
            f" AND {self.profile.is_open()} AND {self.profile.lock} <= {self.profile.ms('%s')}{self.dialect.row_lock}",
            (*ids, now_ms()),
        )
        locked = {row[0] for row in await cur.fetchall()}
        return [row for row in scanned if row[0] in locked]

    async def _heads_of_rooms(self, cur: Any, found: list[OutboxRow], hold_back_ms: int) -> list[OutboxRow]:
        """Keep a found row only if every earlier pending row of its room was found too.

        A row held back this way is made unclaimable for ``hold_back_ms``: otherwise a room
        with a long backlog behind a waiting event would fill every later scan with rows
        that cannot be taken, and the events they wait for would never come up.
        """
        if not found:
            return found
        rooms = sorted({row.room_id for row in found})
        found_ids = {row.id for row in found}
        await cur.execute(
            open_rows_of_rooms_sql(self.table, self.key, len(rooms), self.profile, self.dialect.index_hint),
            (*rooms, max(found_ids)),
        )
        heads = room_heads(found, await cur.fetchall())
        held_back = sorted(found_ids - {r.id for r in heads})
        if held_back:
            await cur.execute(
                f"UPDATE {self.table} SET {self.profile.lock} = {self.profile.ms('%s')}"
                f" WHERE {self.key} IN ({_marks(held_back)})",
                (now_ms() + hold_back_ms, *held_back),
            )
        return heads

    async def record(self, results: Sequence[DeliveryResult]) -> list[DeliveryResult]:
        if not results:
            return []
        async with self.transaction() as cur:
            return await self._apply_results(cur, results)

    async def renew(self, claim: str, row_ids: Sequence[int], lease_until_ms: int) -> int:
        if not row_ids:
            return 0
        async with self.transaction() as cur:
            return int(
                await cur.execute(
                    f"UPDATE {self.table} SET {self.profile.lock} = {self.profile.ms('%s')}"
                    f" WHERE {self.key} IN ({_marks(row_ids)}) AND worker_id = %s AND status = '{self.profile.in_flight}'",
                    (lease_until_ms, *row_ids, claim),
                )
            )

    async def _apply_results(self, cur: Any, results: Sequence[DeliveryResult]) -> list[DeliveryResult]:
        """Write results whose claim still holds the row; return the others (stale).

        Every write is fenced in its WHERE (``worker_id`` = the claim, still ``pending``), so
        a claimant that lost a row changes nothing. Published and released rows go in one
        statement per claim; only when it matched fewer rows than it was given (a lease taken
        over, an event the producer published or an operator cancelled meanwhile: rare) does
        a second read find out which. Failures are one statement each: they carry their own
        error text, and each one's row count tells whether it was stale."""
        now = now_ms()
        words = self.profile
        held = f"worker_id = %s AND status = '{words.in_flight}'"  # the fence: still this claim's
        stale: list[DeliveryResult] = []
        groups: dict[tuple[str, Outcome], list[DeliveryResult]] = {}
        for result in results:
            groups.setdefault((result.claim, result.outcome), []).append(result)
        for (claim, outcome), group in sorted(groups.items(), key=lambda item: (item[0][0], item[0][1].value)):
            if outcome in (Outcome.FAILED, Outcome.PARKED):
                for r in group:
                    status = f"'{words.parked}'" if outcome is Outcome.PARKED else words.after_failure()
                    matched = await cur.execute(
                        f"UPDATE {self.table} SET status = {status}, {words.attempts} = {words.attempts} + 1,"
                        f" last_error = %s, worker_id = NULL, {words.lock} = {words.ms('%s')},"
                        f" {words.updated} = {words.ms('%s')} WHERE {self.key} = %s AND {held}",
                        (
                            (r.error or "unknown error")[:LAST_ERROR_MAX],
                            r.retry_at_ms,
                            now,
                            r.row_id,
                            claim,
                        ),
                    )
                    if not matched:
                        stale.append(r)
                continue
            ids = sorted(r.row_id for r in group)
            if outcome is Outcome.PUBLISHED:
                change = (
                    f"status = '{words.delivered}', last_error = NULL, worker_id = NULL,"
                    f" {words.lock} = {words.lock_cleared}, {words.updated} = {words.ms('%s')}"
                )
                done = f"status = '{words.delivered}' AND worker_id IS NULL AND {words.updated} = {words.ms(str(int(now)))}"
                params: tuple[Any, ...] = (now, *ids, claim)
            else:  # RELEASED, THROTTLED: back to what it was before the claim, unattempted
                back = "" if words.in_flight == words.fresh else f"status = {words.released()}, "
                # THROTTLED: not before the latest time its limits may have room (0: at once).
                due = max(r.retry_at_ms for r in group)
                lock = words.ms("%s") if due else words.lock_cleared
                change = f"{back}worker_id = NULL, {words.lock} = {lock}"
                done = f"{words.is_waiting()} AND worker_id IS NULL"
                params = (*((due,) if due else ()), *ids, claim)
            matched = await cur.execute(
                f"UPDATE {self.table} SET {change} WHERE {self.key} IN ({_marks(ids)}) AND {held}",
                params,
            )
            if matched < len(ids):
                await cur.execute(
                    f"SELECT {self.key} FROM {self.table} WHERE {self.key} IN ({_marks(ids)}) AND {done}", ids
                )
                written = {row[0] for row in await cur.fetchall()}
                stale.extend(r for r in group if r.row_id not in written)
        return stale
