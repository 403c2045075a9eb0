"""Retention: delete — or move to ``room_outbox_archive`` — finished rows older than ``older_than``.

Only delivered rows nobody still needs are removed (:func:`cleanup` says when a row is
finished); pending, parked and cancelled rows stay whatever their age. Age is
``created_at_ms``, the one time room-service sets on every row. The job must stay out of
delivery's way: small batches along an index, each in a short transaction that locks only its
rows and skips those another cleaner holds, with a pause between two. The same statements run
on every database; the dialect supplies the locking clause and MySQL's index hints. The
consumers' processed records have a rule of their own (:func:`prune_consumer_records`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskStatus

from room_outbox.config import LanePlan, RetentionSettings
from room_outbox.errors import SchemaError, StoreError, StoreUnavailable
from room_outbox.store.backends.errors import mysql_error
from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import column_names, table_names
from room_outbox.store.factory import consumer_store
from room_outbox.store.lanes.catalog import first_row_after, owes_rows, stored_lanes
from room_outbox.store.lanes.store import lane_table
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.outbox import TABLE
from room_outbox.store.schema.tail import CANCELLED, PARKED_TABLE, SKIPPED_TABLE

log = logging.getLogger("room_outbox.retention")

ARCHIVE_TABLE = f"{TABLE}_archive"


def archive_table(table: str) -> str:
    return f"{table}_archive"


_DEADLOCK_RETRIES = 3
_LOCK_ERRORS = (1205, 1213)  # lock wait timeout, deadlock
_TABLE_EXISTS = 1050


#: The defaults of every retention option: those of the configuration, never a second copy.
_DEFAULTS = RetentionSettings()


@dataclass(frozen=True)
class RetentionOptions:
    older_than: float = _DEFAULTS.older_than
    batch_size: int = _DEFAULTS.batch_size
    pause: float = _DEFAULTS.pause
    archive: bool = _DEFAULTS.archive
    processed_older_than: float = _DEFAULTS.processed_older_than

    @classmethod
    def from_settings(
        cls, settings: RetentionSettings, older_than: float | None = None, archive: bool = False
    ) -> RetentionOptions:
        """The configured options; ``older_than`` and ``archive`` come from the command line."""
        return cls(
            older_than if older_than is not None else settings.older_than,
            settings.batch_size,
            settings.pause,
            archive or settings.archive,
            settings.processed_older_than,
        )


@dataclass
class CleanupReport:
    #: Rows deleted from ``room_outbox`` (with ``archive``, each was copied first).
    removed: int = 0
    #: Transactions that removed at least one row.
    batches: int = 0
    #: Most rows removed by one transaction: never above ``batch_size``.
    largest_batch: int = 0
    seconds: float = 0.0
    #: The highest id looked at so far.
    last_id: int = 0
    #: Lanes no longer enabled whose leftovers hold rows back (warned about).
    held_back_by: list[str] = field(default_factory=list)
    #: Enabled lanes that have never run: nothing is removed until they have (warned about).
    waiting_for: list[str] = field(default_factory=list)
    #: Whether ``status`` decided (the main lane runs, or no lane does).
    by_status: bool = True
    #: Ranges the tailing lanes skipped that were dropped: older than ``older_than``, no row in them.
    skipped_ranges_removed: int = 0


@dataclass
class ConsumerCleanupReport:
    """What a pass did to the consumers' tables (``present``: they exist here)."""

    present: bool = False
    #: Retry rows and dead letters removed because their event was handled since.
    resolved: int = 0
    #: Processed records removed (older than ``processed_older_than``).
    processed: int = 0
    #: Transactions that removed at least one row; none above ``batch_size`` rows.
    batches: int = 0
    seconds: float = 0.0


async def prune_consumer_records(
    store: SQLStore,
    options: RetentionOptions,
    *,
    now: int | None = None,
    stop: anyio.Event | None = None,
    dry_run: bool = False,
) -> ConsumerCleanupReport:
    """One pass over the consumers' tables (nothing on SQLite or before ``migrate``): resolved
    retry rows first, then the processed records they held back with the other old ones, each
    in batches of ``batch_size`` with ``pause`` between two; returns early once ``stop`` is
    set. ``dry_run``: counts, changing nothing.

    A processed record makes a redelivered message a no-op, so it may go only once its message
    can no longer come back: older than ``processed_older_than`` (which must exceed the topic's
    retention). Retry rows and dead letters whose event the same consumer and handler has
    handled since are resolved and go at any age (a retry would find the record and do
    nothing). A record stays while a retry row of its handling exists, whatever its age:
    without it that row would run the handler again. These are never archived."""
    started = time.monotonic()
    report = ConsumerCleanupReport()
    consumers = consumer_store(store)
    if consumers is None or not await consumers.migrated():
        return report
    report.present = True
    cutoff = (now if now is not None else now_ms()) - int(options.processed_older_than * 1000)
    if dry_run:
        report.resolved, report.processed = await consumers.count_removable(cutoff)
        report.seconds = time.monotonic() - started
        return report
    for step in ("resolved", "processed"):
        while stop is None or not stop.is_set():
            if step == "resolved":
                removed = await consumers.remove_resolved_retries(options.batch_size)
                report.resolved += removed
            else:
                removed = await consumers.remove_old_processed(cutoff, options.batch_size)
                report.processed += removed
            if not removed:
                break  # nothing left that may go (a batch another cleaner took also ends it)
            report.batches += 1
            if removed < options.batch_size:
                break
            await _pause(options, stop)
    report.seconds = time.monotonic() - started
    return report


async def _pause(options: RetentionOptions, stop: anyio.Event | None) -> None:
    """A pause lets the claims and result writes of delivery take the log flushes."""
    if stop is None:
        await anyio.sleep(options.pause)
    else:
        with anyio.move_on_after(options.pause):
            await stop.wait()


async def cleanup(
    store: SQLStore,
    options: RetentionOptions,
    plan: LanePlan | None = None,
    *,
    now: int | None = None,
    stop: anyio.Event | None = None,
    dry_run: bool = False,
    progress: Callable[[CleanupReport], None] | None = None,
) -> CleanupReport:
    """One pass over the finished rows; returns early (between batches) once ``stop`` is set.
    ``plan``: the lanes the configuration runs (default: the main lane alone). ``dry_run``: the
    same walk, counting the rows each batch would remove, changing nothing. ``progress`` is
    called after each batch.

    When a row is finished: while the main lane runs, once it is ``published`` (by room-outbox
    or by room-service's own push) and every lane of its own is done with it (:func:`_lanes`).
    While it does not (room-service pushes IM itself; room-outbox only fans events out),
    ``status`` is room-service's alone and says nothing of room-outbox's work: a row is finished
    once every lane of its own is done with it, whatever its status. With no lane running at
    all nothing can finish a row, so the main lane's rule applies.

    The walk follows the ``(status, id)`` index from the lowest published id (the primary key
    while the main lane is off), ``batch_size`` rows a step: each read is a short index range,
    never a scan. Ids rise with commit time, so the pass ends at the first batch with no old row."""
    started = time.monotonic()
    cutoff = (now if now is not None else now_ms()) - int(options.older_than * 1000)
    plan = plan or LanePlan(main=True, own=())
    by_status = plan.main or not plan.own
    report = CleanupReport(by_status=by_status)
    columns = await _archive_columns(store) if options.archive and not dry_run else None
    owers, fed_through, report.held_back_by, report.waiting_for = await _lanes(store, plan, cutoff)
    after = 0
    p = store.profile
    while stop is None or not stop.is_set():
        async with store.transaction() as cur:
            await cur.execute(
                f"SELECT {p.key}, {p.as_ms(p.created)} FROM {p.table} WHERE {p.key} > %s{_finished(store, by_status)}"
                f" ORDER BY {p.key} LIMIT %s",
                (after, options.batch_size),
            )
            seen: Sequence[tuple[int, int]] = await cur.fetchall()
        if not seen:
            break
        after = seen[-1][0]
        old = [row_id for row_id, created in seen if created <= cutoff and row_id <= fed_through]
        if not old:
            break  # ids rise with time: past this batch every published row is younger (or unfed)
        if dry_run:
            removed = await _count_removable(store, old, cutoff, owers, by_status)
        else:
            removed = await _remove(store, old, cutoff, columns, owers, by_status)
        if removed:
            report.removed += removed
            report.batches += 1
            report.largest_batch = max(report.largest_batch, removed)
        report.last_id = after
        report.seconds = time.monotonic() - started
        if progress is not None:
            progress(report)
        if len(seen) < options.batch_size:
            break
        if dry_run:
            continue  # nothing was written: no pause owed to delivery
        await _pause(options, stop)
    if owers.tail_skipped and not dry_run and (stop is None or not stop.is_set()):
        report.skipped_ranges_removed = await _forget_skipped_ranges(store, cutoff)
    report.seconds = time.monotonic() - started
    return report


async def _forget_skipped_ranges(store: SQLStore, cutoff: int) -> int:
    """Drop the id ranges tailing lanes skipped before ``cutoff`` that hold no row: an insert
    whose id was missing then has long been rolled back (or its row removed), so none can
    commit in them any more. A range with a row in it stays: that event is still owed."""
    p = store.profile
    async with store.transaction() as cur:
        return int(
            await cur.execute(
                f"DELETE FROM {SKIPPED_TABLE} WHERE skipped_at_ms <= %s AND NOT EXISTS"
                f" (SELECT 1 FROM {p.table} o WHERE o.{p.key} BETWEEN {SKIPPED_TABLE}.low_id AND {SKIPPED_TABLE}.high_id)",
                (cutoff,),
            )
        )


async def _remove(
    store: SQLStore,
    candidates: list[int],
    cutoff: int,
    archive_columns: list[str] | None,
    owers: _Owers,
    by_status: bool,
) -> int:
    """Remove (archiving first when ``archive_columns`` names the columns to copy) the
    candidates still finished and old, skipping rows another cleaner holds; one transaction.

    It locks only those rows (``FOR UPDATE SKIP LOCKED``), so the claim, which reads the
    ``pending`` range of another index, never waits on it, and two cleaners split a batch
    instead of waiting on each other. The re-check under the lock makes a second removal a
    no-op, and the archive copy shares the delete's transaction: a row is archived exactly
    once. (SQLite has one writer at a time: there two cleaners' batches take turns.)"""
    for attempt in range(_DEADLOCK_RETRIES):
        try:
            return await _remove_once(store, candidates, cutoff, archive_columns, owers, by_status)
        except Exception as exc:
            # InnoDB may still pick a cleaner as a deadlock victim (its transaction is rolled
            # back whole); the batch is simply taken again.
            if not mysql_error(exc, *_LOCK_ERRORS) or attempt == _DEADLOCK_RETRIES - 1:
                raise
    return 0


@dataclass(frozen=True)
class _Owers:
    """Where the lanes of their own keep the events they still owe: each lane table's pending
    and parked rows, the tailing lanes' parked (or requeued) rows, and the rows in the id
    ranges they skipped (inserts that committed after the lane gave up on them, never sent)."""

    lane_tables: list[str]
    tail_parked: bool
    tail_skipped: bool = False

    def not_owed(self, store: SQLStore) -> str:
        """SQL: no lane still owes the event (a requeue sends it from its row's envelope)."""
        table, key = store.profile.table, store.profile.key
        owed = [
            f"SELECT 1 FROM {lane} l WHERE l.outbox_id = {table}.{key} AND l.status IN ('pending', 'failed')"
            for lane in self.lane_tables
        ]
        if self.tail_parked:
            owed.append(
                f"SELECT 1 FROM {PARKED_TABLE} t WHERE t.outbox_id = {table}.{key} AND t.status <> '{CANCELLED}'"
            )
        if self.tail_skipped:
            owed.append(f"SELECT 1 FROM {SKIPPED_TABLE} s WHERE {table}.{key} BETWEEN s.low_id AND s.high_id")
        return "".join(f" AND NOT EXISTS ({query})" for query in owed)


def _finished(store: SQLStore, by_status: bool) -> str:
    """While the main lane runs (or no lane does), only delivered rows (``published`` in v1's
    words) are finished; the status words are the profile's constants, never input."""
    return f" AND status = '{store.profile.delivered}'" if by_status else ""


async def _count_removable(store: SQLStore, candidates: list[int], cutoff: int, owers: _Owers, by_status: bool) -> int:
    """How many of the candidates a removal would take now (``--dry-run``): its conditions, no lock."""
    marks = ", ".join(["%s"] * len(candidates))
    p = store.profile
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT COUNT(*) FROM {p.table}{store.dialect.primary_hint} WHERE {p.key} IN ({marks})"
            f"{_finished(store, by_status)} AND {p.created} <= {p.ms('%s')}{owers.not_owed(store)}",
            (*candidates, cutoff),
        )
        return int((await cur.fetchone())[0])


async def _remove_once(
    store: SQLStore,
    candidates: list[int],
    cutoff: int,
    archive_columns: list[str] | None,
    owers: _Owers,
    by_status: bool,
) -> int:
    marks = ", ".join(["%s"] * len(candidates))
    dialect, p = store.dialect, store.profile
    table, key = p.table, p.key
    owed = owers.not_owed(store)
    async with store.transaction() as cur:
        # MySQL: PRIMARY only: locking through a secondary index would take locks that the
        # DELETE of a concurrent cleaner needs next, which deadlocks (seen with two cleaners).
        await cur.execute(
            f"SELECT {key} FROM {table}{dialect.primary_hint} WHERE {key} IN ({marks}){_finished(store, by_status)}"
            f" AND {p.created} <= {p.ms('%s')}{owed}{dialect.row_lock}",
            (*candidates, cutoff),
        )
        ids = [row[0] for row in await cur.fetchall()]
        if not ids:
            return 0
        if archive_columns is not None:
            copied = await cur.execute(*_copy_listed(store, archive_columns, ids))
            # A row is deleted only once its copy is made: anything short of every locked row
            # copied rolls the whole batch back.
            if copied != len(ids):
                raise StoreError(
                    f"archiving copied {copied} of {len(ids)} row(s) to {archive_table(table)}; nothing was removed"
                )
        for lane in owers.lane_tables:  # the lanes' rows for these events are done with too
            await cur.execute(*_delete_listed(store, lane, "outbox_id", ids))
        return int(await cur.execute(*_delete_listed(store, table, key, ids)))


def _listed_ids(ids: list[int]) -> str:
    """MySQL: ``ids`` as a derived table ``h`` of one column ``id``, one row each.

    InnoDB locks every row a DELETE reads (at READ COMMITTED too) and waits for those another
    session holds. Where the ids are most of the table (a small one), the optimizer reads it
    whole instead of looking each id up, index hint or not (``FORCE INDEX (PRIMARY)`` still
    allows reading the whole primary key): one row a session holds locked, room-service's
    ``SELECT … FOR UPDATE`` or a lane's claim, then holds the batch up until the lock wait
    times out. Joined first (``STRAIGHT_JOIN``), this table makes each row be found by its key
    alone: a statement reads exactly the rows listed, which the batch holds."""
    return "(" + " UNION ALL ".join(["SELECT %s AS id"] + ["SELECT %s"] * (len(ids) - 1)) + ") AS h"


def _delete_listed(store: SQLStore, table: str, key: str, ids: list[int]) -> tuple[str, list[int]]:
    """The DELETE of the rows of ``table`` whose ``key`` is one of ``ids``, reading no other row."""
    if store.dialect.name == "mysql":
        return f"DELETE t FROM {_listed_ids(ids)} STRAIGHT_JOIN {table} AS t ON t.{key} = h.id", ids
    return f"DELETE FROM {table} WHERE {key} IN ({', '.join(['%s'] * len(ids))})", ids


def _copy_listed(store: SQLStore, columns: list[str], ids: list[int]) -> tuple[str, list[int]]:
    """The copy of the rows of ``ids`` to the archive table, reading no other row (as
    :func:`_delete_listed`)."""
    table, key = store.profile.table, store.profile.key
    names = ", ".join(columns)
    insert = f"INSERT INTO {archive_table(table)} ({names}) SELECT"
    if store.dialect.name == "mysql":
        picked = ", ".join(f"t.{column}" for column in columns)
        return f"{insert} {picked} FROM {_listed_ids(ids)} STRAIGHT_JOIN {table} AS t ON t.{key} = h.id", ids
    return f"{insert} {names} FROM {table} WHERE {key} IN ({', '.join(['%s'] * len(ids))})", ids


async def _lanes(store: SQLStore, plan: LanePlan, cutoff: int) -> tuple[_Owers, int, list[str], list[str]]:
    """Where the lanes keep what they owe; the highest id every lane has been fed through (rows above it are not
    removed: a lane has yet to copy them); the lanes no longer enabled whose leftovers hold
    old rows back, and the enabled lanes that never ran (each named in a warning).

    A row stays while any lane of its own has not been fed it, or holds it pending or parked
    (a tailing lane: parked or requeued): that lane still needs its envelope; with the row, the lanes' finished rows for it go too.
    A lane enabled but not started yet holds every row (it may start from the beginning). A
    lane no longer enabled still counts, since the database cannot tell a lane switched off
    for an hour from one gone for good; ``room-outbox lanes retire NAME --yes`` drops it."""
    stored = await stored_lanes(store)
    fed = {lane.name: lane.fed_through_id for lane in stored if lane.fed_through_id is not None}
    waiting = [lane for lane in plan.own if lane not in fed]  # enabled, never ran: may start at the beginning
    for name in waiting:
        log.warning(
            "an enabled lane has never run; retention removes nothing until it has",
            extra={"lane": name, "lifecycle": "retention_held_back"},
        )
    fed_through = min([*fed.values(), *(0 for _ in waiting)], default=2**63)
    enabled_low = min([fed[lane] for lane in plan.own if lane in fed] + [0 for _ in waiting], default=None)
    held_back_by = []
    for lane in stored:
        if lane.name in plan.own:
            continue
        # Its watermark holds back the old rows above it that the enabled lanes have passed;
        # its pending and parked rows hold back theirs.
        behind = False
        if lane.fed_through_id is not None and (enabled_low is None or lane.fed_through_id < enabled_low):
            first = await first_row_after(store, lane.fed_through_id)
            behind = first is not None and first <= cutoff
        if behind or (lane.has_table and await owes_rows(store, lane.name)):
            held_back_by.append(lane.name)
            log.warning(
                "a lane that is not enabled holds back retention; `room-outbox lanes retire %s --yes` drops it",
                lane.name,
                extra={"lane": lane.name, "fed_through_id": lane.fed_through_id, "lifecycle": "retention_held_back"},
            )
    async with store.transaction() as cur:
        tables = await table_names(cur, store.dialect)
    owers = _Owers([lane_table(lane.name) for lane in stored if lane.has_table], PARKED_TABLE in tables,
                   SKIPPED_TABLE in tables)  # fmt: skip
    return owers, fed_through, held_back_by, waiting


async def _archive_columns(store: SQLStore) -> list[str]:
    """Create the archive table when missing (a copy of ``room_outbox``'s definition) and name
    the columns to copy. A column added to ``room_outbox`` after the archive table was made is
    refused (:class:`SchemaError`, nothing removed) until the archive has it too: a row is
    deleted only once copied, and copied without that column its value would be lost."""
    dialect, table = store.dialect, store.profile.table
    archive = archive_table(table)
    async with store.transaction() as cur:
        if archive not in await table_names(cur, dialect):
            if dialect.name == "mysql":  # IF NOT EXISTS would warn on every pass
                try:
                    await cur.execute(f"CREATE TABLE {archive} LIKE {table}")
                except Exception as exc:
                    if not mysql_error(exc, _TABLE_EXISTS):  # another cleaner created it first: fine
                        raise
            elif dialect.name == "postgresql":
                await cur.execute(f"CREATE TABLE IF NOT EXISTS {archive} (LIKE {table} INCLUDING ALL)")
            else:  # SQLite: the columns and their types, without the id's AUTOINCREMENT
                await cur.execute(f"CREATE TABLE IF NOT EXISTS {archive} AS SELECT * FROM {table} WHERE 0")
        ours = await column_names(cur, dialect, table)
        archived = set(await column_names(cur, dialect, archive))
        if not archived:
            # The catalogue shows a table's columns only to a user with a privilege on it, and
            # MySQL gives the user who creates a table none: an empty list would copy nothing.
            raise StoreUnavailable(
                f"cannot see the columns of {archive}, so no row can be archived (nothing was removed):"
                f" grant INSERT and SELECT on {archive} to the user in database.dsn, or run cleanup"
                " --archive as one who has them"
            )
        computed: set[str] = set()
        # Generated columns (room_bucket) are computed, never copied.
        if dialect.name == "mysql":
            await cur.execute(
                "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE()"
                " AND TABLE_NAME = %s AND EXTRA LIKE '%%GENERATED%%'",
                (table,),
            )
            computed = {str(row[0]).lower() for row in await cur.fetchall()}
        elif dialect.name == "postgresql":
            await cur.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema()"
                " AND table_name = %s AND is_generated = 'ALWAYS'",
                (table,),
            )
            computed = {str(row[0]).lower() for row in await cur.fetchall()}
    lacking = [column for column in ours if column not in archived and column not in computed]
    if lacking:
        raise SchemaError(
            f"{archive} lacks {table}'s column(s) {', '.join(lacking)}, whose values archiving would lose, so no"
            f" row was removed: add them to {archive} as {table} has them (ALTER TABLE {archive} ADD COLUMN"
            f" {lacking[0]} …), or clean up without --archive"
        )
    return [column for column in ours if column not in computed]


async def run_retention_job(
    store: SQLStore,
    settings: RetentionSettings,
    stop: anyio.Event,
    plan: LanePlan | None = None,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """The optional background job: a pass every ``interval`` until ``stop`` is set. A failed
    pass is logged and tried again next interval; it never takes the process down."""
    options = RetentionOptions.from_settings(settings)
    log.info(
        "retention job started",
        extra={"lifecycle": "retention_started", "older_than": options.older_than, "archive": options.archive,
               "processed_older_than": options.processed_older_than},
    )  # fmt: skip
    task_status.started()
    while not stop.is_set():
        try:
            report = await cleanup(store, options, plan, stop=stop)
            log.info(
                "retention pass done",
                extra={"removed": report.removed, "batches": report.batches, "seconds": round(report.seconds, 3)},
            )
            consumers = await prune_consumer_records(store, options, stop=stop)
            if consumers.present:
                log.info(
                    "consumers' retention pass done",
                    extra={"processed_removed": consumers.processed, "resolved_removed": consumers.resolved,
                           "batches": consumers.batches, "seconds": round(consumers.seconds, 3)},
                )  # fmt: skip
        except Exception as exc:
            log.error("retention pass failed; next try after interval", extra={"error": f"{type(exc).__name__}: {exc}"})
        with anyio.move_on_after(settings.interval):
            await stop.wait()
    log.info("retention job stopped", extra={"lifecycle": "retention_stopped"})
